// kv_formats.cuh -- the K/V page formats of oasr/kv_formats/ as the kernels read and write them.
//
// A page format is named by a Page type, the template argument the attention, append and gather
// kernels take. Pages in the model dtype (Page = T) and fp8 (Page = __nv_fp8_e4m3, common.cuh) are
// the original two; this header adds the tags of the other formats, each a one-byte storage type:
//
//   Page                     data per vector (D values)      scale plane per vector (`scales`)
//   T (float/half/bf16)      D values of T                   none
//   __nv_fp8_e4m3            D e4m3 bytes                    1 fp32
//   Int8Page                 D int8                          1 fp32            (oasr/kv_formats/int8.py)
//   Q8_0Page                 D int8                          D/32 fp16         (oasr/kv_formats/q8_0.py)
//   Affine4Page<T, G>        D/2 bytes, value 2i low nibble  D/G pairs (scale, bias) of T
//                                                                              (oasr/kv_formats/affine4.py)
//
// PageTraits<Page>::load<N>(pool, scales, vec, c, D, dst) widens values [c, c + N) of vector `vec`
// (vec = the vector's index in the pool: (block * block_size + offset) * n_kv_head + head) to fp32,
// exactly as the reference's dequantize computes them in fp32: q * scale (one rounding), and for
// affine q * scale then + bias (two roundings, never fused: mul_rn). N must divide the format's
// group (32 for q8_0, G for affine4) and c be a multiple of N, so one load reads one group's scale.
// kLoad is the values one 16-byte load of the page holds (16 bytes of 4-bit codes: 32 values).
//
// Quantizer<T, Page>::quantize runs inside the append kernel (paged_kv_append.cu): each lane holds
// E consecutive values of one vector; the lanes of one group reduce their max (and min) with
// __shfl_xor_sync, then every lane applies the rule of its format to its values and stores its
// bytes; the first lane of a group stores the group's scale (and bias). The rules, stated once in
// their Python modules, are restated here line for line; tests/test_kv_format_kernels.py checks
// the stored bytes bit for bit against the reference on a NaN-poisoned pool.
//
// NaN input, which the Python rules refuse and a kernel cannot (it reads nothing back to the host): the
// reductions use fmaxf / fminf, which skip a NaN operand, so a NaN stores int8 q = -127, q8_0 q = 0 and
// affine4 code 0, the scale (and bias) coming from the other values; an affine4 group of NaN only stores
// scale = bias = NaN. The table is in oasr/fast/paged_ops.py; tests/test_kv_nan_refusal.py checks it.
#pragma once

#include "common.cuh"

namespace oasr {

struct Int8Page {
    signed char q;
};
struct Q8_0Page {
    signed char q;
};
template <typename T, int G>
struct Affine4Page {
    unsigned char codes;
};

#ifdef OASR_HOST_EMULATION
// g++ in ISO C++ mode never contracts a * b + c, and x86-64 without -mfma has no fma: a plain product.
__device__ __forceinline__ float mul_rn(float a, float b) { return a * b; }
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }  // never fused into an fma
#endif

__device__ __forceinline__ bool finite_f(float x) { return fabsf(x) <= 3.40282347e38f; }

// ---- reads ----------------------------------------------------------------------------------

template <typename Page>
struct PageTraits {  // the model dtype (Page = T) and fp8 (Page = __nv_fp8_e4m3)
    static constexpr int kLoad = kVec16<Page>;
    template <int N>
    static __device__ __forceinline__ void load(const Page* __restrict__ pool, const void* __restrict__ scales,
                                                long long vec, int c, int D, float (&dst)[N]) {
        if constexpr (Codec<Page>::kScaled) {
            load_vec_scaled<Page, N>(pool + vec * D + c, static_cast<const float*>(scales)[vec], dst);
        } else {
            load_vec<Page, N>(pool + vec * D + c, dst);
        }
    }
};

