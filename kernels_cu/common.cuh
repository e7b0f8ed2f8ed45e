// common.cuh -- what every oasr kernel shares: the build switch between NVRTC
// and the host emulator, and the element codecs (load as fp32, store rounded).
//
// Build switch. NVRTC compiles the kernels as CUDA; the host emulation build
// (oasr/fast/kernels/emulation.py) compiles the same files with g++ and
// -DOASR_HOST_EMULATION, which pulls in emu/simt_emu.h for the CUDA built-ins.
// Nothing below this switch, and nothing in a kernel file, differs between
// the two builds.
//
// Element codecs. Pools and activations are fp32, fp16 or bf16; all arithmetic
// is fp32. `load_vec<T, N>` reads N consecutive elements with one aligned
// vector access (N * sizeof(T) <= 16 bytes, and the address must be aligned to
// N * sizeof(T)) and widens them to float; `store_vec<T, N>` rounds N floats to
// T (round to nearest even) and writes them with one access. fp8 pools (a later
// issue) add a codec with a per-vector scale: `load_vec_scaled<T, N>(p, scale,
// out)` = load_vec then multiply, with `Codec<__nv_fp8_e4m3>` supplying the
// widening; the kernels already funnel every pool read through load_vec.
#pragma once

#ifdef OASR_HOST_EMULATION
#include "emu/simt_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace oasr {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
struct Codec;

template <>
struct Codec<float> {
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from_float(float x) { return x; }
};

template <>
struct Codec<__half> {
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Codec<__nv_bfloat16> {
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// N elements of T moved as one aligned access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

// Elements of T in one 16-byte transaction.
template <typename T>
constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* __restrict__ src, float (&dst)[N]) {
    static_assert(sizeof(T) * N <= 16, "one access moves at most 16 bytes");
    const Pack<T, N> p = *reinterpret_cast<const Pack<T, N>*>(src);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = Codec<T>::to_float(p.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ dst, const float (&src)[N]) {
    static_assert(sizeof(T) * N <= 16, "one access moves at most 16 bytes");
    Pack<T, N> p;
#pragma unroll
    for (int i = 0; i < N; ++i) p.v[i] = Codec<T>::from_float(src[i]);
    *reinterpret_cast<Pack<T, N>*>(dst) = p;
}

// A 16-byte chunk copied without conversion (append and gather move bytes).
struct alignas(16) Bytes16 {
    unsigned int w[4];
};

}  // namespace oasr

namespace oasr {

// Portable helpers: NVRTC has no <cmath>/<limits> and host g++ no CUDA min/max.
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

}  // namespace oasr
