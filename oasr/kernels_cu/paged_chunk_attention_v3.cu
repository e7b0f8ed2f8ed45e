// paged_chunk_attention_v3.cu -- the chunk attention of v1 (paged_chunk_attention.cu,
// the readable scalar kernel) and v2 (paged_chunk_attention_v2.cu, the first
// tensor-core kernel), both kept beside it, with its main loop cut to what
// attention needs and every warp at work.
//
// Computes exactly what v1 and v2 compute (the oracle is
// oasr.reference.paged_ops.paged_attention; window, GQA, causal and split
// semantics are v1's): T = fp16 / bf16 queries, pages in T or fp8 e4m3 (one
// fp32 power-of-two scale per vector), head_dim D = 64 or 128, block size BS
// a power of two and a template parameter. A query row past its chunk
// (t >= len_b), or a row that sees no key, writes exactly zero (a select,
// never a multiply by zero). The split-K combine kernel is v1's.
//
// Mapping. Grid (q_tiles * num_splits, n_kv_head, B), 128 threads = 4 warps.
//   A CTA owns 32 query rows of one (stream b, KV head), row = t * group + g
//   (rows t < len form a prefix; q_tiles = ceil(group * T / 32): 1 at the ASR
//   shape, group 2 x chunk 16). Warp w takes row tile w % 2 (16 rows, one MMA
//   M tile) and key slice w / 2 of every 32-key tile (keys 16 (w / 2) .. +15):
//
//        keys of tile i:   0 ........ 15 | 16 ....... 31
//        rows  0-15        warp 0        | warp 2
//        rows 16-31        warp 1        | warp 3
//
//   so all four warps do attention work on the 32 live rows of the ASR shape
//   (v2's 64-row CTA left warps 2-3 with padding only). Each warp keeps its
//   own online-softmax state (m, l, O) over its slice; after the last tile
//   the other slices hand theirs to warp r (which finalizes row tile r)
//   through shared memory, which merges (m = max, rescale both by
//   2^(m_i - m)) and stores. Why this and not a 2-warp CTA sized to the rows
//   (same work per row, half the warps per SM) or producer warps (the gather
//   is a handful of cp.async per thread, too little to give a warp):
//   docs/kernels.md, "v3".
//
//   fp8 pages at D = 64 (kRT = 2 row tiles per warp): warp w takes BOTH row
//   tiles and key slice w of every 64-key tile (keys 16 w .. +15):
//
//        keys of tile i:   0 .. 15 | 16 .. 31 | 32 .. 47 | 48 .. 63
//        rows  0-31        warp 0  | warp 1   | warp 2   | warp 3
//
//   Each K/V fragment a warp widens (fp8 -> f16) feeds both row tiles' mma,
//   so every K/V byte is widened once per CTA (it was twice: once per row
//   tile), and each warp carries two independent online-softmax chains (rows
//   0-15 and 16-31: their own m, l, O and unit), interleaved in one loop
//   body, so one chain's mma and conversions overlap the other's row max,
//   shuffles and exponentials. The price: O and Q of two row tiles in
//   registers (D = 128 would not fit, so it keeps one row tile per warp) and
//   four slices to merge after the last tile instead of two.
//
// Per tile of KT keys (32 on 16-bit pages, 64 on fp8 pages), warp (row tiles, slice s), KW = KT / slices:
//   S (16 x KW) = Q_r (A fragments, registers, loaded from global once)
//                 x K^T of its KW keys (ldmatrix), D/16 x KW/8 mma
//   scores -> masked to -inf only on boundary tiles (the last tile of the
//     range, or past the warp's first causal limit); interior tiles skip it
//   online softmax in fp32: p = 2^(s * c - m) with c = scale * log2(e) folded
//     into one FFMA (fp8: the key's k scale first, one FMUL, and c per row),
//     on ex2.approx.ftz (warp_mma.cuh: subnormal weights flush to zero, as they
//     do anyway once P is rounded to 16 bits)
//   O (16 x D) += P (registers: S's C fragments are P's A fragments)
//                 x V of its KW keys (ldmatrix .trans), KW/16 x D/8 mma
//
// kRel (the relative-position term, oasr/cache/rel_bias.py): after S (and fp8's k scales), each element
//   a row sees (key below its key_limit) becomes s * c_row + rel_bias[b, hq, t, (seqlen + t) - pos +
//   T - 1] * log2(e), read from global memory (L1-cached; a quad's lanes read neighbouring columns),
//   and the softmax takes c = 1 for those rows. A column past rel_len gives NaN, and a NaN row sum
//   is stored rather than taken for "no key" (attention_window.cuh). Same pipeline, same registers
//   budget; `kernels --sass` reports the kRel instances as their own rows (v3+rel).
//
// Pipeline. A ring of kStages stages (the most that fit 40 KB of static
//   shared memory, 2 to 6: 4 at D = 64 on 16-bit pages, 3 (of 64 keys) on fp8, 2 at D = 128)
//   holds K, V (and fp8 scales) of kStages - 1 tiles in flight, gathered by
//   cp.async in 16-byte chunks. Every thread always gathers the same chunk
//   column of the same key rows of each tile, so its pool offsets are
//   unsigned and hoisted: element = block * (BS * Hkv * D) + (pos % BS) *
//   (Hkv * D) + (kvh * D + chunk), the last term fixed, BS a power of two.
//   The block-table entries of the tile issued next are read straight from
//   global memory (L1/L2-cached, no shared table, no barrier) one iteration
//   ahead into registers. The prologue reads the table and issues the first
//   kStages - 1 tiles before it loads Q (Q goes straight from global memory
//   into A fragments: no shared-memory staging, no barrier). One barrier per
//   tile: wait for tile i (wait_group<kStages - 2>), barrier, issue tile
//   i + kStages - 1 into the stage tile i - 1 used, compute tile i.
//
// fp8 pages. cp.async moves raw e4m3 bytes (and each thread one of the
//   tile's 128 scales); each warp converts only its own fragments in
//   registers after ldmatrix (warp_mma.cuh, "fp8 e4m3 quads"), tiles of 64
//   keys (a stage moves the bytes of a 32-key 16-bit stage): K through
//   fp8x4_to<f16> with Q's A fragments loaded in the matching dim order
//   (k 2q, 2q+1 <- dims 4q, 4q+1; k 2q+8, 2q+9 <- dims 4q+2, 4q+3), V through
//   .trans and fp8x4_to_interleaved<f16> (two n-tiles per 16-dim slab: even
//   dims and odd dims; the store puts them back in order). No widened tile in
//   shared memory, no second barrier, and half the ldmatrix of 16-bit pages.
//   Both mma run in f16 whatever T is: e4m3 -> f16 is one hardware cvt per
//   pair on sm_89+ (bf16 needs three more), so the widening costs 64
//   instructions per warp per tile instead of 256. f16 has more mantissa than
//   bf16 (11 bits against 8) but less range (2^-24 .. 65504), so two operands
//   are brought into its range by powers of two, which scale exactly:
//     Q (bf16 queries): each row times 2^a, a = min(142 - E, 64) with E the
//       biased exponent of the row's largest |q|, which lands in [2^15, 2^16);
//       then rounded to f16. c (the exponent factor) is per row: scale *
//       log2(e) * 2^-a. f16 queries go in as they are.
//     P: k_scale joins S per key column (one FMUL), v_scale multiplies p
//       before P is rounded, as in v2; then row r's P' = p * v_scale / w_r,
//       where w_r is the power of two at or below max(the row's largest
//       p * v_scale over the warp's keys of this tile, w_r's previous value
//       times the tile's alpha, 2^-126). So P' < 2, O's row r is kept in
//       units of w_r (rescaled with alpha when w_r moves, multiplied by w_r
//       after the last tile), and a key with a large v scale that the row
//       does not weigh (masked, or far below the row's maximum) does not set
//       the unit.
//
// Precision. Everything not listed is as v2 (oasr.fast.kernels.testing.v2_bound):
//   S accumulates exact products in fp32, ex2.approx adds at most 2^-22
//   relative to each weight. 16-bit pages: P rounded to T, as v2. fp8 pages:
//   * K: exact (every e4m3 value is an f16 value).
//   * Q, bf16: exact for every element within 2^-32 of its row's largest
//     magnitude (scaled, at least 2^-17: an f16 with 11 significant bits down
//     to 2^-24 holds bf16's 8). Smaller elements are rounded to multiples of
//     2^-24 / 2^a: an absolute error at most 2^-40 of the row's largest. A row
//     whose largest |q| is below 2^-49 (a capped at 64) is exact down to
//     2^-81 instead. f16 queries: exact. NaN or Inf in a row: the row's
//     result is NaN, as in the reference.
//   * P': rounded to f16, to nearest. A weight with P' >= 2^-14 (p * v_scale
//     at least 2^-14 of the row's unit) carries a relative error at most 2^-11
//     (bf16 before: 2^-8); below that the absolute error is at most 2^-25
//     units (f16 subnormals), and P' <= 2^-25 is flushed to zero: a key whose
//     p * v_scale is 2^25 or more below the row's unit contributes nothing.
//     The unit is at most the largest p * v_scale the row has weighed so far,
//     each decayed with O since (or 2^-126), so a flushed key loses at most
//     2^-25 of that.
//   * f16 x f16 products in the mma are exact; O accumulates in fp32. The
//     scales are powers of two (the append kernels write only such): every
//     rescaling above is exact unless it leaves fp32's range.
//
// Resources and speed: `python -m oasr kernels --arch sm_80,sm_90 --sass`
//   (registers, no spills, the main loop's instruction mix and the calibrated
//   model; tests/test_kernels_sass.py holds the loop under 360 instructions
//   per warp per 32 keys for bf16 pages on sm_90, D 64, block 16, and 250 for
//   fp8). v3 with one row tile per warp ran on an H200 (docs/kernels.md); the
//   two-row-tile fp8 mapping has not run on a GPU.
//
// Checked by: tests/test_kernels_emulated.py, tests/test_fp8_kernels.py and
//   tests/test_attention_past_length.py (every case runs v1, v2 and v3 under the
//   host emulation), tests/test_kernels_cuda.py (GPU; not run in this
//   repository's CI).
#include "attention_window.cuh"
#include "common.cuh"
#include "warp_mma.cuh"

