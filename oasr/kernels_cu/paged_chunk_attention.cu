// paged_chunk_attention.cu -- a cohort's chunk queries attending to their own
// stream's pages, with the key range optionally split across thread blocks
// (flash-decoding) and a small kernel that merges the splits.
//
// This is v1, the readable scalar kernel (CUDA-core FMAs on fp32 tiles; every
// dtype). v2, the same contract on tensor cores for fp16/bf16 queries, lives
// in paged_chunk_attention_v2.cu and shares the combine kernel below; the
// launcher picks one (oasr.fast.kernels.ops.choose_attention_version).
//
// Computes (the oracle is oasr.reference.paged_ops.paged_attention):
//   row b, query head hq, query t < len_b (len_b = chunk_lens[b], or T):
//       keys   = table positions [cache_seqstarts[b], cache_seqlens[b] + len_b)
//                (causal: only positions <= cache_seqlens[b] + t)
//       out[b, hq, t] = softmax(scale * q . k) @ v   over those keys,
//                       k/v of KV head hq / (n_head / n_kv_head)   (GQA)
//   No mask inside the chunk (unless causal). Softmax is online and in fp32.
//   kRel (the relative-position term, oasr/cache/rel_bias.py; rel_bias (B, n_head, T, rel_len) fp32):
//       score = scale * q . k + rel_bias[b, hq, t, (cache_seqlens[b] + t) - pos + T - 1]
//       for key table position pos, added before the mask. Lane j reads the entry of its own key
//       for each of its warp's rows (consecutive lanes, consecutive columns: one coalesced read
//       per row per tile), only where the key is visible, times log2(e) into the log2 domain of
//       the pre-scaled q. A column past rel_len gives NaN (attention_window.cuh).
//   Queries t >= len_b, rows with no keys, and causal rows whose keys are all
//   masked write zeros: exact zeros, even when V holds NaN or Inf in the range
//   (such a row accumulates 0 * v like any masked key, so its accumulators are
//   overwritten with zeros before the store; split partials get m = -inf, l = 0,
//   which the combine turns into zeros). Only positions inside the key range are ever read, so
//   the rest of the pool may hold anything (the tests fill it with NaN).
//
// Layouts (contiguous): q, out (B, n_head, T, D) of T; k_cache, v_cache
//   (num_pool_blocks, block_size, n_kv_head, D) of Page; block_table (B, >= W) int32
//   with row stride `table_stride`; cache_seqlens, cache_seqstarts, chunk_lens
//   (B,) int32 (chunk_lens may be null: every row has T frames).
//   Split partials (num_splits > 1), fp32: part_acc (S, B, n_head, T, D), the
//   unnormalised sum of p * v; part_ml (S, B, n_head, T, 2) = (m, l), the
//   running max in the log2 domain and the sum of p.
//
// Page types: Page = T (pages in the model dtype; k_scale/v_scale unused, may
//   be null) or Page = __nv_fp8_e4m3 (fp8 pages; k_scale, v_scale
//   (num_pool_blocks, block_size, n_kv_head) fp32, one scale per vector). The
//   only difference is the tile load: fp8 values are widened and multiplied by
//   their vector's scale (load_vec_scaled), which is exactly the reference's
//   dequantize(stored, scale) in fp32, so the shared-memory tiles, and all the
//   arithmetic after them, are those of an fp32 pool holding the dequantized
//   values. A 16-byte load moves 16 fp8 values instead of 8 halves.
//   int8, q8_0 and affine4 pages (Int8Page, Q8_0Page, Affine4Page<T, G>; k_scale / v_scale their
//   scale planes, kv_formats.cuh) differ the same way: PageTraits<Page>::load widens a tile row's
//   values exactly as the reference's dequantize does in fp32 (scale per vector or per group, and
//   + bias for affine4), so everything after the tile load is unchanged. A 16-byte load of 4-bit
//   pages moves 32 values.
//
// Grid/block of the attention kernel: grid (q_tiles * num_splits, n_kv_head,
//   B), 128 threads = 4 warps. One CTA serves one (row, KV head, query tile,
//   key split). The query rows of a KV head are its group's (t, g) pairs in
//   t-major order (row = t * group + g), so the rows with t < len form a
//   prefix; a query tile is 16 of them, 4 per warp, and all 16 share every K/V
//   tile the CTA loads. Keys stream in tiles of 32 positions: the CTA loads the
//   tile's K and V (widened to fp32) into shared memory through the block
//   table, then each warp scores its 4 rows with lane j owning key j (CUDA-core
//   FMAs, float4 shared loads), takes the tile max from shared memory (no
//   shuffles), rescales and accumulates p @ v with lane owning head_dim/32
//   contiguous output dims. Split s covers [start + s*split_len, start +
//   (s+1)*split_len) of the row's key range; the last split runs to the end of
//   the range whatever split_len says, so a stale host maximum can unbalance
//   the splits but never drop keys.
//
// Resources (D = 128, fp32 tiles): K and V tiles 2 * 32 * (128 + 4) * 4 B =
//   33.8 KB, query rows 16 * 128 * 4 B = 8 KB, scores and probabilities
//   2 * 4 * 4 * 32 * 4 B = 4 KB: 46 KB of static shared memory, under the 48 KB
//   static limit (D = 64: 25 KB). The 4-float row padding makes lane j's float4
//   reads of key row j conflict-free (8 lanes per phase cover all 32 banks).
//   Registers: 16 accumulators + 4 scores + 8 running-softmax values per lane,
//   plus the float4 operands of the score loop. Measured with NVRTC 13
//   (`python -m oasr kernels`): 71-78 per thread at D = 64, 122-131 at D = 128,
//   no spills, no stack; with fp8 pages 72-80 at D = 64 and 117-121 at D = 128
//   (the 16-value tile loads sit outside the accumulation loop). At D = 128
//   registers, not shared memory, bound residency to 3 CTAs (12 warps) per SM;
//   that is the first knob to turn when someone times this on a GPU (it has not
//   been timed yet).
//
// Combine kernel: grid ceil(B * n_head * T / 4), 128 threads, one warp per
//   output row, lane owning head_dim/32 dims: M = max m_s, L = sum l_s 2^(m_s -
//   M), out = sum acc_s 2^(m_s - M) / L, zeros where L == 0. A row past its
//   chunk has m_s = -inf in every split, so M = -inf and no partial is read.
//
// Checked by: tests/test_kernels_emulated.py::test_attention_* (host
// emulation against the reference: random geometries, GQA, causal, forced
// split counts, NaN-poisoned pools, shuffled block tables) and
// tests/test_kernels_cuda.py (same on a GPU, plus CUDA-graph replay);
// fp8 pages: tests/test_fp8_kernels.py::test_attention_* (against the reference
// on the same fp8 pages); int8 / q8_0 / affine4 pages: tests/test_kv_format_kernels.py.
//   python -m pytest tests/test_kernels_emulated.py -k attention (CPU, no GPU needed)
//   python -m pytest tests/test_fp8_kernels.py -k attention      (CPU, no GPU needed)
//   python -m pytest tests/test_attention_past_length.py         (zeros past the chunk, NaN/Inf in V)
//   python -m pytest -m cuda tests/test_kernels_cuda.py          (GPU)
//   python -m oasr kernels --arch sm_80,sm_90 [--sass]           (registers, smem, spills; main loop, model)
#include "attention_window.cuh"
#include "common.cuh"
#include "kv_formats.cuh"

