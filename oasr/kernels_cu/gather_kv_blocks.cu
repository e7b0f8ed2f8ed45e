// gather_kv_blocks.cu -- copy one stream's paged K/V, all layers, into a dense
// packed tensor (the "dense mode" of the fast BlockPool).
//
// Computes (the oracle is a plain torch gather, see tests):
//   for layer l, kv head h, frame f < num_frames:
//       pos   = start + f                        position in the concatenation
//       block = block_ids[pos / block_size]      of the listed blocks
//       out[l, h, f, 0:D]  = k_pool[l, block, pos % block_size, h, :]
//       out[l, h, f, D:2D] = v_pool[l, block, pos % block_size, h, :]
//
// Layouts (contiguous):
//   k_pool, v_pool   (num_layers, num_pool_blocks, block_size, n_kv_head, head_dim)
//   block_ids        (n_blocks,) int32 physical block ids, in stream order
//   out              (num_layers, n_kv_head, num_frames, 2 * head_dim)   K | V
// Like append, this is a copy: rows move as `Unit`s (16 bytes when head_dim
// bytes and pointers allow, else 2 bytes), the same code for every dtype.
//
// Grid/block: 1-D, 128 threads, grid-stride loop over the *output* in units:
// item i = (l, h, f, half, u) with u fastest, so writes are fully coalesced and
// each warp reads whole head_dim rows of the pool.
//
// fp8 pools: gather_kv_blocks_fp8_kernel<T> (below) dequantizes instead of
// copying; see its own header. int8, q8_0 and affine4 pools:
// gather_kv_blocks_quant_kernel<T, Page> (at the end).
//
// Checked by: tests/test_kernels_emulated.py::test_gather_* (bitwise against
// the torch gather, NaN-poisoned pool outside the gathered frames),
// tests/test_fp8_kernels.py::test_gather_* (the fp8 variant, bitwise against
// the reference pool's dequantizing gather) and tests/test_kernels_cuda.py.
//   python -m pytest tests/test_kernels_emulated.py -k gather    (CPU, no GPU needed)
//   python -m pytest tests/test_fp8_kernels.py -k gather         (CPU, no GPU needed)
//   python -m pytest tests/test_kv_format_kernels.py -k gather   (int8 / q8_0 / affine4, CPU)
//   python -m pytest -m cuda tests/test_kernels_cuda.py          (GPU)
//   python -m oasr kernels --arch sm_80,sm_90                    (registers, smem, spills)
#include "common.cuh"
#include "kv_formats.cuh"

namespace oasr {

template <typename Unit>
__global__ void __launch_bounds__(128) gather_kv_blocks_kernel(
    const Unit* __restrict__ k_pool, const Unit* __restrict__ v_pool, Unit* __restrict__ out,
    const int* __restrict__ block_ids, int start, int num_frames, int num_layers, int num_pool_blocks,
    int block_size, int n_kv_head, int units_per_row) {
    const long long total = static_cast<long long>(num_layers) * n_kv_head * num_frames * 2 * units_per_row;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long rest = i;
        const int u = static_cast<int>(rest % units_per_row);
        rest /= units_per_row;
        const int half = static_cast<int>(rest % 2);  // 0: K, 1: V
        rest /= 2;
        const int f = static_cast<int>(rest % num_frames);
        rest /= num_frames;
        const int h = static_cast<int>(rest % n_kv_head);
        const long long l = rest / n_kv_head;
        const int pos = start + f;
        const long long block = block_ids[pos / block_size];
        const long long src =
            (((l * num_pool_blocks + block) * block_size + pos % block_size) * n_kv_head + h) * units_per_row + u;
        out[i] = half == 0 ? k_pool[src] : v_pool[src];
    }
}