namespace oasr {

namespace attn3 {
template <bool C, typename A, typename B>
struct Pick {
    using type = A;
};
template <typename A, typename B>
struct Pick<false, A, B> {
    using type = B;
};
template <typename A, typename B>
struct Same {
    static constexpr bool value = false;
};
template <typename A>
struct Same<A, A> {
    static constexpr bool value = true;
};
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kRowTiles = 2;                        // 16-row MMA tiles per CTA
constexpr int kRowsPerCta = kRowTiles * 16;         // 32
// Keys per tile: 32 on 16-bit pages, 64 on fp8 pages (half the bytes per key: the same bytes per stage,
// and the per-tile work -- barrier, row max, rescale of O -- spread over twice the keys).
template <bool kFp8>
constexpr int kTileKeys = kFp8 ? 64 : 32;
constexpr int kRingBudget = 40 * 1024;              // static shared memory for the ring
__host__ __device__ constexpr int clamp_stages(int n) { return n < 2 ? 2 : (n > 6 ? 6 : n); }
// Row tiles per warp: both on fp8 pages at D = 64 without the relative-position term (see the header,
// "Mapping"), else one (the term's table offsets would not fit the registers of two row tiles).
template <typename Page, int D, bool kRel>
constexpr int kRowTilesPerWarp = Codec<Page>::kScaled && D == 64 && !kRel ? kRowTiles : 1;
// Launch bounds: with both row tiles a thread holds O and Q of 32 rows; 3 CTAs per SM (at most 168 registers)
// keeps 12 warps per SM, which ptxas would otherwise trade for registers (2 CTAs at about 210).
template <typename Page, int D, bool kRel>
constexpr int kMinCtas = kRowTilesPerWarp<Page, D, kRel> == 2 ? 3 : 0;
}  // namespace attn3

template <typename T, typename Page, int D, int BS, bool kRel = false>
__global__ void __launch_bounds__(attn3::kThreads, (attn3::kMinCtas<Page, D, kRel>)) paged_chunk_attention_v3_kernel(
    const T* __restrict__ q, const Page* __restrict__ k_cache, const Page* __restrict__ v_cache,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, const int* __restrict__ block_table,
    int table_stride, const int* __restrict__ cache_seqlens, const int* __restrict__ cache_seqstarts,
    const int* __restrict__ chunk_lens, T* __restrict__ out, float* __restrict__ part_acc,
    float* __restrict__ part_ml, int n_head, int n_kv_head, int num_frames, int num_splits, int split_len,
    float scale_log2, int causal, const float* __restrict__ rel_bias, int rel_len) {
    using namespace attn3;
    using warp::cp_async_16;
    using warp::ex2_approx_ftz;
    using warp::ldmatrix_x4;
    using warp::ldmatrix_x4_trans;
    using warp::mma_m16n8k16;
    using warp::pack2;
    static_assert(D == 64 || D == 128, "v3 tiles head_dim 64 or 128");
    static_assert(sizeof(T) == 2, "v3 takes fp16 or bf16 queries");
    static_assert(BS > 0 && (BS & (BS - 1)) == 0, "v3's block size is a power of two");
    constexpr bool kFp8 = Codec<Page>::kScaled;
    static_assert(kFp8 || sizeof(Page) == 2, "pages in the model dtype or fp8");
    using MM = typename Pick<kFp8, __half, T>::type;  // both mma types: f16 on fp8 pages (see the header)
    constexpr int KT = kTileKeys<kFp8>;  // keys per tile
    // Row tiles per warp (see the header, "Mapping"): 1, or on fp8 pages at D = 64 both (two independent
    // softmax chains over one key slice, and each K/V byte widened by one warp of the CTA).
    constexpr int kRT = kRowTilesPerWarp<Page, D, kRel>;
    constexpr int kSl = kWarps * kRT / kRowTiles;  // key slices per tile: 2, or 4 with both row tiles
    constexpr int KW = KT / kSl;         // keys per warp per tile
    static_assert(KW % 16 == 0, "whole 16-key k-steps per warp");
    constexpr int NP = KW / 16;          // 16-key k-steps of P V per warp per tile (1 or 2)
    constexpr int NN = KW / 8;           // 8-key n-tiles of S per warp per tile
    constexpr int PB = kFp8 ? D + 16 : 2 * (D + 8);  // page tile row stride in bytes (16 B of padding)
    constexpr int TS = PB / 2;                       // the same in 16-bit elements
    constexpr int kChunks = D * static_cast<int>(sizeof(Page)) / 16;  // 16-byte chunks per key row
    constexpr int kScaleBytes = kFp8 ? 2 * KT * 4 : 0;
    constexpr int kStageBytes = 2 * KT * PB + kScaleBytes;  // K, V (, k and v scales) of one tile
    constexpr int kStages = clamp_stages(kRingBudget / kStageBytes);
    static_assert(kThreads % kChunks == 0 && KT * kChunks % kThreads == 0, "whole key rows per thread");
    constexpr int U = KT * kChunks / kThreads;       // key rows a thread gathers per tile
    constexpr int kKeyStep = kThreads / kChunks;     // between a thread's key rows
    constexpr int DK = D / 16;                       // 16-dim k-steps of Q K^T (and fp8 slabs)
    constexpr int DT = D / 8;                        // 8-dim n-tiles of O
    constexpr int kMergeFloats = DT * 4 + 4;         // per lane: O fragment, m[2], l[2]
    constexpr int kMergeSlots = kRT == 1 ? kRowTiles : kSl * kRowTiles;  // (slice, row tile) states handed over
    constexpr int kMergeBytes = kMergeSlots * kWarp * kMergeFloats * 4;
    constexpr int kSmemBytes = kStages * kStageBytes > kMergeBytes ? kStages * kStageBytes : kMergeBytes;
    static_assert(kStageBytes % 16 == 0 && PB % 16 == 0, "16-byte aligned stages and rows");

    __shared__ __align__(16) unsigned char smem[kSmemBytes];
    // Two row tiles per warp: Q's A fragments (the same in every warp) wait in shared memory, each lane reading
    // back its own 16 bytes per 16-dim k-step at each tile (32 registers of Q would not fit beside two O)
    constexpr int kQSmem = kRT == 2 ? kRT * DK * kWarp : 1;
    __shared__ __align__(16) uint4 q_smem[kQSmem];

    const int tid = threadIdx.x;
    const int warp_id = tid / kWarp;
    const int lane = tid % kWarp;
    const int g = lane / 4, qd = lane % 4;
    const int rt0 = kRT == 1 ? warp_id % kRowTiles : 0;  // the warp's row tiles rt0 .. rt0 + kRT - 1
    const int slice = kRT == 1 ? warp_id / kRowTiles : warp_id;
    const AttentionCta cta = attention_cta<kRowsPerCta>(cache_seqlens, cache_seqstarts, chunk_lens, n_head,
                                                         n_kv_head, num_frames, num_splits, split_len, causal);
    const int b = cta.b, kvh = cta.kvh, split = cta.split, group = cta.group, seqlen = cta.seqlen;
    const int rows_total = cta.rows_total, rows_valid = cta.rows_valid, lo = cta.lo, hi = cta.hi;
    const int warp_row0 = cta.row0 + rt0 * 16;  // the warp's first row
    const bool active = warp_row0 < rows_valid;  // the warp has a query to answer
    const int n_tiles = hi > lo ? (hi - lo + KT - 1) / KT : 0;

    // -- the gather: this thread's chunk column and key rows, offsets unsigned and hoisted
    const int my_chunk = tid % kChunks, my_key0 = tid / kChunks;
    const unsigned slot_elems = static_cast<unsigned>(n_kv_head) * D;  // one (block, offset) slot, all heads
    const unsigned block_elems = slot_elems * BS;
    const unsigned head_elem = static_cast<unsigned>(kvh) * D + my_chunk * (16 / static_cast<int>(sizeof(Page)));
    const int* __restrict__ table = block_table + static_cast<long long>(b) * table_stride;
    // fp8: the kChunks threads of a key-row group hold U = kChunks / 2 key rows, i.e. 2U scales: one each
    static_assert(!kFp8 || 2 * U == kChunks, "one scale per thread per tile");
    const int my_scale_row = my_chunk / 2;
    const float* __restrict__ my_scale_src = my_chunk % 2 ? v_scale : k_scale;
    const unsigned my_scale_dst = ((my_chunk % 2) * KT + my_key0 + my_scale_row * kKeyStep) * 4u;  // bytes
    auto load_table = [&](int tile, unsigned (&blk)[U]) {  // the physical blocks of this thread's rows
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int pos = lo + tile * KT + my_key0 + u * kKeyStep;
            blk[u] = tile < n_tiles && pos < hi ? static_cast<unsigned>(__ldg(table + static_cast<unsigned>(pos) / BS))
                                                : 0u;
        }
    };
    auto issue = [&](int tile, const unsigned (&blk)[U]) {  // all threads; commits nothing
        if (tile >= n_tiles) return;
        unsigned char* stage = smem + (tile % kStages) * kStageBytes;
        const int tile_lo = lo + tile * KT;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int key = my_key0 + u * kKeyStep, pos = tile_lo + key;
            const bool in = pos < hi;  // past the range: zero-filled, the pool is not read
            const unsigned in_block = static_cast<unsigned>(pos) % BS;
            const unsigned long long elem =
                static_cast<unsigned long long>(blk[u]) * block_elems + (in_block * slot_elems + head_elem);
            // past the range the source is not read: 16-bit pages pass the pool's base, fp8 pages the
            // slot of block 0 the address already names (the table entry reads 0), without a select
            cp_async_16(stage + key * PB + my_chunk * 16, in || kFp8 ? k_cache + elem : k_cache, in);
            cp_async_16(stage + (KT + key) * PB + my_chunk * 16, in || kFp8 ? v_cache + elem : v_cache, in);
        }
        if constexpr (kFp8) {  // one scale per thread: the k or v scale (my_chunk % 2) of key row my_chunk / 2
            unsigned block = blk[0];
#pragma unroll
            for (int u = 1; u < U; ++u) block = u == my_scale_row ? blk[u] : block;
            const int key = my_key0 + my_scale_row * kKeyStep, pos = tile_lo + key;
            const bool in = pos < hi;
            const unsigned long long s =
                (static_cast<unsigned long long>(block) * BS + static_cast<unsigned>(pos) % BS) * n_kv_head + kvh;
            warp::cp_async_4(stage + 2 * KT * PB + my_scale_dst, my_scale_src + s, in);  // (!in: block 0, not read)
        }
    };

    // -- prologue: the table, then the first kStages - 1 tiles, then Q (which they need not wait for)
    {
        unsigned first[kStages - 1][U];
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s) load_table(s, first[s]);
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s) {
            issue(s, first[s]);
            warp::cp_async_commit_group();
        }
    }
    unsigned blk[U];  // the table entries of the next tile to issue, read one iteration ahead
    load_table(kStages - 1, blk);

    // Q's A fragments straight from global memory: rows g and g + 8 of the warp's tile (zero past the
    // valid rows). a[h] holds k 2q, 2q+1 and a[2 + h] k 2q+8, 2q+9 of row g + 8h; on fp8 pages the
    // k order is permuted to match K's fragments (dims 4q .. 4q+3, see warp_mma.cuh).
    unsigned qf[kRT][DK][4];