namespace oasr {

namespace attn {
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kTileKeys = kWarp;  // one key per lane
}  // namespace attn


template <typename T, typename Page, int D, bool kRel = false>
__global__ void __launch_bounds__(attn::kThreads, kRel ? (D == 64 ? 4 : 3) : 0) paged_chunk_attention_kernel(
    const T* __restrict__ q, const Page* __restrict__ k_cache, const Page* __restrict__ v_cache,
    const void* __restrict__ k_scale, const void* __restrict__ v_scale, const int* __restrict__ block_table,
    int table_stride, const int* __restrict__ cache_seqlens,
    const int* __restrict__ cache_seqstarts, const int* __restrict__ chunk_lens, T* __restrict__ out,
    float* __restrict__ part_acc, float* __restrict__ part_ml, int n_head, int n_kv_head, int num_frames,
    int block_size, int num_splits, int split_len, float scale_log2, int causal,
    const float* __restrict__ rel_bias, int rel_len) {
    using namespace attn;
    static_assert(D % kWarp == 0 && D % kVec16<T> == 0 && D % PageTraits<Page>::kLoad == 0,
                  "head_dim must be a multiple of 32");
    constexpr int R = kRowsPerWarp;
    constexpr int DPL = D / kWarp;          // output dims per lane
    constexpr int VU = kVec16<T>;           // q elements per 16-byte load
    constexpr int UNITS = D / VU;           // 16-byte loads per head_dim row of q
    constexpr int PVU = PageTraits<Page>::kLoad;  // page values per 16-byte load
    constexpr int PUNITS = D / PVU;         // 16-byte loads per head_dim row of a page
    constexpr int KS = D + 4;               // padded shared row stride (floats)

    __shared__ __align__(16) float k_tile[kTileKeys * KS];
    __shared__ __align__(16) float v_tile[kTileKeys * KS];
    __shared__ __align__(16) float q_rows[kRowsPerCta * D];
    __shared__ __align__(16) float scores[kWarps][R][kTileKeys];
    __shared__ __align__(16) float probs[kWarps][R][kTileKeys];

    const int tid = threadIdx.x;
    const int warp = tid / kWarp;
    const int lane = tid % kWarp;
    const AttentionCta cta = attention_cta<kRowsPerCta>(cache_seqlens, cache_seqstarts, chunk_lens, n_head,
                                                         n_kv_head, num_frames, num_splits, split_len, causal);
    const int b = cta.b, kvh = cta.kvh, split = cta.split, group = cta.group, seqlen = cta.seqlen;
    const int rows_total = cta.rows_total, rows_valid = cta.rows_valid, row0 = cta.row0, lo = cta.lo, hi = cta.hi;

    // Query rows of this tile -> shared, pre-scaled into the log2 domain.
    for (int i = tid; i < kRowsPerCta * UNITS; i += kThreads) {
        const int r = i / UNITS;
        const int c = (i % UNITS) * VU;
        const int row = row0 + r;
        float x[VU];
        if (row < rows_valid) {
            const int t = row / group;
            const int hq = kvh * group + row % group;
            load_vec<T, VU>(q + ((static_cast<long long>(b) * n_head + hq) * num_frames + t) * D + c, x);
#pragma unroll
            for (int e = 0; e < VU; ++e) x[e] *= scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < VU; ++e) x[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < VU; ++e) q_rows[r * D + c + e] = x[e];
    }

    float m[R], l[R], acc[R][DPL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = neg_inf();
        l[r] = 0.f;  // this lane's share of the row sum (its own keys)
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[r][e] = 0.f;
    }
    const float* my_q = q_rows + warp * R * D;
    const long long table_row = static_cast<long long>(b) * table_stride;
    // kRel: the relative-position term of each tile, (row, key) in log2 units, is gathered into shared
    // memory with the tile's K and V (bias_tile), so the score loop only adds a shared value (terms read in
    // the score loop itself made ptxas spill at D = 64). The CTA's rows' table offsets (rel_rows) are
    // published by the tile loop's first barrier.
    const float* rel_cta = nullptr;
    __shared__ RelRowOffset rel_rows[kRel ? kRowsPerCta : 1];
    __shared__ __align__(16) float bias_tile[kRel ? kRowsPerCta : 1][kRel ? kTileKeys : 1];
    if constexpr (kRel) {
        rel_cta = rel_table_of_cta(rel_bias, rel_len, cta, n_head, num_frames);
        if (tid < kRowsPerCta) rel_rows[tid] = rel_row_offset(rel_len, cta, row0 + tid, num_frames);
    }

    for (int tile = lo; tile < hi; tile += kTileKeys) {
        __syncthreads();  // q_rows written / previous tile fully consumed
        for (int i = tid; i < kTileKeys * PUNITS; i += kThreads) {
            const int key = i / PUNITS;
            const int c = (i % PUNITS) * PVU;
            const int pos = tile + key;
            float kx[PVU], vx[PVU];
            if (pos < hi) {
                const long long block = block_table[table_row + pos / block_size];
                const long long slot = (block * block_size + pos % block_size) * n_kv_head + kvh;
                PageTraits<Page>::template load<PVU>(k_cache, k_scale, slot, c, D, kx);
                PageTraits<Page>::template load<PVU>(v_cache, v_scale, slot, c, D, vx);
            } else {  // zeros, never NaN: p = 0 times v must stay 0
#pragma unroll
                for (int e = 0; e < PVU; ++e) kx[e] = vx[e] = 0.f;
            }
#pragma unroll
            for (int e = 0; e < PVU; ++e) {
                k_tile[key * KS + c + e] = kx[e];
                v_tile[key * KS + c + e] = vx[e];
            }
        }
        if constexpr (kRel) {  // entry (r, j): row row0 + r, key tile + j; read only where the row sees the key
            for (int i = tid; i < kRowsPerCta * kTileKeys; i += kThreads) {
                const int r = i / kTileKeys, j = i % kTileKeys, row = row0 + r, pos = tile + j;
                const bool visible = pos < hi && row < rows_valid && (!causal || pos <= seqlen + row / group);
                const RelRowOffset o = rel_rows[r];
                bias_tile[r][j] = visible ? rel_term_log2(rel_cta, o.top, o.at, pos, rel_len) : 0.f;
            }
        }
        __syncthreads();

        // Scores: lane owns key `tile + lane`, for the warp's R rows.
        const int kpos = tile + lane;
        float s[R];
#pragma unroll
        for (int r = 0; r < R; ++r) s[r] = 0.f;
        const float* krow = k_tile + lane * KS;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            const float4 kk = *reinterpret_cast<const float4*>(krow + d);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float4 qq = *reinterpret_cast<const float4*>(my_q + r * D + d);
                s[r] = fmaf(qq.x, kk.x, s[r]);
                s[r] = fmaf(qq.y, kk.y, s[r]);
                s[r] = fmaf(qq.z, kk.z, s[r]);
                s[r] = fmaf(qq.w, kk.w, s[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = row0 + warp * R + r;
            const bool visible = kpos < hi && row < rows_valid && (!causal || kpos <= seqlen + row / group);
            if constexpr (kRel) s[r] += bias_tile[warp * R + r][lane];  // rel_bias[b, hq, t, seqlen + t - kpos + T - 1]
            s[r] = visible ? s[r] : neg_inf();
            scores[warp][r][lane] = s[r];
        }
        __syncwarp();

        // Online softmax: every lane reads the tile's 32 scores and so agrees on
        // the new max; lane keeps its own p and its share of l.
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float tile_max = neg_inf();
#pragma unroll
            for (int j = 0; j < kTileKeys; j += 4) {
                const float4 x = *reinterpret_cast<const float4*>(&scores[warp][r][j]);
                tile_max = fmaxf(tile_max, fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)));
            }
            const float m_new = fmaxf(m[r], tile_max);
            float alpha = 1.f, p = 0.f;
            if (m_new != neg_inf()) {
                alpha = exp2f(m[r] - m_new);  // 0 when m[r] was -inf
                p = exp2f(s[r] - m_new);      // 0 for masked keys
            }
            m[r] = m_new;
            l[r] = l[r] * alpha + p;
#pragma unroll
            for (int e = 0; e < DPL; ++e) acc[r][e] *= alpha;
            probs[warp][r][lane] = p;
        }
        __syncwarp();

