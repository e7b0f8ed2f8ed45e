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
// fp8 pages: paged_kv_append_fp8_kernel<T, D> (below) quantizes instead of
// copying; see its own header. int8, q8_0 and affine4 pages:
// paged_kv_append_quant_kernel<T, Page, D> (at the end), the rules in kv_formats.cuh.
//
// Checked by: tests/test_kernels_emulated.py::test_append_* (host emulation,
// whole pool compared bitwise with the reference on a NaN-poisoned pool and a
// shuffled block table), tests/test_fp8_kernels.py (the fp8 variant: bytes and
// scales bitwise against the reference and against torch's own conversion) and
// tests/test_kernels_cuda.py (both on a GPU).
//   python -m pytest tests/test_kernels_emulated.py -k append    (CPU, no GPU needed)
//   python -m pytest tests/test_fp8_kernels.py -k append         (CPU, no GPU needed)
//   python -m pytest tests/test_kv_format_kernels.py -k append   (int8 / q8_0 / affine4, CPU)
//   python -m pytest -m cuda tests/test_kernels_cuda.py          (GPU)
//   python -m oasr kernels --arch sm_80,sm_90                    (registers, smem, spills)
#include "common.cuh"
#include "kv_formats.cuh"

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

// paged_kv_append_fp8_kernel -- the same write into fp8 (e4m3) pages, quantizing.
//
// Computes (the oracle is oasr.reference.paged_ops.append_kv on a quantized
// cache, i.e. oasr.fp8.quantize per vector, T being the model dtype):
//   for every written frame (as above) and KV head h, with x = float(k_chunk[b, t, h, :]):
//       x = fp8_saturate<T>(x)            (common.cuh: clamp to +-L, so x's dequantized value is finite in T)
//       s = fp8_scale(max |x|)            (common.cuh: the least power of two with max|x| / s <= 448)
//       k_cache[slot, h, :] = e4m3(x / s)  (IEEE division: exact, s is a power of two)
//       k_scale[slot, h]    = s
//   and the same for v. Data and scales are written by the same launch.
//
// Layouts (contiguous): k_chunk, v_chunk (B, T, n_kv_head, D) of T = float,
//   __half or __nv_bfloat16 (the model dtype, read as is and widened exactly,
//   which is the reference's x.float()); k_cache, v_cache (num_pool_blocks,
//   block_size, n_kv_head, D) e4m3; k_scale, v_scale (num_pool_blocks,
//   block_size, n_kv_head) fp32; block_table, cache_seqlens, chunk_lens as above.
//
// Grid/block: 1-D, 128 threads, grid-stride over vectors (b, t, h), h fastest.
//   A vector is owned by a group of G = D / E lanes, each holding E = 16 /
//   sizeof(T) consecutive values (one 16-byte load of K and one of V). The
//   group's amax is a butterfly of __shfl_xor_sync within the G lanes, so every
//   lane of the group gets the same max and hence the same scale; each lane
//   then stores its E e4m3 bytes with one access and lane 0 of the group stores
//   the two scales. A warp serves 32 / G consecutive vectors per step: its loads
//   are one contiguous 512-byte run, its stores D-byte rows. The loop bound is
//   uniform across the warp (it advances in whole warps), so every lane reaches
//   every shuffle; lanes past the end or past their row's chunk_len shuffle
//   zeros and store nothing.
template <typename T, int D>
__global__ void __launch_bounds__(128) paged_kv_append_fp8_kernel(
    const T* __restrict__ k_chunk, const T* __restrict__ v_chunk, __nv_fp8_e4m3* __restrict__ k_cache,
    __nv_fp8_e4m3* __restrict__ v_cache, float* __restrict__ k_scale, float* __restrict__ v_scale,
    const int* __restrict__ block_table, int table_stride, const int* __restrict__ cache_seqlens,
    const int* __restrict__ chunk_lens, int batch, int num_frames, int block_size, int n_kv_head) {
    constexpr int E = kVec16<T>;  // values per lane
    constexpr int G = D / E;      // lanes per vector
    constexpr int VPW = kWarp / G;  // vectors per warp step
    static_assert(D % E == 0 && kWarp % G == 0, "head_dim must split into 16-byte lanes within a warp");

    const int lane = threadIdx.x % kWarp;
    const int sub = lane / G;  // which of the warp's vectors
    const int e0 = (lane % G) * E;  // first value of the vector this lane holds
    const long long vectors = static_cast<long long>(batch) * num_frames * n_kv_head;
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / kWarp);

    for (long long base = warp * VPW; base < vectors; base += warps * VPW) {
        const long long vec = base + sub;  // ((b * T) + t) * n_kv_head + h
        bool active = vec < vectors;
        int b = 0, t = 0, h = 0;
        if (active) {
            h = static_cast<int>(vec % n_kv_head);
            const long long frame = vec / n_kv_head;
            t = static_cast<int>(frame % num_frames);
            b = static_cast<int>(frame / num_frames);
            active = t < (chunk_lens ? chunk_lens[b] : num_frames);
        }
        float kx[E], vx[E];
        if (active) {
            load_vec<T, E>(k_chunk + vec * D + e0, kx);
            load_vec<T, E>(v_chunk + vec * D + e0, vx);
#pragma unroll
            for (int i = 0; i < E; ++i) {
                kx[i] = fp8_saturate<T>(kx[i]);
                vx[i] = fp8_saturate<T>(vx[i]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < E; ++i) kx[i] = vx[i] = 0.f;
        }
        float k_amax = 0.f, v_amax = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) {
            k_amax = fmaxf(k_amax, fabsf(kx[i]));
            v_amax = fmaxf(v_amax, fabsf(vx[i]));
        }
#pragma unroll
        for (int offset = G / 2; offset > 0; offset /= 2) {  // stays inside the group of G lanes
            k_amax = fmaxf(k_amax, __shfl_xor_sync(kFullMask, k_amax, offset));
            v_amax = fmaxf(v_amax, __shfl_xor_sync(kFullMask, v_amax, offset));
        }
        if (!active) continue;
        const float ks = fp8_scale(k_amax), vs = fp8_scale(v_amax);
#pragma unroll
        for (int i = 0; i < E; ++i) {
            kx[i] = kx[i] / ks;
            vx[i] = vx[i] / vs;
        }
        const int pos = cache_seqlens[b] + t;
        const long long block = block_table[static_cast<long long>(b) * table_stride + pos / block_size];
        const long long dst = (block * block_size + pos % block_size) * n_kv_head + h;  // vector in the pool
        store_vec<__nv_fp8_e4m3, E>(k_cache + dst * D + e0, kx);
        store_vec<__nv_fp8_e4m3, E>(v_cache + dst * D + e0, vx);
        if (e0 == 0) {
            k_scale[dst] = ks;
            v_scale[dst] = vs;
        }
    }
}