#pragma unroll
    for (int r = 0; r < kRT; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + 16 * r + g + 8 * h;
        const bool valid = row < rows_valid;
        const T* q_row = q + ((static_cast<long long>(b) * n_head + kvh * group + (valid ? row % group : 0)) *
                                  num_frames + (valid ? row / group : 0)) * D;  // fmt: skip
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            if constexpr (kFp8) {  // (still T here; converted to f16 below)
                uint2 x = {0u, 0u};
                if (valid) x = *reinterpret_cast<const uint2*>(q_row + kk * 16 + 4 * qd);
                qf[r][kk][h] = x.x;
                qf[r][kk][2 + h] = x.y;
            } else {
                qf[r][kk][h] = valid ? *reinterpret_cast<const unsigned*>(q_row + kk * 16 + 2 * qd) : 0u;
                qf[r][kk][2 + h] = valid ? *reinterpret_cast<const unsigned*>(q_row + kk * 16 + 8 + 2 * qd) : 0u;
            }
        }
    }

    // The exponent factor of rows g and g + 8: p = 2^(s * c_row - m). fp8 pages on bf16 queries: each
    // row of Q is multiplied by a power of two 2^a that puts its largest magnitude into [2^15, 2^16)
    // (a <= 64), then rounded to f16 (exact for every element within 2^-32 of that largest, see the
    // header), and c_row undoes 2^a.
    float c_row[kRT][2];