        // acc += p @ v: lane owns dims [lane * DPL, lane * DPL + DPL).
#pragma unroll 4
        for (int j = 0; j < kTileKeys; ++j) {
            float vv[DPL];
            load_vec<float, DPL>(v_tile + j * KS + lane * DPL, vv);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float p = probs[warp][r][j];
#pragma unroll
                for (int e = 0; e < DPL; ++e) acc[r][e] = fmaf(p, vv[e], acc[r][e]);
            }
        }
    }

    // Row sums: each lane holds the part of l from its own keys; add them up
    // through shared memory (every lane sums in the same order, so agrees).
    __syncwarp();
#pragma unroll
    for (int r = 0; r < R; ++r) scores[warp][r][lane] = l[r];
    __syncwarp();

#pragma unroll
    for (int r = 0; r < R; ++r) {
        float l_sum = 0.f;
        for (int j = 0; j < kTileKeys; ++j) l_sum += scores[warp][r][j];
        const int row = row0 + warp * R + r;
        if (row >= rows_total) continue;
        if (row >= rows_valid) {  // past the chunk: every p was 0, but 0 * (NaN or Inf in v) is NaN
            l_sum = 0.f;
            m[r] = neg_inf();
#pragma unroll
            for (int e = 0; e < DPL; ++e) acc[r][e] = 0.f;
        }
        const int t = row / group;
        const int hq = kvh * group + row % group;
        const long long out_row = (static_cast<long long>(b) * n_head + hq) * num_frames + t;
        if (num_splits == 1) {
            const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
            float o[DPL];
#pragma unroll
            for (int e = 0; e < DPL; ++e) o[e] = acc[r][e] * inv;
            store_vec<T, DPL>(out + out_row * D + lane * DPL, o);
        } else {
            const long long part_row = static_cast<long long>(split) * gridDim.z * n_head * num_frames + out_row;
            store_vec<float, DPL>(part_acc + part_row * D + lane * DPL, acc[r]);
            if (lane == 0) {
                part_ml[part_row * 2] = m[r];
                part_ml[part_row * 2 + 1] = l_sum;
            }
        }
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(attn::kThreads) paged_attention_combine_kernel(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, T* __restrict__ out, int num_rows,
    int num_splits) {
    constexpr int DPL = D / kWarp;
    const int row = blockIdx.x * attn::kWarps + threadIdx.x / kWarp;
    const int lane = threadIdx.x % kWarp;
    if (row >= num_rows) return;  // no barriers below

    float m_max = neg_inf();
    for (int s = 0; s < num_splits; ++s)
        m_max = fmaxf(m_max, part_ml[(static_cast<long long>(s) * num_rows + row) * 2]);
    float l_sum = 0.f;
    float o[DPL];
#pragma unroll
    for (int e = 0; e < DPL; ++e) o[e] = 0.f;
    if (m_max != neg_inf()) {
        for (int s = 0; s < num_splits; ++s) {
            const long long part_row = static_cast<long long>(s) * num_rows + row;
            const float w = exp2f(part_ml[part_row * 2] - m_max);  // 0 for empty splits
            l_sum = fmaf(part_ml[part_row * 2 + 1], w, l_sum);
            float a[DPL];
            load_vec<float, DPL>(part_acc + part_row * D + lane * DPL, a);
#pragma unroll
            for (int e = 0; e < DPL; ++e) o[e] = fmaf(a[e], w, o[e]);
        }
    }
    const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) o[e] *= inv;
    store_vec<T, DPL>(out + static_cast<long long>(row) * D + lane * DPL, o);
}

}  // namespace oasr
