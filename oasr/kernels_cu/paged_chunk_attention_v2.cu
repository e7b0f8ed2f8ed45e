// paged_chunk_attention_v2.cu -- the chunk attention of paged_chunk_attention.cu
// (v1, the readable scalar kernel, kept beside it) on tensor cores: Q K^T and
// P V on mma.m16n8k16, K/V pages gathered through a cp.async ring.
//
// Computes exactly what v1 computes (the oracle is
// oasr.reference.paged_ops.paged_attention; the window, GQA, causal and
// split semantics are v1's, see its header), for T = fp16 / bf16 queries and
// pages in T or fp8 e4m3 (one fp32 power-of-two scale per vector), head_dim
// D = 64 or 128, and a compile-time block size BS. One difference of
// contract, shared with v1 and the reference: a query row past its chunk
// length (t >= len_b), or a row that sees no key, writes exactly zero even
// when V holds NaN or Inf inside the visible range (the store selects zero;
// it never multiplies by it). The combine kernel is v1's.
//
// Mapping. Grid (q_tiles * num_splits, n_kv_head, B), 128 threads = 4 warps.
//   The query rows of one (stream b, KV head) are its group's (t, g) pairs,
//   row = t * group + g (so rows with t < len form a prefix), packed into the
//   MMA's M dimension: warp w owns rows row0 + 16 w .. + 15 of the CTA's 64,
//   q_tiles = ceil(group * T / 64) (1 at ASR shapes: group 2 x chunk 16 = 32
//   rows, so every K/V tile is read from memory once per KV head and split).
//   Rows past group * T are padding: zero queries, masked, never stored.
//
//   Per tile of KT = 32 keys, warp w (with at least one valid row):
//     S (16 x 32)  = Q_w (16 x D, A fragments held in registers all along)
//                    x K^T (ldmatrix_x4 of K rows),         4 x D/16 mma
//     S *= scale * log2(e) * k_scale[key]    (fp8: the k scale folded into S's columns)
//     online softmax in fp32 on S's registers (quad shuffles for row max/sum)
//     P (16 x 32) -> A fragments straight from S's registers (times v_scale[key]
//                    for fp8: the v scale folded into P's columns), rounded to T
//     O (16 x D)  += P x V (ldmatrix_x4_trans of V rows),   2 x D/8 mma
//
//   Fragment layouts: warp_mma.cuh. S's C fragment (rows g, g+8; keys 2q, 2q+1
//   of each 8-key n-tile) is P's A fragment for the 16-key k-step that holds
//   the two n-tiles, so P never leaves registers.
//
// Pipeline. K and V tiles are gathered page by page: for each key position
//   pos of the tile, slot = table[pos / BS] * BS + pos % BS (BS a template
//   parameter: shifts, no divides), 16-byte cp.async chunks into a ring of
//   kStages stages (3 at D = 64, 2 at D = 128: static shared memory stays
//   under 48 KB). Keys past the split's end are zero-filled (cp.async with
//   src-size 0; the pool is not read there). The block-table entries the CTA
//   needs are loaded once into shared memory, a window of kTableWindow
//   entries at a time (one window covers >= 1024 keys). Each iteration:
//   wait for tile i (wait_group<kStages - 2>), barrier, issue tile i +
//   kStages - 1 into the stage tile i - 1 used, compute tile i. Loads of the
//   next tiles overlap the tensor-core work of this one.
//
// fp8 pages. cp.async moves the raw e4m3 bytes (16 per chunk); after the
//   barrier the CTA widens the stage into 16-bit tiles in shared memory
//   (packed fp8x2_to: exact), K to T and V to bf16, which the mma loop reads
//   as it reads 16-bit pages. The per-vector scales (4-byte cp.async in the
//   tile's group, 0 for zero-filled keys) never touch K or V elements: k_scale[key] joins the
//   softmax scale in S's column factor, v_scale[key] multiplies P's column
//   before P is rounded for the P V mma. Powers of two: exact in fp32. P V
//   runs in bf16 on fp8 pages even for fp16 queries: p * v_scale can be far
//   below fp16's normal range (v_scale ~ amax / 448), where fp16 would round
//   it as a subnormal; bf16 keeps fp32's exponent range.
//
// Precision. S = Q K^T accumulates exact products in fp32, softmax is fp32;
//   P is rounded to the P V type (T, or bf16 on fp8 pages) as in every
//   FlashAttention-style kernel, so an output differs from the fp32
//   reference by at most that type's unit roundoff times sum_j p_j |v_j| / l,
//   plus fp32 reordering and the final rounding to T (the tests' bound,
//   oasr.fast.kernels.testing.v2_bound).
//
// Resources (NVRTC 13, `python -m oasr kernels --arch sm_80,sm_90`; the same for
//   every block size): registers per thread 120-126 at D = 64 and 163-166 at
//   D = 128, no spills, no stack; static shared memory 27.5 KB (16-bit pages)
//   / 25.3 KB (fp8) at D = 64, 34.5 KB / 36 KB at D = 128. Registers bound
//   residency: 4 CTAs (16 warps) per SM at D = 64, 3 (12 warps) at D = 128.
//   The gather and fp8-widening loops are kept rolled: unrolled, ptxas on
//   sm_90 held their offsets live and spilled at D = 128. Main loop on sm_90
//   (`python -m oasr kernels --sass`, bf16, D = 64, one 32-key tile, one
//   warp): about 550 SASS instructions with 32 HMMA and 16 LDSM (fp8 pages:
//   about 670). Nothing here is timed: no GPU has run this kernel yet.
//
// Checked by: tests/test_kernels_emulated.py and tests/test_fp8_kernels.py
//   (every attention case runs v1 and v2 under the host emulation),
//   tests/test_kernels_cuda.py (GPU; not run in this repository's CI).
#include "attention_window.cuh"
#include "common.cuh"
#include "warp_mma.cuh"