#pragma unroll
    for (int r = 0; r < kRT; ++r) c_row[r][0] = c_row[r][1] = scale_log2;
    if constexpr (kFp8 && !Same<T, __half>::value) {
#pragma unroll
        for (int r = 0; r < kRT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float amax = 0.f;
#pragma unroll
            for (int kk = 0; kk < DK; ++kk)
#pragma unroll
                for (int i = h; i < 4; i += 2) {  // a bf16 pair: its two fp32 values are the halves' bits
                    amax = fmaxf(amax, fmaxf(fabsf(__int_as_float(qf[r][kk][i] << 16)),
                                             fabsf(__int_as_float(qf[r][kk][i] & 0xffff0000u))));
                }
            amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));  // the row's four lanes
            amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
            const int a = imin(142 - ((__float_as_int(amax) >> 23) & 0xff), 64);  // biased exponent 127 + 15
            const float up = __int_as_float((127 + a) << 23), down = __int_as_float((127 - a) << 23);
            c_row[r][h] = scale_log2 * down;
#pragma unroll
            for (int kk = 0; kk < DK; ++kk)
#pragma unroll
                for (int i = h; i < 4; i += 2)
                    qf[r][kk][i] = pack2<__half>(__int_as_float(qf[r][kk][i] << 16) * up,
                                                 __int_as_float(qf[r][kk][i] & 0xffff0000u) * up);
        }
    }

    if constexpr (kRT == 2) {  // one copy (every warp holds the same); read after the main loop's first barrier
        if (warp_id == 0) {
#pragma unroll
            for (int r = 0; r < kRT; ++r)
#pragma unroll
                for (int kk = 0; kk < DK; ++kk) {
                    uint4 v;
                    v.x = qf[r][kk][0];
                    v.y = qf[r][kk][1];
                    v.z = qf[r][kk][2];
                    v.w = qf[r][kk][3];
                    q_smem[(r * DK + kk) * kWarp + lane] = v;
                }
        }
    }
    // Q's A fragment of row tile r, k-step kk: from registers, or (two row tiles) from shared memory
    auto q_frag = [&](int r, int kk, unsigned (&a)[4]) {
        if constexpr (kRT == 2) {
            const uint4 v = q_smem[(r * DK + kk) * kWarp + lane];
            a[0] = v.x;
            a[1] = v.y;
            a[2] = v.z;
            a[3] = v.w;
        } else {
            a[0] = qf[r][kk][0];
            a[1] = qf[r][kk][1];
            a[2] = qf[r][kk][2];
            a[3] = qf[r][kk][3];
        }
    };

    // -- running state of rows g and g + 8 over the warp's key slice
    float o[kRT][DT][4];
    float m_run[kRT][2], l_run[kRT][2];  // m in scaled (log2) units; l: this lane's share (its own key columns)
    int key_limits[kRT][2];  // a row sees keys pos < its limit (hi, cut by causality; lo for rows past the length)
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
#pragma unroll
        for (int n = 0; n < DT; ++n) o[r][n][0] = o[r][n][1] = o[r][n][2] = o[r][n][3] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m_run[r][h] = neg_inf();
            l_run[r][h] = 0.f;
            const int row = warp_row0 + 16 * r + g + 8 * h;
            key_limits[r][h] = row < rows_valid ? (causal ? imin(hi, seqlen + row / group + 1) : hi) : lo;
        }
    }
    // kRel: rows g and g + 8's tables of the relative-position term; their scores go to log2 units with
    // the term added (s * c_row + bias * log2(e)) before the mask, and the softmax below then takes c = 1.
    const float* rel_cta = nullptr;
    int rel_top[kRT][2], rel_at[kRT][2];
    float c_use[kRT][2];