// paged_kv_append_quant_kernel -- the same write into int8, q8_0 or affine4 pages, quantizing.
//
// Computes (the oracle is oasr.reference.paged_ops.append_kv on such a cache, i.e. the format's
// quantize of oasr/kv_formats/ per vector): for every written frame and KV head, the vector's data
// into k_cache / v_cache and its scale plane into k_scale / v_scale (Quantizer<T, Page> in
// kv_formats.cuh states each rule; the layouts are in its table).
//
// Grid/block: as paged_kv_append_fp8_kernel: 1-D, 128 threads, grid-stride over vectors (b, t, h),
//   a vector owned by D / E lanes holding E = 16 / sizeof(T) values each (one 16-byte load of K and
//   one of V). A format's group (the whole vector for int8, 32 values for q8_0, G for affine4) is
//   a power-of-two run of those lanes, reduced with __shfl_xor_sync; the loop bound advances in
//   whole warps so every lane reaches every shuffle (lanes without a vector reduce zeros and store
//   nothing).
template <typename T, typename Page, int D>
__global__ void __launch_bounds__(128) paged_kv_append_quant_kernel(
    const T* __restrict__ k_chunk, const T* __restrict__ v_chunk, Page* __restrict__ k_cache,
    Page* __restrict__ v_cache, void* __restrict__ k_scale, void* __restrict__ v_scale,
    const int* __restrict__ block_table, int table_stride, const int* __restrict__ cache_seqlens,
    const int* __restrict__ chunk_lens, int batch, int num_frames, int block_size, int n_kv_head) {
    constexpr int E = kVec16<T>;  // values per lane
    constexpr int G = D / E;      // lanes per vector
    constexpr int VPW = kWarp / G;  // vectors per warp step
    static_assert(D % E == 0 && kWarp % G == 0, "head_dim must split into 16-byte lanes within a warp");
    static_assert(Quantizer<T, Page>::kGroup == 0 || (Quantizer<T, Page>::kGroup % E == 0 &&
                  D % Quantizer<T, Page>::kGroup == 0), "a group is whole lanes of one vector");

    const int lane = threadIdx.x % kWarp;
    const int sub = lane / G;
    const int e0 = (lane % G) * E;
    const long long vectors = static_cast<long long>(batch) * num_frames * n_kv_head;
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / kWarp);

    for (long long base = warp * VPW; base < vectors; base += warps * VPW) {
        const long long vec = base + sub;  // ((b * T) + t) * n_kv_head + h
        bool active = vec < vectors;
        int b = 0, t = 0, h = 0;
        if (active) {
            h = static_cast<int>(vec % n_kv_head);
            const long long frame = vec / n_kv_head;
            t = static_cast<int>(frame % num_frames);
            b = static_cast<int>(frame / num_frames);
            active = t < (chunk_lens ? chunk_lens[b] : num_frames);
        }
        float kx[E], vx[E];
        long long dst = 0;  // the vector's index in the pool
        if (active) {
            load_vec<T, E>(k_chunk + vec * D + e0, kx);
            load_vec<T, E>(v_chunk + vec * D + e0, vx);
            const int pos = cache_seqlens[b] + t;
            const long long block = block_table[static_cast<long long>(b) * table_stride + pos / block_size];
            dst = (block * block_size + pos % block_size) * n_kv_head + h;
        } else {
#pragma unroll
            for (int i = 0; i < E; ++i) kx[i] = vx[i] = 0.f;
        }
        Quantizer<T, Page>::template quantize<E>(kx, active, G, k_cache, k_scale, dst, e0, D);
        Quantizer<T, Page>::template quantize<E>(vx, active, G, v_cache, v_scale, dst, e0, D);
    }
}

}  // namespace oasr