namespace oasr {

namespace attn2 {
template <bool C, typename A, typename B>
struct Pick {
    using type = A;
};
template <typename A, typename B>
struct Pick<false, A, B> {
    using type = B;
};
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kRowsPerWarp = 16;  // one MMA M tile
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int KT = 32;             // keys per tile
constexpr int kTableWindow = kThreads;  // block-table entries held in shared memory: one per thread

// 16 e4m3 bytes -> 16 U values (two 16-byte words), element order kept.
template <typename U>
__device__ __forceinline__ void widen_fp8x16(const Bytes16& raw, Bytes16 (&wide)[2]) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        wide[w / 2].w[2 * (w % 2)] = warp::fp8x2_to<U>(static_cast<unsigned short>(raw.w[w] & 0xffffu));
        wide[w / 2].w[2 * (w % 2) + 1] = warp::fp8x2_to<U>(static_cast<unsigned short>(raw.w[w] >> 16));
    }
}
}  // namespace attn2

template <typename T, typename Page, int D, int BS>
__global__ void __launch_bounds__(attn2::kThreads) paged_chunk_attention_v2_kernel(
    const T* __restrict__ q, const Page* __restrict__ k_cache, const Page* __restrict__ v_cache,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, const int* __restrict__ block_table,
    int table_stride, const int* __restrict__ cache_seqlens, const int* __restrict__ cache_seqstarts,
    const int* __restrict__ chunk_lens, T* __restrict__ out, float* __restrict__ part_acc,
    float* __restrict__ part_ml, int n_head, int n_kv_head, int num_frames, int num_splits, int split_len,
    float scale_log2, int causal) {
    using namespace attn2;
    using warp::cp_async_16;
    using warp::ldmatrix_x4;
    using warp::ldmatrix_x4_trans;
    using warp::mma_m16n8k16;
    using warp::pack2;
    static_assert(D == 64 || D == 128, "v2 tiles head_dim 64 or 128");
    static_assert(sizeof(T) == 2, "v2 takes fp16 or bf16 queries");
    constexpr bool kFp8 = Codec<Page>::kScaled;
    static_assert(kFp8 || sizeof(Page) == 2, "pages in the model dtype or fp8");
    // P V runs in T, except on fp8 pages: bf16 there, whatever T is (V widens exactly to bf16, and P
    // times a small v scale keeps bf16's exponent range where fp16 would go subnormal).
    using PV = typename Pick<kFp8, __nv_bfloat16, T>::type;
    constexpr int kStages = D == 64 ? 3 : 2;
    constexpr int TS = D + 8;                                   // T tile row stride (elements): 16 B of padding
    constexpr int PS = kFp8 ? D + 16 : TS;                      // page tile row stride (Page elements)
    constexpr int kPageChunks = D * static_cast<int>(sizeof(Page)) / 16;  // 16-byte chunks per key row
    constexpr int kStageBytes = 2 * KT * PS * static_cast<int>(sizeof(Page));  // K and V of one tile
    constexpr int kTileBytes = KT * TS * 2;                     // one T tile (fp8: converted K or V)
    constexpr int kRingBytes = kStages * kStageBytes;
    constexpr int kQBytes = kRowsPerCta * TS * 2;
    static_assert(kRingBytes >= kQBytes, "the query rows are staged in the ring's space");
    constexpr int kSmemBytes = kRingBytes + (kFp8 ? 2 * kTileBytes : 0);
    constexpr int NT = KT / 8;   // 8-key n-tiles of S
    constexpr int DT = D / 8;    // 8-dim n-tiles of O
    constexpr int DK = D / 16;   // 16-dim k-steps of Q K^T

    __shared__ __align__(16) unsigned char smem[kSmemBytes];
    __shared__ int table_window[kTableWindow];
    __shared__ __align__(16) float scales[kFp8 ? kStages : 1][2][KT];  // fp8: k, v scale per key and stage

    const int tid = threadIdx.x;
    const int warp_id = tid / kWarp;
    const int lane = tid % kWarp;
    const int g = lane / 4, qd = lane % 4;
    const AttentionCta cta = attention_cta<kRowsPerCta>(cache_seqlens, cache_seqstarts, chunk_lens, n_head,
                                                         n_kv_head, num_frames, num_splits, split_len, causal);
    const int b = cta.b, kvh = cta.kvh, split = cta.split, group = cta.group, seqlen = cta.seqlen;
    const int rows_total = cta.rows_total, rows_valid = cta.rows_valid, row0 = cta.row0, lo = cta.lo, hi = cta.hi;
    const int warp_row0 = row0 + warp_id * kRowsPerWarp;
    const bool active = warp_row0 < rows_valid;  // the warp has a query to answer
    const int n_tiles = hi > lo ? (hi - lo + KT - 1) / KT : 0;

    // -- query rows -> shared (T, zero for padding and rows past the length) -> A fragments
    T* q_rows = reinterpret_cast<T*>(smem);
    constexpr int QU = D / 8;  // 16-byte units of a query row
    static_assert(kRowsPerCta * QU % kThreads == 0, "whole query-row units per thread");
#pragma unroll
    for (int u = 0; u < kRowsPerCta * QU / kThreads; ++u) {
        const int i = tid + u * kThreads;
        const int r = i / QU, c = (i % QU) * 8;
        const int row = row0 + r;
        Bytes16 x = {{0u, 0u, 0u, 0u}};
        if (row < rows_valid) {
            const int t = row / group, hq = kvh * group + row % group;
            x = *reinterpret_cast<const Bytes16*>(q + ((static_cast<long long>(b) * n_head + hq) * num_frames + t) * D + c);
        }
        *reinterpret_cast<Bytes16*>(q_rows + r * TS + c) = x;
    }
    __syncthreads();
    unsigned qf[DK][4];
#pragma unroll
    for (int kk = 0; kk < DK; ++kk)
        ldmatrix_x4(qf[kk], q_rows + (warp_id * kRowsPerWarp + lane % 16) * TS + kk * 16 + (lane / 16) * 8);
    __syncthreads();  // the ring reuses the query rows' space

    // -- block-table window and the tile gather
    const long long table_row = static_cast<long long>(b) * table_stride;
    const int last_block = hi > lo ? (hi - 1) / BS : 0;
    int window_base = -kTableWindow;  // nothing loaded yet
    auto ensure_window = [&](int first_block, int need_block) {  // CTA-uniform: every thread takes the same branch
        if (need_block < window_base + kTableWindow) return;
        __syncthreads();  // nobody still reads the old window
        window_base = first_block;
        if (window_base + tid <= last_block) table_window[tid] = block_table[table_row + window_base + tid];
        __syncthreads();
    };
    auto stage_k = [&](int s) { return reinterpret_cast<Page*>(smem + s * kStageBytes); };
    auto stage_v = [&](int s) { return stage_k(s) + KT * PS; };
    auto issue = [&](int tile) {  // all threads; commits nothing
        if (tile >= n_tiles) return;
        const int tile_lo = lo + tile * KT;
        ensure_window(tile_lo / BS, (imin(tile_lo + KT, hi) - 1) / BS);
        const int s = tile % kStages;
        static_assert(KT * kPageChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll 1  // unrolled, ptxas keeps the offsets live and spills at D = 128 on sm_90
        for (int u = 0; u < KT * kPageChunks / kThreads; ++u) {  // K and V share the slot arithmetic
            const int i = tid + u * kThreads;
            const int key = i / kPageChunks;
            const int c = (i % kPageChunks) * (16 / static_cast<int>(sizeof(Page)));
            const int pos = tile_lo + key;
            long long offset = 0;  // the pool is not read for keys past the range (zero-filled)
            if (pos < hi) {
                const long long block = table_window[pos / BS - window_base];
                offset = ((block * BS + pos % BS) * n_kv_head + kvh) * D + c;
            }
            cp_async_16(stage_k(s) + key * PS + c, k_cache + offset, pos < hi);
            cp_async_16(stage_v(s) + key * PS + c, v_cache + offset, pos < hi);
        }
        if constexpr (kFp8) {  // the tile's scales, in the same cp.async group (zeros past the range)
            if (tid < KT) {
                const int key = tid, pos = tile_lo + key;
                long long slot = 0;
                if (pos < hi) slot = (static_cast<long long>(table_window[pos / BS - window_base]) * BS + pos % BS) *
                                         n_kv_head + kvh;
                warp::cp_async_4(&scales[s][0][key], k_scale + slot, pos < hi);
                warp::cp_async_4(&scales[s][1][key], v_scale + slot, pos < hi);
            }
        }
    };

    // -- running state: rows g and g + 8 of the warp's tile
    float o[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()};
    float l_run[2] = {0.f, 0.f};  // this lane's share (its own key columns)
    const int my_row[2] = {warp_row0 + g, warp_row0 + g + 8};
    int key_limit[2];  // a row sees keys pos < key_limit (hi, cut by causality; lo for rows past the length)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = my_row[h];
        key_limit[h] = r < rows_valid ? (causal ? imin(hi, seqlen + r / group + 1) : hi) : lo;
    }

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        issue(s);
        warp::cp_async_commit_group();
    }
    for (int it = 0; it < n_tiles; ++it) {
        warp::cp_async_wait_group<kStages - 2>();  // tile it has landed (this thread's copies)
        __syncthreads();                          // ... everyone's; stage (it - 1) % kStages is free
        issue(it + kStages - 1);
        warp::cp_async_commit_group();
        const int s = it % kStages;
        const T* k_tile;
        const PV* v_tile;
        if constexpr (kFp8) {  // widen the stage into T tiles (exact), then compute as for 16-bit pages
            T* kc = reinterpret_cast<T*>(smem + kRingBytes);
            PV* vc = reinterpret_cast<PV*>(kc + KT * TS);
            constexpr int CH = D / 16;  // 16-byte fp8 chunks per row
            static_assert(2 * KT * CH % kThreads == 0, "whole fp8 chunks per thread");
#pragma unroll 1  // (register pressure, as for the gather)
            for (int u = 0; u < 2 * KT * CH / kThreads; ++u) {
                const int i = tid + u * kThreads;
                const int which = i / (KT * CH), key = (i / CH) % KT, c = (i % CH) * 16;
                const Bytes16 raw = *reinterpret_cast<const Bytes16*>((which ? stage_v(s) : stage_k(s)) + key * PS + c);
                Bytes16 wide[2];
                if (which) {
                    widen_fp8x16<PV>(raw, wide);
                } else {
                    widen_fp8x16<T>(raw, wide);
                }
                unsigned char* dst = reinterpret_cast<unsigned char*>(which ? static_cast<void*>(vc + key * TS + c)
                                                                            : static_cast<void*>(kc + key * TS + c));
                *reinterpret_cast<Bytes16*>(dst) = wide[0];
                *reinterpret_cast<Bytes16*>(dst + 16) = wide[1];
            }
            __syncthreads();
            k_tile = kc;
            v_tile = vc;
        } else {
            k_tile = stage_k(s);
            v_tile = stage_v(s);
        }
        if (!active) continue;  // warp-uniform; no barrier below until the next iteration

        // S = Q K^T
        float sc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned kf[4];
                ldmatrix_x4(kf, k_tile + (np * 16 + (lane / 16) * 8 + lane % 8) * TS + kk * 16 + ((lane / 8) % 2) * 8);
                const unsigned b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
                mma_m16n8k16<T>(sc[2 * np], qf[kk], b0, sc[2 * np]);
                mma_m16n8k16<T>(sc[2 * np + 1], qf[kk], b1, sc[2 * np + 1]);
            }
        }

        // Scale, mask, online softmax (fp32). Element (n, e): row h = e / 2, key n * 8 + 2 qd + e % 2.
        const int tile_lo = lo + it * KT;
        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n * 8 + 2 * qd + e % 2;
                float col = scale_log2;
                if constexpr (kFp8) col *= scales[s][0][key];
                const float x = tile_lo + key < key_limit[e / 2] ? sc[n][e] * col : neg_inf();
                sc[n][e] = x;
                tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
            }
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(kFullMask, tile_max[h], 1));
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(kFullMask, tile_max[h], 2));
            const float m_new = fmaxf(m_run[h], tile_max[h]);
            alpha[h] = m_new == neg_inf() ? 1.f : exp2f(m_run[h] - m_new);  // 0 when m_run was -inf
            m_run[h] = m_new;
            l_run[h] *= alpha[h];
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = m_run[e / 2] == neg_inf() ? 0.f : exp2f(sc[n][e] - m_run[e / 2]);
                l_run[e / 2] += p;
                if constexpr (kFp8) {
                    sc[n][e] = p * scales[s][1][n * 8 + 2 * qd + e % 2];
                } else {
                    sc[n][e] = p;
                }
            }