#pragma unroll
    for (int r = 0; r < kRT; ++r) c_use[r][0] = c_row[r][0], c_use[r][1] = c_row[r][1];
    if constexpr (kRel) {
        rel_cta = rel_table_of_cta(rel_bias, rel_len, cta, n_head, num_frames);
#pragma unroll
        for (int r = 0; r < kRT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const RelRowOffset ro = rel_row_offset(rel_len, cta, warp_row0 + 16 * r + g + 8 * h, num_frames);
            rel_top[r][h] = ro.top;
            rel_at[r][h] = ro.at;
            c_use[r][h] = 1.f;
        }
    }
    auto key_limit = [&](int r, int h) { return key_limits[r][h]; };
    // Keys from here on need the per-row test (warp-uniform): the range's end, or the causal limit of the
    // warp's first row. Rows past the length are not masked on interior tiles: they are never stored.
    const int mask_from = causal ? imin(hi, seqlen + warp_row0 / group + 1) : hi;
    // fp8 pages: row h of O is kept in units of w_ref[h], a power of two (at least 2^-126) near the
    // row's largest p * v_scale, so that P' = p * v_scale / w_ref < 2 fits f16 (see the header).
    float w_ref[kRT][2];
#pragma unroll
    for (int r = 0; r < kRT; ++r) w_ref[r][0] = w_ref[r][1] = __int_as_float(1 << 23);

    for (int it = 0; it < n_tiles; ++it) {
        warp::cp_async_wait_group<kStages - 2>();  // tile it has landed (this thread's copies)
        __syncthreads();                          // ... everyone's; stage (it - 1) % kStages is free
        issue(it + kStages - 1, blk);
        warp::cp_async_commit_group();
        load_table(it + kStages, blk);
        if (!active) continue;  // warp-uniform; no barrier below until the next iteration

        const unsigned char* stage = smem + (it % kStages) * kStageBytes;
        const int key0 = slice * KW;  // the warp's first key in the tile
        float sc[kRT][NN][4];
#pragma unroll
        for (int r = 0; r < kRT; ++r)
#pragma unroll
            for (int n = 0; n < NN; ++n) sc[r][n][0] = sc[r][n][1] = sc[r][n][2] = sc[r][n][3] = 0.f;

        // S = Q K^T over the warp's KW keys: n-tile n = keys key0 + 8n .. + 7; each K fragment serves every
        // row tile of the warp (widened once on fp8 pages)
#pragma unroll
        for (int np = 0; np < NP; ++np) {
            const int k16 = key0 + 16 * np;
            if constexpr (kFp8) {
#pragma unroll
                for (int j = 0; j < DK / 2; ++j) {  // matrices: keys 0-7 / 8-15 x slabs 2j / 2j + 1
                    unsigned kf[4];
                    ldmatrix_x4(kf, stage + (k16 + ((lane / 8) % 2) * 8 + lane % 8) * PB + (2 * j + lane / 16) * 16);
                    unsigned qa[kRT][2][4];
#pragma unroll
                    for (int r = 0; r < kRT; ++r) {
                        q_frag(r, 2 * j, qa[r][0]);
                        q_frag(r, 2 * j + 1, qa[r][1]);
                    }
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        unsigned bfrag[2];
                        warp::fp8x4_to<MM>(kf[i], bfrag);
#pragma unroll
                        for (int r = 0; r < kRT; ++r)
                            mma_m16n8k16<MM>(sc[r][2 * np + i % 2], qa[r][i / 2], bfrag, sc[r][2 * np + i % 2]);
                    }
                }
            } else {
                const T* k_tile = reinterpret_cast<const T*>(stage);
#pragma unroll
                for (int kk = 0; kk < DK; ++kk) {
                    unsigned kf[4];
                    ldmatrix_x4(kf, k_tile + (k16 + (lane / 16) * 8 + lane % 8) * TS + kk * 16 + ((lane / 8) % 2) * 8);
                    const unsigned b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
#pragma unroll
                    for (int r = 0; r < kRT; ++r) {
                        mma_m16n8k16<T>(sc[r][2 * np], qf[r][kk], b0, sc[r][2 * np]);
                        mma_m16n8k16<T>(sc[r][2 * np + 1], qf[r][kk], b1, sc[r][2 * np + 1]);
                    }
                }
            }
        }

        // Element (n, e) of S: row h = e / 2, key key0 + 8n + 2qd + e % 2.
        const float* scales = reinterpret_cast<const float*>(stage + 2 * KT * PB);
        if constexpr (kFp8) {
#pragma unroll
            for (int n = 0; n < NN; ++n) {
                const float2 ks = *reinterpret_cast<const float2*>(scales + key0 + 8 * n + 2 * qd);
#pragma unroll
                for (int r = 0; r < kRT; ++r) {
                    sc[r][n][0] *= ks.x;
                    sc[r][n][1] *= ks.y;
                    sc[r][n][2] *= ks.x;
                    sc[r][n][3] *= ks.y;
                }
            }
        }
        const int slice_lo = lo + it * KT + key0;
        if constexpr (kRel) {  // keys a row sees (below its key_limit): s * c_row + rel_bias[..] * log2(e)
#pragma unroll
            for (int r = 0; r < kRT; ++r)
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int pos = slice_lo + 8 * n + 2 * qd + e % 2, h = e / 2;
                    if (pos < key_limit(r, h))
                        sc[r][n][e] = fmaf(sc[r][n][e], c_row[r][h],
                                           rel_term_log2(rel_cta, rel_top[r][h], rel_at[r][h], pos, rel_len));
                }
        }
        if (slice_lo + KW > mask_from) {  // a boundary tile: keys past a row's limit (or the range) -> -inf
#pragma unroll
            for (int r = 0; r < kRT; ++r) {
                if constexpr (kFp8) {  // the same test against limits relative to the lane's first key column
                    const int lim[2] = {key_limit(r, 0) - slice_lo - 2 * qd, key_limit(r, 1) - slice_lo - 2 * qd};
#pragma unroll
                    for (int n = 0; n < NN; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (8 * n + e % 2 >= lim[e / 2]) sc[r][n][e] = neg_inf();
                } else {
#pragma unroll
                    for (int n = 0; n < NN; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (slice_lo + 8 * n + 2 * qd + e % 2 >= key_limit(r, e / 2)) sc[r][n][e] = neg_inf();
                }
            }
        }
        // The online softmax of each row tile: independent chains (with two row tiles, interleaved)
#pragma unroll
        for (int r = 0; r < kRT; ++r) {
            float tile_max[2] = {fmaxf(sc[r][0][0], sc[r][0][1]), fmaxf(sc[r][0][2], sc[r][0][3])};
#pragma unroll
            for (int n = 1; n < NN; ++n) {
                tile_max[0] = fmaxf(tile_max[0], fmaxf(sc[r][n][0], sc[r][n][1]));
                tile_max[1] = fmaxf(tile_max[1], fmaxf(sc[r][n][2], sc[r][n][3]));
            }
            float alpha[2], m_use[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(kFullMask, tile_max[h], 1));
                tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(kFullMask, tile_max[h], 2));
                const float m_new = fmaxf(m_run[r][h], tile_max[h] * c_use[r][h]);  // c_use > 0: the max of the scaled
                m_use[h] = m_new == neg_inf() ? 0.f : m_new;                      // no key yet: every weight is 0
                alpha[h] = ex2_approx_ftz(m_run[r][h] - m_use[h]);               // 0 when m_run was -inf
                m_run[r][h] = m_new;
                l_run[r][h] *= alpha[h];
            }
            float vs[NN][2];  // (read here, per row tile: fewer registers live across the row max)
#pragma unroll
            for (int n = 0; n < NN; ++n) vs[n][0] = vs[n][1] = 1.f;
            if constexpr (kFp8) {
#pragma unroll
                for (int n = 0; n < NN; ++n) {
                    const float2 v2s = *reinterpret_cast<const float2*>(scales + KT + key0 + 8 * n + 2 * qd);
                    vs[n][0] = v2s.x;
                    vs[n][1] = v2s.y;
                }
            }
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = ex2_approx_ftz(fmaf(sc[r][n][e], c_use[r][e / 2], -m_use[e / 2]));  // -inf -> 0
                    l_run[r][e / 2] += p;
                    sc[r][n][e] = kFp8 ? p * vs[n][e % 2] : p;
                }
            float alpha_o[2] = {alpha[0], alpha[1]};  // O's rescale (fp8: also to the row's new unit)
            if constexpr (kFp8) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float w = fmaxf(sc[r][0][2 * h], sc[r][0][2 * h + 1]);  // the row's largest p * v_scale
