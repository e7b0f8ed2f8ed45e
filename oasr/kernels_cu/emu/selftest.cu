// emu/selftest.cu -- a kernel that exercises the emulator's built-ins, so the
// emulator itself is tested (the production kernels use no shuffles today).
//
// Computes, per thread of a 1-D grid of 1-D blocks (block size a multiple of 32):
//   xor_sum[i]   = sum of `in` over the thread's warp (__shfl_xor_sync butterfly)
//   down_sum[i]  = lane 0: the warp's sum (__shfl_down_sync tree); other lanes partial
//   bcast[i]     = `in` of lane 3 of the thread's warp (__shfl_sync)
//   block_sum[b] = sum of `in` over block b (__shared__ + __syncthreads)
// Values are small integers, so every order of addition gives the same float.
//
// Checked by: tests/test_kernels_emulated.py::test_emulator_builtins.
#include "../common.cuh"

__global__ void emu_selftest_kernel(const float* in, float* xor_sum, float* down_sum, float* bcast,
                                    float* block_sum) {
    __shared__ float warp_totals[32];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const float x = in[i];
    float s = x;
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    float d = x;
    for (int offset = 16; offset > 0; offset /= 2) d += __shfl_down_sync(0xffffffffu, d, offset);
    xor_sum[i] = s;
    down_sum[i] = d;
    bcast[i] = __shfl_sync(0xffffffffu, x, 3);
    if (lane == 0) warp_totals[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) total += warp_totals[w];
        block_sum[blockIdx.x] = total;
    }
}