template <int N>
__device__ __forceinline__ void load_int8(const signed char* __restrict__ src, float scale, float (&dst)[N]) {
    const Pack<signed char, N> p = *reinterpret_cast<const Pack<signed char, N>*>(src);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = static_cast<float>(p.v[i]) * scale;
}

template <>
struct PageTraits<Int8Page> {
    static constexpr int kLoad = 16;
    template <int N>
    static __device__ __forceinline__ void load(const Int8Page* __restrict__ pool, const void* __restrict__ scales,
                                                long long vec, int c, int D, float (&dst)[N]) {
        load_int8<N>(reinterpret_cast<const signed char*>(pool) + vec * D + c, static_cast<const float*>(scales)[vec],
                     dst);
    }
};

template <>
struct PageTraits<Q8_0Page> {
    static constexpr int kLoad = 16;
    template <int N>
    static __device__ __forceinline__ void load(const Q8_0Page* __restrict__ pool, const void* __restrict__ scales,
                                                long long vec, int c, int D, float (&dst)[N]) {
        static_assert(32 % N == 0, "a load stays inside one q8_0 block");
        const float d = __half2float(static_cast<const __half*>(scales)[vec * (D / 32) + c / 32]);
        load_int8<N>(reinterpret_cast<const signed char*>(pool) + vec * D + c, d, dst);
    }
};

template <typename T, int G>
struct PageTraits<Affine4Page<T, G>> {
    static constexpr int kLoad = 32;  // 16 bytes of 4-bit codes
    template <int N>
    static __device__ __forceinline__ void load(const Affine4Page<T, G>* __restrict__ pool,
                                                const void* __restrict__ scales, long long vec, int c, int D,
                                                float (&dst)[N]) {
        static_assert(N % 2 == 0 && G % N == 0, "a load is whole bytes inside one group");
        const T* params = static_cast<const T*>(scales) + (vec * (D / G) + c / G) * 2;
        const float scale = Codec<T>::to_float(params[0]), bias = Codec<T>::to_float(params[1]);
        const Pack<unsigned char, N / 2> p =
            *reinterpret_cast<const Pack<unsigned char, N / 2>*>(reinterpret_cast<const unsigned char*>(pool) +
                                                                 vec * (D / 2) + c / 2);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            dst[2 * i] = mul_rn(static_cast<float>(p.v[i] & 0x0f), scale) + bias;
            dst[2 * i + 1] = mul_rn(static_cast<float>(p.v[i] >> 4), scale) + bias;
        }
    }
};

// ---- writes ---------------------------------------------------------------------------------

// Max over the `lanes` lanes of an aligned group (a power of two dividing 32) of the warp.
__device__ __forceinline__ float group_max(float x, int lanes) {
    for (int offset = lanes / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
    return x;
}
__device__ __forceinline__ float group_min(float x, int lanes) {
    for (int offset = lanes / 2; offset > 0; offset /= 2) x = fminf(x, __shfl_xor_sync(kFullMask, x, offset));
    return x;
}

template <typename T, typename Page>
struct Quantizer;

// int8: one group, the whole vector. scale = max(amax / 127, 2^-149); q = clamp(rne(x / scale), +-127).
template <typename T>
struct Quantizer<T, Int8Page> {
    static constexpr int kGroup = 0;  // 0: the whole vector
    template <int E>
    static __device__ __forceinline__ void quantize(const float (&x)[E], bool active, int lanes_per_vector,
                                                    Int8Page* pool, void* scales, long long vec, int e0, int D) {
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) amax = fmaxf(amax, fabsf(x[i]));
        amax = group_max(amax, lanes_per_vector);
        if (!active) return;
        const float scale = fmaxf(amax / 127.f, 1.40129846e-45f);  // 2^-149
        Pack<signed char, E> p;
#pragma unroll
        for (int i = 0; i < E; ++i) p.v[i] = static_cast<signed char>(fminf(fmaxf(rintf(x[i] / scale), -127.f), 127.f));
        *reinterpret_cast<Pack<signed char, E>*>(reinterpret_cast<signed char*>(pool) + vec * D + e0) = p;
        if (e0 == 0) static_cast<float*>(scales)[vec] = scale;
    }
};