#pragma unroll
                    for (int n = 1; n < NN; ++n) w = fmaxf(w, fmaxf(sc[r][n][2 * h], sc[r][n][2 * h + 1]));
                    w = fmaxf(w, __shfl_xor_sync(kFullMask, w, 1));  // the quad holds all KW keys
                    w = fmaxf(w, __shfl_xor_sync(kFullMask, w, 2));
                    // ... or the old unit as O decays by alpha, at least 2^-126; rounded down to a power of two
                    w = fmaxf(fmaxf(w, w_ref[r][h] * alpha[h]), __int_as_float(1 << 23));
                    const float w_new = __int_as_float(__float_as_int(w) & 0x7f800000);
                    // 1 / w_new exactly: a power of two in [2^-126, 2^127), its reciprocal's biased exponent is
                    // 254 - its own
                    const float w_inv = __int_as_float(0x7f000000 - __float_as_int(w_new));
                    alpha_o[h] *= w_ref[r][h] * w_inv;  // O to the new unit
                    w_ref[r][h] = w_new;
#pragma unroll
                    for (int n = 0; n < NN; ++n) {
                        sc[r][n][2 * h] *= w_inv;
                        sc[r][n][2 * h + 1] *= w_inv;
                    }
                }
            }
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                o[r][n][0] *= alpha_o[0];
                o[r][n][1] *= alpha_o[0];
                o[r][n][2] *= alpha_o[1];
                o[r][n][3] *= alpha_o[1];
            }
        }

        // O += P V: P's A fragments straight from S's C fragments, one per 16-key k-step; each V fragment
        // serves every row tile of the warp (widened once on fp8 pages)