#pragma unroll
        for (int n = 0; n < DT; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }

        // O += P V, P's A fragments straight from S's C fragments.
#pragma unroll
        for (int j = 0; j < KT / 16; ++j) {
            const unsigned pa[4] = {pack2<PV>(sc[2 * j][0], sc[2 * j][1]), pack2<PV>(sc[2 * j][2], sc[2 * j][3]),
                                    pack2<PV>(sc[2 * j + 1][0], sc[2 * j + 1][1]),
                                    pack2<PV>(sc[2 * j + 1][2], sc[2 * j + 1][3])};
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                unsigned vf[4];
                ldmatrix_x4_trans(vf, v_tile + (j * 16 + ((lane / 8) % 2) * 8 + lane % 8) * TS + dp * 16 + (lane / 16) * 8);
                const unsigned b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
                mma_m16n8k16<PV>(o[2 * dp], pa, b0, o[2 * dp]);
                mma_m16n8k16<PV>(o[2 * dp + 1], pa, b1, o[2 * dp + 1]);
            }
        }
    }

    // -- row sums across the quad, then store: rows < rows_total; zeros where no key was seen
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_run[h] += __shfl_xor_sync(kFullMask, l_run[h], 1);
        l_run[h] += __shfl_xor_sync(kFullMask, l_run[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = my_row[h];
        if (row >= rows_total) continue;
        const bool seen = row < rows_valid && l_run[h] > 0.f;
        const int t = row / group, hq = kvh * group + row % group;
        const long long out_row = (static_cast<long long>(b) * n_head + hq) * num_frames + t;
        if (num_splits == 1) {
            const float inv = seen ? 1.f / l_run[h] : 0.f;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                const float x0 = seen ? o[n][2 * h] * inv : 0.f;  // a select: NaN * 0 never reaches out
                const float x1 = seen ? o[n][2 * h + 1] * inv : 0.f;
                *reinterpret_cast<unsigned*>(out + out_row * D + n * 8 + 2 * qd) = pack2<T>(x0, x1);
            }
        } else {
            const long long part_row = static_cast<long long>(split) * gridDim.z * n_head * num_frames + out_row;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                float2 x;
                x.x = seen ? o[n][2 * h] : 0.f;
                x.y = seen ? o[n][2 * h + 1] : 0.f;
                *reinterpret_cast<float2*>(part_acc + part_row * D + n * 8 + 2 * qd) = x;
            }
            if (qd == 0) {
                part_ml[part_row * 2] = seen ? m_run[h] : neg_inf();
                part_ml[part_row * 2 + 1] = seen ? l_run[h] : 0.f;
            }
        }
    }
}

}  // namespace oasr
