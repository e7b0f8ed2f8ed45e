// paged_kv_append.cu -- write a cohort's chunk K/V into the paged pool.
//
// Computes (the oracle is oasr.reference.paged_ops.append_kv):
//   for every row b < B and frame t < chunk_lens[b] (all T when chunk_lens is null):
//       pos = cache_seqlens[b] + t
//       slot = block_table[b, pos / block_size] * block_size + pos % block_size
//       k_cache[slot] = k_chunk[b, t]     v_cache[slot] = v_chunk[b, t]
//   Frames t >= chunk_lens[b] are not written anywhere. Pad rows of the padding
//   lane reach the scratch block through their own block table.
//
// Layouts (all contiguous, one layer of the pool):
//   k_chunk, v_chunk   (B, T, n_kv_head, head_dim)
//   k_cache, v_cache   (num_pool_blocks, block_size, n_kv_head, head_dim)
//   block_table        (B, >= W) int32, row stride `table_stride`
//   cache_seqlens, chunk_lens   (B,) int32
// One frame of one stream is n_kv_head * head_dim contiguous elements in both
// the chunk and the pool, so the kernel moves frames as `Unit`s of bytes
// (16 bytes when the frame size and the pointers allow it, else 2 bytes) and
// is the same code for fp32, fp16 and bf16: it copies, it never converts (the
// launcher casts the chunk to the pool dtype first, as the reference does).
//
// Grid/block: 1-D, 128 threads. Work item i = (b, t, u): unit u of frame t of
// row b, flattened with u fastest, so a warp moves 32 consecutive units of one
// frame (coalesced on both sides). A grid-stride loop covers B * T * units.
//
// Checked by: tests/test_kernels_emulated.py::test_append_* (host emulation,
// whole pool compared bitwise with the reference on a NaN-poisoned pool and a
// shuffled block table) and tests/test_kernels_cuda.py (same on a GPU).
//   python -m pytest tests/test_kernels_emulated.py -k append    (CPU, no GPU needed)
//   python -m pytest -m cuda tests/test_kernels_cuda.py          (GPU)
//   python -m oasr kernels --arch sm_80,sm_90                    (registers, smem, spills)
#include "common.cuh"

namespace oasr {

template <typename Unit>
__global__ void __launch_bounds__(128) paged_kv_append_kernel(
    const Unit* __restrict__ k_chunk, const Unit* __restrict__ v_chunk, Unit* __restrict__ k_cache,
    Unit* __restrict__ v_cache, const int* __restrict__ block_table, int table_stride,
    const int* __restrict__ cache_seqlens, const int* __restrict__ chunk_lens, int batch, int num_frames,
    int block_size, int units_per_frame) {
    const long long total = static_cast<long long>(batch) * num_frames * units_per_frame;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int u = static_cast<int>(i % units_per_frame);
        const long long frame = i / units_per_frame;  // b * T + t
        const int t = static_cast<int>(frame % num_frames);
        const int b = static_cast<int>(frame / num_frames);
        const int len = chunk_lens ? chunk_lens[b] : num_frames;
        if (t >= len) continue;
        const int pos = cache_seqlens[b] + t;
        const long long block = block_table[static_cast<long long>(b) * table_stride + pos / block_size];
        const long long dst = (block * block_size + pos % block_size) * units_per_frame + u;
        k_cache[dst] = k_chunk[i];
        v_cache[dst] = v_chunk[i];
    }
}

}  // namespace oasr