#pragma unroll
        for (int np = 0; np < NP; ++np) {
            const int k16 = key0 + 16 * np;
            unsigned pa[kRT][4];
#pragma unroll
            for (int r = 0; r < kRT; ++r) {
                pa[r][0] = pack2<MM>(sc[r][2 * np][0], sc[r][2 * np][1]);
                pa[r][1] = pack2<MM>(sc[r][2 * np][2], sc[r][2 * np][3]);
                pa[r][2] = pack2<MM>(sc[r][2 * np + 1][0], sc[r][2 * np + 1][1]);
                pa[r][3] = pack2<MM>(sc[r][2 * np + 1][2], sc[r][2 * np + 1][3]);
            }
            if constexpr (kFp8) {
                const unsigned char* v_tile = stage + KT * PB;
#pragma unroll
                for (int j = 0; j < DK / 2; ++j) {  // matrices: keys 0-7 / 8-15 x slabs 2j / 2j + 1
                    unsigned vf[4];
                    ldmatrix_x4_trans(vf, v_tile + (k16 + ((lane / 8) % 2) * 8 + lane % 8) * PB + (2 * j + lane / 16) * 16);
#pragma unroll
                    for (int sl = 0; sl < 2; ++sl) {  // slab 2j + sl -> n-tiles 2 (2j + sl) (even dims), + 1 (odd)
                        unsigned lo_keys[2], hi_keys[2];
                        warp::fp8x4_to_interleaved<MM>(vf[2 * sl], lo_keys);
                        warp::fp8x4_to_interleaved<MM>(vf[2 * sl + 1], hi_keys);
                        const unsigned even[2] = {lo_keys[0], hi_keys[0]}, odd[2] = {lo_keys[1], hi_keys[1]};
                        const int n = 2 * (2 * j + sl);
#pragma unroll
                        for (int r = 0; r < kRT; ++r) {
                            mma_m16n8k16<MM>(o[r][n], pa[r], even, o[r][n]);
                            mma_m16n8k16<MM>(o[r][n + 1], pa[r], odd, o[r][n + 1]);
                        }
                    }
                }
            } else {
                const T* v_tile = reinterpret_cast<const T*>(stage) + KT * TS;
#pragma unroll
                for (int dp = 0; dp < DT / 2; ++dp) {
                    unsigned vf[4];
                    ldmatrix_x4_trans(vf, v_tile + (k16 + ((lane / 8) % 2) * 8 + lane % 8) * TS + dp * 16 + (lane / 16) * 8);
                    const unsigned b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
#pragma unroll
                    for (int r = 0; r < kRT; ++r) {
                        mma_m16n8k16<MM>(o[r][2 * dp], pa[r], b0, o[r][2 * dp]);
                        mma_m16n8k16<MM>(o[r][2 * dp + 1], pa[r], b1, o[r][2 * dp + 1]);
                    }
                }
            }
        }
    }

    if constexpr (kFp8) {  // O back to its own units
#pragma unroll
        for (int r = 0; r < kRT; ++r)
#pragma unroll
            for (int n = 0; n < DT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[r][n][e] *= w_ref[r][e / 2];
    }

    // -- merge the key slices of each row tile: warp R finalizes row tile R (its own state of it, slice 0 or
    // R), every other (slice, row tile) state is handed to it through shared memory
    warp::cp_async_wait_group<0>();  // (only empty groups remain; the ring is about to be reused)
    __syncthreads();
    auto merge_slot = [&](int sl, int row_tile) {
        return reinterpret_cast<float*>(smem) + ((kRT == 1 ? row_tile : sl * kRowTiles + row_tile) * kWarp + lane) *
                                                    kMergeFloats;  // fmt: skip
    };
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
        const int tile_r = rt0 + r;
        if (warp_id == tile_r || warp_row0 + 16 * r >= rows_valid) continue;  // finalized here / no query
        float* merge = merge_slot(slice, tile_r);
#pragma unroll
        for (int n = 0; n < DT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) merge[4 * n + e] = o[r][n][e];
        merge[4 * DT] = m_run[r][0];
        merge[4 * DT + 1] = m_run[r][1];
        merge[4 * DT + 2] = l_run[r][0];
        merge[4 * DT + 3] = l_run[r][1];
    }
    __syncthreads();
    if (warp_id >= kRowTiles) return;  // (no barrier below)
    // this warp's state of row tile R = warp_id (a select between its row tiles when it holds both)
    const int R = warp_id;
    const int own_slice = kRT == 1 ? 0 : R;  // (a constant with one row tile per warp: no code for it below)
    float fo[DT][4], fm[2], fl[2];
    const int fin_row0 = warp_row0 + (kRT == 1 ? 0 : 16 * R);  // (warp_row0 is row tile rt0's, = R's or 0's)
    const int frow[2] = {fin_row0 + g, fin_row0 + g + 8};
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
        const bool mine = kRT == 1 || rt0 + r == R;
