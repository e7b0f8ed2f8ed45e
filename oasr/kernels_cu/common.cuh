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
// T (round to nearest even) and writes them with one access.
//
// fp8 pages. `__nv_fp8_e4m3` is a storage type like the others: its Codec widens
// exactly and narrows with round-to-nearest-even, saturating to +-448 (the rule
// of oasr/fp8.py never hands it anything larger). Inputs are first clamped to
// `fp8_saturate<T>`'s bound, so that every one dequantizes to a finite T. A
// vector of head_dim values carries one fp32 scale, a power of two chosen by
// `fp8_scale(amax)`; `load_vec_scaled` reads N stored values and multiplies by
// their vector's scale, so an fp8 page widens to the same fp32 as the
// reference's `stored.float() * scale`. NaN or infinite inputs are outside the
// rule: what they quantize to is not specified (and differs from torch).
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
    static constexpr bool kScaled = false;
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from_float(float x) { return x; }
};

template <>
struct Codec<__half> {
    static constexpr bool kScaled = false;
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Codec<__nv_bfloat16> {
    static constexpr bool kScaled = false;
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// e4m3 (4 exponent bits, 3 mantissa bits, no infinities, largest finite 448).
// The conversions are cuda_fp8.h's: a software path below sm_89, the hardware
// cvt from sm_89 on, the header's host code in the emulation build; all of
// them round to nearest even, like torch's .to(torch.float8_e4m3fn).
template <>
struct Codec<__nv_fp8_e4m3> {
    static constexpr bool kScaled = true;  // one fp32 scale per vector
    static __device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
    static __device__ __forceinline__ __nv_fp8_e4m3 from_float(float x) { return __nv_fp8_e4m3(x); }
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

namespace oasr {

constexpr float kFp8Max = 448.f;

// The saturation bound L of oasr/fp8.py for a model in dtype T: 1.875 * 2^emax(T), the largest
// value of 4 significant bits (an e4m3 value times a power of two) that T holds, so L, and
// everything an e4m3 byte times its scale can round to below it, is finite in T.
template <typename T>
struct Fp8Saturation;
template <>
struct Fp8Saturation<float> {
    static constexpr float kBound = 3.1901471898837980e38f;  // 1.875 * 2^127 (fp32 max is ~1.99999 * 2^127)
};
template <>
struct Fp8Saturation<__nv_bfloat16> {
    static constexpr float kBound = 3.1901471898837980e38f;  // 1.875 * 2^127 (bf16 max is 1.9921875 * 2^127)
};
template <>
struct Fp8Saturation<__half> {
    static constexpr float kBound = 61440.f;  // 1.875 * 2^15 (fp16 max is 65504)
};

// x clamped to [-L, L] for model dtype T. NaN passes through (fminf would turn it into L).
template <typename T>
__device__ __forceinline__ float fp8_saturate(float x) {
    constexpr float L = Fp8Saturation<T>::kBound;
    return x > L ? L : (x < -L ? -L : x);
}

// The scale of one vector whose largest magnitude is `amax` (oasr/fp8.py; amax already saturated):
// the least power of two s with amax / s <= 448, floored at 2^-149, and 1 for a
// zero vector. Exponent arithmetic on amax's bits, no division: write amax =
// 1.f * 2^e; 448 = 1.75 * 2^8, so s = 2^(e - 8) when 1.f <= 1.75 (the fraction
// bits <= 0x600000) and 2^(e - 7) otherwise. fp32 denormals are first scaled
// by 2^64 (exact) to give them an exponent field. The result is built from its
// bits, 2^-149 included, so no ldexpf or flush-to-zero mode is involved.
__device__ __forceinline__ float fp8_scale(float amax) {
    if (!(amax > 0.f)) return 1.f;  // zero (NaN lands here too: not specified)
    int shift = 0;
    if (amax < 1.17549435e-38f) {  // below fp32's smallest normal, 2^-126
        amax *= 18446744073709551616.f;  // 2^64
        shift = 64;
    }
    const int bits = __float_as_int(amax);
    const int e = ((bits >> 23) & 0xff) - 127;
    const int k = imax(e - 8 + ((bits & 0x7fffff) > 0x600000 ? 1 : 0) - shift, -149);
    return k >= -126 ? __int_as_float((k + 127) << 23) : __int_as_float(1 << (k + 149));
}

// N stored values of one vector, widened and multiplied by the vector's scale.
template <typename P, int N>
__device__ __forceinline__ void load_vec_scaled(const P* __restrict__ src, float scale, float (&dst)[N]) {
    load_vec<P, N>(src, dst);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] *= scale;
}

}  // namespace oasr