// gather_kv_blocks_fp8_kernel -- the same gather from fp8 (e4m3) pools, dequantizing.
//
// Computes (the oracle is oasr.reference.block_pool.BlockPool.gather_kv_blocks):
//   out[l, h, f, 0:D]  = T(float(k_pool[l, block, off, h, :]) * k_scale[l, block, off, h])
//   out[l, h, f, D:2D] = T(float(v_pool[l, block, off, h, :]) * v_scale[l, block, off, h])
//   with block, off as above: the product in fp32, then rounded once to the
//   model dtype T (float, __half or __nv_bfloat16), as the reference's
//   (stored.float() * scale).to(dtype).
//
// Layouts (contiguous): k_pool, v_pool (num_layers, num_pool_blocks,
//   block_size, n_kv_head, head_dim) e4m3; k_scale, v_scale the same without
//   head_dim, fp32; out (num_layers, n_kv_head, num_frames, 2 * head_dim) of T.
//
// Grid/block: 1-D, 128 threads, grid-stride over the output in 16-byte units
//   of N = 16 / sizeof(T) values: item i = (l, h, f, half, u), u fastest. A
//   unit reads N stored bytes (one access) and one scale, and writes 16 bytes,
//   so writes are fully coalesced as in the copy kernel. head_dim must be a
//   multiple of 8 (the launcher checks).
template <typename T>
__global__ void __launch_bounds__(128) gather_kv_blocks_fp8_kernel(
    const __nv_fp8_e4m3* __restrict__ k_pool, const __nv_fp8_e4m3* __restrict__ v_pool,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, T* __restrict__ out,
    const int* __restrict__ block_ids, int start, int num_frames, int num_layers, int num_pool_blocks,
    int block_size, int n_kv_head, int head_dim) {
    constexpr int N = kVec16<T>;
    const int units_per_row = head_dim / N;
    const long long total = static_cast<long long>(num_layers) * n_kv_head * num_frames * 2 * units_per_row;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long rest = i;
        const int u = static_cast<int>(rest % units_per_row);
        rest /= units_per_row;
        const int half = static_cast<int>(rest % 2);  // 0: K, 1: V
        rest /= 2;
        const int f = static_cast<int>(rest % num_frames);
        rest /= num_frames;
        const int h = static_cast<int>(rest % n_kv_head);
        const long long l = rest / n_kv_head;
        const int pos = start + f;
        const long long block = block_ids[pos / block_size];
        const long long vec = ((l * num_pool_blocks + block) * block_size + pos % block_size) * n_kv_head + h;
        float x[N];
        if (half == 0) {
            load_vec_scaled<__nv_fp8_e4m3, N>(k_pool + vec * head_dim + u * N, k_scale[vec], x);
        } else {
            load_vec_scaled<__nv_fp8_e4m3, N>(v_pool + vec * head_dim + u * N, v_scale[vec], x);
        }
        store_vec<T, N>(out + i * N, x);
    }
}

// gather_kv_blocks_quant_kernel -- the same gather from int8, q8_0 or affine4 pools, dequantizing.
//
// Computes (the oracle is oasr.reference.block_pool.BlockPool.gather_kv_blocks): out[l, h, f, :D]
//   = T(dequantize(k_pool vector, its scale plane)) and [D:2D] the same of v, the values widened in
//   fp32 by PageTraits<Page>::load (kv_formats.cuh) and rounded once to the model dtype T.
//
// Layouts (contiguous): k_pool, v_pool (num_layers, num_pool_blocks, block_size, n_kv_head,
//   data_dim) of Page (data_dim = head_dim, or head_dim / 2 for 4-bit codes); k_scale, v_scale the
//   format's scale plane per vector (kv_formats.cuh); out (num_layers, n_kv_head, num_frames,
//   2 * head_dim) of T.
//
// Grid/block: as the fp8 gather: 1-D, 128 threads, grid-stride over the output in 16-byte units of
//   N = 16 / sizeof(T) values (u fastest); a unit reads its N values' bytes and their group's scale.
template <typename T, typename Page>
__global__ void __launch_bounds__(128) gather_kv_blocks_quant_kernel(
    const Page* __restrict__ k_pool, const Page* __restrict__ v_pool, const void* __restrict__ k_scale,
    const void* __restrict__ v_scale, T* __restrict__ out, const int* __restrict__ block_ids, int start,
    int num_frames, int num_layers, int num_pool_blocks, int block_size, int n_kv_head, int head_dim) {
    constexpr int N = kVec16<T>;
    const int units_per_row = head_dim / N;
    const long long total = static_cast<long long>(num_layers) * n_kv_head * num_frames * 2 * units_per_row;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long rest = i;
        const int u = static_cast<int>(rest % units_per_row);
        rest /= units_per_row;
        const int half = static_cast<int>(rest % 2);  // 0: K, 1: V
        rest /= 2;
        const int f = static_cast<int>(rest % num_frames);
        rest /= num_frames;
        const int h = static_cast<int>(rest % n_kv_head);
        const long long l = rest / n_kv_head;
        const int pos = start + f;
        const long long block = block_ids[pos / block_size];
        const long long vec = ((l * num_pool_blocks + block) * block_size + pos % block_size) * n_kv_head + h;
        float x[N];
        PageTraits<Page>::template load<N>(half == 0 ? k_pool : v_pool, half == 0 ? k_scale : v_scale, vec, u * N,
                                           head_dim, x);
        store_vec<T, N>(out + i * N, x);
    }
}

}  // namespace oasr
