// attention_window.cuh -- which stream, KV head, query rows and keys one CTA of
// a chunk-attention kernel (paged_chunk_attention.cu v1, _v2.cu v2) serves, so
// both versions read the same window the same way.
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

}  // namespace oasr
