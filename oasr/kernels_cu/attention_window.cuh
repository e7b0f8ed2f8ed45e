// attention_window.cuh -- which stream, KV head, query rows and keys one CTA of
// a chunk-attention kernel (paged_chunk_attention.cu v1, _v2.cu v2, _v3.cu v3) serves, so
// every version reads the same window the same way; and the relative-position term's columns.
//
// Grid (q_tiles * num_splits, n_kv_head, B). The query rows of (stream b, KV
// head kvh) are its group's (t, g) pairs, row = t * group + g: the rows with
// t < len_b (len_b = chunk_lens[b] clamped to [0, T], or T) form a prefix of
// rows_valid = group * len_b out of rows_total = group * T. A CTA owns
// kRowsPerCta rows from row0. Keys: table positions [cache_seqstarts[b],
// cache_seqlens[b] + len_b); split s takes [start + s * split_len, + split_len)
// and the last split runs to the end whatever split_len says (a stale host
// maximum unbalances splits but never drops keys). The range is cut to what
// the CTA's valid rows can see: empty without one, and (causal) to the last
// valid row's own position.
#pragma once

#include "common.cuh"

namespace oasr {

struct AttentionCta {
    int b, kvh, split, group;
    int seqlen;      // cache_seqlens[b]: the position of the chunk's first frame
    int rows_total;  // group * T
    int rows_valid;  // group * len_b
    int row0;        // the CTA's first query row
    int lo, hi;      // the CTA's key range [lo, hi)
};

template <int kRowsPerCta>
__device__ __forceinline__ AttentionCta attention_cta(const int* __restrict__ cache_seqlens,
                                                      const int* __restrict__ cache_seqstarts,
                                                      const int* __restrict__ chunk_lens, int n_head, int n_kv_head,
                                                      int num_frames, int num_splits, int split_len, int causal) {
    AttentionCta c;
    c.b = blockIdx.z;
    c.kvh = blockIdx.y;
    c.split = blockIdx.x % num_splits;
    c.group = n_head / n_kv_head;
    const int len = chunk_lens ? imin(imax(chunk_lens[c.b], 0), num_frames) : num_frames;
    c.seqlen = cache_seqlens[c.b];
    const int end = c.seqlen + len;
    c.rows_total = c.group * num_frames;
    c.rows_valid = c.group * len;
    c.row0 = static_cast<int>(blockIdx.x / num_splits) * kRowsPerCta;
    const int last_row = imin(c.row0 + kRowsPerCta, c.rows_valid) - 1;
    c.lo = cache_seqstarts[c.b] + c.split * split_len;
    c.hi = c.split == num_splits - 1 ? end : imin(end, c.lo + split_len);
    if (last_row < c.row0) c.hi = c.lo;  // no valid query in this CTA
    if (causal && last_row >= c.row0) c.hi = imin(c.hi, c.seqlen + last_row / c.group + 1);
    return c;
}

// The relative-position term (oasr/cache/rel_bias.py), read by the attention kernels' kRel instances:
// query row `row` (t = row / group, query head kvh * group + row % group) adds, to its score of
// the key at table position pos, rel_bias[b, hq, t, c] with c = (seqlen + t) - pos + (T - 1),
// from a float32 (B, n_head, T, rel_len) table. A query reads only the columns of the keys it
// sees (c >= 0 there: pos < seqlen + len); a column past rel_len (a table too short for the
// row's window, possible only when a stale host maximum passed the launcher's check) is never
// read and gives the score NaN, so the row's output shows it.
constexpr float kLog2e = 1.4426950408889634f;

// The CTA's first table row, rel_bias[b, kvh * group, 0, :]; its rows' tables follow it (query heads
// kvh * group .. + group - 1, all T frames: group * T * rel_len floats, under 2^31 (the launcher checks)).
__device__ __forceinline__ const float* rel_table_of_cta(const float* __restrict__ rel_bias, int rel_len,
                                                         const AttentionCta& c, int n_head, int num_frames) {
    return rel_bias + (static_cast<long long>(c.b) * n_head + c.kvh * c.group) * num_frames * rel_len;
}

struct RelRowOffset {
    int top;  // the row's column of table position 0: seqlen + t + T - 1
    int at;   // offset of that column from the CTA's first table row (pos's entry: at - pos)
};

__device__ __forceinline__ RelRowOffset rel_row_offset(int rel_len, const AttentionCta& c, int row, int num_frames) {
    const int r = row < c.rows_valid ? row : 0;  // rows past the chunk read nothing
    const int t = r / c.group;
    RelRowOffset o;
    o.top = c.seqlen + t + num_frames - 1;
    o.at = ((r % c.group) * num_frames + t) * rel_len + o.top;
    return o;
}

// The term of key position `pos` for a row that sees it, in log2 units (the kernels' softmax domain).
__device__ __forceinline__ float rel_term_log2(const float* __restrict__ rel_cta, int top, int at, int pos,
                                               int rel_len) {
    return static_cast<unsigned>(top - pos) < static_cast<unsigned>(rel_len) ? __ldg(rel_cta + (at - pos)) * kLog2e
                                                                              : __int_as_float(0x7fc00000u);
}

}  // namespace oasr