#pragma unroll
        for (int n = 0; n < DT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) fo[n][e] = r == 0 || mine ? o[r][n][e] : fo[n][e];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            fm[h] = r == 0 || mine ? m_run[r][h] : fm[h];
            fl[h] = r == 0 || mine ? l_run[r][h] : fl[h];
        }
    }
    if (fin_row0 < rows_valid) {
#pragma unroll
        for (int sl = 0; sl < kSl; ++sl) {
            if (sl == own_slice) continue;  // its own
            const float* merge = merge_slot(sl, R);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m_other = merge[4 * DT + h];
                const float m = fmaxf(fm[h], m_other);
                const float m_ref = m == neg_inf() ? 0.f : m;
                const float a_mine = ex2_approx_ftz(fm[h] - m_ref), a_other = ex2_approx_ftz(m_other - m_ref);
                fm[h] = m;
                fl[h] = a_mine * fl[h] + a_other * merge[4 * DT + 2 + h];
#pragma unroll
                for (int n = 0; n < DT; ++n) {
                    fo[n][2 * h] = a_mine * fo[n][2 * h] + a_other * merge[4 * n + 2 * h];
                    fo[n][2 * h + 1] = a_mine * fo[n][2 * h + 1] + a_other * merge[4 * n + 2 * h + 1];
                }
            }
        }
    }

    // -- row sums across the quad, then store: rows < rows_total; zeros where no key was seen
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        fl[h] += __shfl_xor_sync(kFullMask, fl[h], 1);
        fl[h] += __shfl_xor_sync(kFullMask, fl[h], 2);
    }
    // Output dims of fragment element (n, 2h + c): 16-bit pages 8n + 2qd + c; fp8 pages (n-tiles of even /
    // odd dims per 16-dim slab) 16 (n / 2) + 4qd + 2c + n % 2.
    auto dim_of = [&](int n, int c) { return kFp8 ? 16 * (n / 2) + 4 * qd + 2 * c + n % 2 : 8 * n + 2 * qd + c; };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = frow[h];
        if (row >= rows_total) continue;
        // kRel: a NaN sum (a column past rel_len, see attention_window.cuh) is stored, not taken for "no key"
        const bool seen = row < rows_valid && (kRel ? !(fl[h] <= 0.f) : fl[h] > 0.f);
        const int t = row / group, hq = kvh * group + row % group;
        const long long out_row = (static_cast<long long>(b) * n_head + hq) * num_frames + t;
        if (num_splits == 1) {
            const float inv = seen ? 1.f / fl[h] : 0.f;
            T* dst = out + out_row * D;
            if constexpr (kFp8) {  // dims 16 sl + 4 qd + 0..3 = (even c0, odd c0, even c1, odd c1)
#pragma unroll
                for (int sl = 0; sl < DK; ++sl) {
                    const float* ev = fo[2 * sl];
                    const float* od = fo[2 * sl + 1];
                    uint2 x;
                    x.x = pack2<T>(seen ? ev[2 * h] * inv : 0.f, seen ? od[2 * h] * inv : 0.f);
                    x.y = pack2<T>(seen ? ev[2 * h + 1] * inv : 0.f, seen ? od[2 * h + 1] * inv : 0.f);
                    *reinterpret_cast<uint2*>(dst + 16 * sl + 4 * qd) = x;
                }
            } else {
#pragma unroll
                for (int n = 0; n < DT; ++n) {
                    const float x0 = seen ? fo[n][2 * h] * inv : 0.f;  // a select: NaN * 0 never reaches out
                    const float x1 = seen ? fo[n][2 * h + 1] * inv : 0.f;
                    *reinterpret_cast<unsigned*>(dst + 8 * n + 2 * qd) = pack2<T>(x0, x1);
                }
            }
        } else {
            const long long part_row = static_cast<long long>(split) * gridDim.z * n_head * num_frames + out_row;
#pragma unroll
            for (int n = 0; n < DT; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) part_acc[part_row * D + dim_of(n, c)] = seen ? fo[n][2 * h + c] : 0.f;
            if (qd == 0) {
                part_ml[part_row * 2] = seen ? fm[h] : neg_inf();
                part_ml[part_row * 2 + 1] = seen ? fl[h] : 0.f;
            }
        }
    }
}

}  // namespace oasr