// q8_0 (GGML): groups of 32. d = amax / 127, id = d ? 1 / d : 0, q = roundf(x * id) (0 where not
// finite), stored d = fp16(d).
template <typename T>
struct Quantizer<T, Q8_0Page> {
    static constexpr int kGroup = 32;
    template <int E>
    static __device__ __forceinline__ void quantize(const float (&x)[E], bool active, int, Q8_0Page* pool,
                                                    void* scales, long long vec, int e0, int D) {
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) amax = fmaxf(amax, fabsf(x[i]));
        amax = group_max(amax, kGroup / E);
        if (!active) return;
        const float d = amax / 127.f;
        const float id = d == 0.f ? 0.f : 1.f / d;
        Pack<signed char, E> p;
#pragma unroll
        for (int i = 0; i < E; ++i) {
            const float y = x[i] * id;
            p.v[i] = static_cast<signed char>(finite_f(y) ? roundf(y) : 0.f);
        }
        *reinterpret_cast<Pack<signed char, E>*>(reinterpret_cast<signed char*>(pool) + vec * D + e0) = p;
        if (e0 % kGroup == 0) static_cast<__half*>(scales)[vec * (D / 32) + e0 / 32] = __float2half_rn(d);
    }
};

// affine4 (MLX): groups of G. scale = T((hi - lo) / 15), bias = T(lo), each stored as +0 when zero,
// q = scale ? clamp(rne((x - bias) / scale), 0, 15) : 0, two codes per byte (value 2i in the low nibble).
template <typename T, int G>
struct Quantizer<T, Affine4Page<T, G>> {
    static constexpr int kGroup = G;
    template <int E>
    static __device__ __forceinline__ void quantize(const float (&x)[E], bool active, int,
                                                    Affine4Page<T, G>* pool, void* scales, long long vec, int e0,
                                                    int D) {
        static_assert(E % 2 == 0, "a lane stores whole bytes");
        float lo = x[0], hi = x[0];
#pragma unroll
        for (int i = 1; i < E; ++i) {
            lo = fminf(lo, x[i]);
            hi = fmaxf(hi, x[i]);
        }
        lo = group_min(lo, kGroup / E);
        hi = group_max(hi, kGroup / E);
        if (!active) return;
        T scale_t = Codec<T>::from_float((hi - lo) / 15.f), bias_t = Codec<T>::from_float(lo);
        // a zero is stored as +0, whichever zero fminf / fmaxf returned (the rule's signed-zero line)
        if (Codec<T>::to_float(scale_t) == 0.f) scale_t = Codec<T>::from_float(0.f);
        if (Codec<T>::to_float(bias_t) == 0.f) bias_t = Codec<T>::from_float(0.f);
        const float scale = Codec<T>::to_float(scale_t), bias = Codec<T>::to_float(bias_t);
        Pack<unsigned char, E / 2> p;
#pragma unroll
        for (int i = 0; i < E / 2; ++i) {
            unsigned char code[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const float q = scale == 0.f ? 0.f : fminf(fmaxf(rintf((x[2 * i + j] - bias) / scale), 0.f), 15.f);
                code[j] = static_cast<unsigned char>(q);
            }
            p.v[i] = static_cast<unsigned char>(code[0] | (code[1] << 4));
        }
        *reinterpret_cast<Pack<unsigned char, E / 2>*>(reinterpret_cast<unsigned char*>(pool) + vec * (D / 2) +
                                                       e0 / 2) = p;
        if (e0 % G == 0) {
            T* params = static_cast<T*>(scales) + (vec * (D / G) + e0 / G) * 2;
            params[0] = scale_t;
            params[1] = bias_t;
        }
    }
};

}  // namespace oasr
