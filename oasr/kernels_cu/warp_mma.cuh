// warp_mma.cuh -- the warp-level primitives of the tensor-core kernels, each
// one small function with one contract. This is the only file with inline PTX.
// Under OASR_HOST_EMULATION every function here is replaced by its emulation
// in emu/warp_emu.h (same name, same signature), which is warp-collective the
// way the hardware is: a wrong fragment layout or a missing cp.async wait
// gives wrong numbers on the CPU too (tests/test_warp_primitives.py).
//
// Notation (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane = 0..31,
//   g = lane / 4 (groupID), q = lane % 4 (thread in group). A 32-bit register
//   holds two 16-bit elements; the lower column (or k) index sits in the low
//   half. Matrices are indexed [row][col].
//
//   A (16 x 16, row-major, "row")      B (16 x 8, k x n, "col")     C/D (16 x 8, fp32)
//   a[0] = A[g    ][2q, 2q+1]          b[0] = B[2q, 2q+1  ][g]      c[0], c[1] = C[g    ][2q, 2q+1]
//   a[1] = A[g + 8][2q, 2q+1]          b[1] = B[2q+8, 2q+9][g]      c[2], c[3] = C[g + 8][2q, 2q+1]
//   a[2] = A[g    ][2q+8, 2q+9]
//   a[3] = A[g + 8][2q+8, 2q+9]
//
//                 k ->  0 1 | 2 3 | ... 6 7 || 8 9 | ... 14 15
//       A row g       lane 4g  4g+1 ... 4g+3 || 4g ...  (a[0] | a[2])
//       A row g + 8   lane 4g  4g+1 ... 4g+3 || 4g ...  (a[1] | a[3])
//
// ldmatrix.m8n8 .b16: up to four 8 x 8 matrices of 16-bit elements in shared
//   memory, one 16-byte row each. Lanes 8i .. 8i+7 give the row addresses of
//   matrix i (x2: lanes 0-15; x4: all 32; other lanes' addresses are ignored).
//   Lane receives r[i] = M_i[g][2q, 2q+1]; with .trans r[i] = (M_i[2q][g],
//   M_i[2q+1][g]), the transpose's fragment. So an x4 over rows of A gives an
//   A fragment, rows of K (keys x dims) give B fragments of K^T, and .trans
//   over rows of V (keys x dims) gives B fragments of V.
//
// cp.async (16 bytes, .cg: bypasses L1; 4 bytes, .ca): cp_async_16 / cp_async_4
//   queue a global -> shared copy (zeros when `fill` is false: src-size 0;
//   both addresses aligned to the size), commit_group closes this
//   thread's open group, wait_group<N> blocks until at most N of this thread's
//   committed groups are still in flight. Nothing else makes the bytes visible:
//   not __syncthreads, not time. Another thread sees them only after the
//   issuing thread's wait and a barrier.
//
// fp8 e4m3 pairs: fp8x2_to<T>(two) widens two e4m3 bytes (low byte -> low
//   half) to a packed f16x2 or bf16x2. Exact: every e4m3 value, subnormals
//   included, is an f16 and a bf16 value; the NaN bytes 0x7f/0xff give NaN.
//   sm_89+: the hardware cvt.rn.f16x2.e4m3x2 (then f16 -> f32 -> bf16 for
//   bf16, all exact). Below sm_89 and on the host: the portable bit path
//   (fp8x2_portable: the bits placed into a wider-biased 16-bit float, one
//   packed multiply by a power of two; exact for normals and subnormals).
//
// ex2_approx_ftz(x): 2^x by the special-function unit (ex2.approx.ftz.f32):
//   one MUFU, relative error at most 2^-22 (PTX ISA), with subnormal inputs
//   read as zero and subnormal results flushed to zero (so 2^x = 0 for
//   x < -126, and 2^(-inf) = 0). exp2f without --use_fast_math is the
//   denormal-safe expansion around the same MUFU (about 10 instructions);
//   softmax weights never need gradual underflow: a weight below 2^-126 of
//   the row's largest is zero either way once rounded to bf16/fp16 P.
//
// byte_perm(x, y, s): PRMT (default mode): result byte i = byte (s >> 4i) & 7
//   of the 8-byte value y:x (x bytes 0-3, y bytes 4-7). One instruction.
//
// fp8 e4m3 quads after ldmatrix: an fp8 tile moved by ldmatrix (.b16: each
//   "element" is two adjacent bytes) hands each lane 4 bytes per matrix:
//     plain  ldmatrix over rows of K (keys x dims, D bytes a row): r = K[key g][4q .. 4q+3]
//            of the matrix's 16-dim slab. fp8x4_to<T>(r, out): out[0] = (byte 0, byte 1),
//            out[1] = (byte 2, byte 3) as T pairs. With the mma's k index read as
//            k 2q, 2q+1 -> dims 4q, 4q+1 and k 2q+8, 2q+9 -> dims 4q+2, 4q+3, out is
//            K^T's B fragment; the A fragment of Q must use the same dim order.
//     .trans ldmatrix over rows of V: r = (V[key 2q][2g, 2g+1], V[key 2q+1][2g, 2g+1]).
//            fp8x4_to_interleaved<T>(r, out): out[0] = (byte 0, byte 2) = V[2q, 2q+1][dim 2g],
//            out[1] = (byte 1, byte 3) = V[2q, 2q+1][dim 2g+1]: the B fragments (k = keys) of
//            two n-tiles, the even and the odd dims of the slab (the output's columns are
//            permuted the same way: the kernel stores them back in order).
//   Both are exact (fp8x2_to) and convert only the lane's own fragment. On sm_89+
//   fp8x4_to<__half> is two hardware cvts fed the register's halves by one
//   unpacking mov (ptxas reads the high half in place: no shift); the host emulation
//   and sm_80 use the generic pair of fp8x2_to, which gives the same values.
//
// Checked by: tests/test_warp_primitives.py (emulation, against torch).
#pragma once

#include "common.cuh"

namespace oasr {
namespace warp {

// A packed pair of 16-bit floats as one 32-bit register.
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);

template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

// The portable e4m3x2 -> f16x2 / bf16x2 (sm_80 and the host): each byte's
// exponent and mantissa bits are placed into a 16-bit float whose exponent
// bias is larger (f16: by 8, bf16: by 120), one packed multiply by 2^8 /
// 2^120 rescales both halves exactly (normals and subnormals alike: every
// result is an f16 / bf16 value), then the signs go back in and the NaN bytes
// (magnitude 0x7f) become 0x7fff, a NaN in both formats.
struct Fp8Pair {
    unsigned sign, mag, nan;
    __device__ __forceinline__ explicit Fp8Pair(unsigned short two) {
        const unsigned w = (two & 0xffu) | ((two & 0xff00u) << 8);  // byte i -> bits 16 i .. 16 i + 7
        sign = (w & 0x00800080u) << 8;
        mag = w & 0x007f007fu;
        nan = (((mag + 0x00010001u) & 0x00800080u) >> 7) * 0x7fffu;  // 0x7fff in a half whose mag is 0x7f
    }
};

template <typename T>
__device__ __forceinline__ unsigned fp8x2_portable(unsigned short two);

template <>
__device__ __forceinline__ unsigned fp8x2_portable<__half>(unsigned short two) {
    const Fp8Pair p(two);
    const unsigned placed = p.mag << 7, two_8 = 0x5c005c00u;  // 2^8 in both halves
    const __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&placed), *reinterpret_cast<const __half2*>(&two_8));
    return *reinterpret_cast<const unsigned*>(&x) | p.sign | p.nan;
}

template <>
__device__ __forceinline__ unsigned fp8x2_portable<__nv_bfloat16>(unsigned short two) {
    const Fp8Pair p(two);
    const unsigned placed = p.mag << 4, two_120 = 0x7b807b80u;  // 2^120 in both halves
    const __nv_bfloat162 x = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&placed),
                                     *reinterpret_cast<const __nv_bfloat162*>(&two_120));
    return *reinterpret_cast<const unsigned*>(&x) | p.sign | p.nan;
}

}  // namespace warp
}  // namespace oasr

#ifdef OASR_HOST_EMULATION
#include "emu/warp_emu.h"
#else

namespace oasr {
namespace warp {

// D = A * B + C, A 16 x 16 and B 16 x 8 of T (__half or __nv_bfloat16), C and D fp32.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                             const float (&c)[4]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                     const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4],
                                                            const unsigned (&b)[2], const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// r[i] = matrix i's fragment; `row` = this lane's row address (see the header).
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(row)));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

// 16 bytes global -> shared (both 16-byte aligned); zeros when !fill (the source is not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool fill) {
    const int src_bytes = fill ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(src_bytes)
                 : "memory");
}

// 4 bytes global -> shared (both 4-byte aligned); zeros when !fill.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool fill) {
    const int src_bytes = fill ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two e4m3 bytes (low byte first) -> packed f16x2 / bf16x2.
template <typename T>
__device__ __forceinline__ unsigned fp8x2_to(unsigned short two);

template <>
__device__ __forceinline__ unsigned fp8x2_to<__half>(unsigned short two) {
#if __CUDA_ARCH__ >= 890
    unsigned out;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(two));
    return out;
#else
    return fp8x2_portable<__half>(two);
#endif
}

template <>
__device__ __forceinline__ unsigned fp8x2_to<__nv_bfloat16>(unsigned short two) {
#if __CUDA_ARCH__ >= 890
    unsigned h2, out;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(two));
    asm("{\n .reg .f16 lo, hi;\n .reg .f32 flo, fhi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 flo, lo;\n"
        " cvt.f32.f16 fhi, hi;\n cvt.rn.bf16x2.f32 %0, fhi, flo;\n}\n"
        : "=r"(out)
        : "r"(h2));
    return out;
#else
    return fp8x2_portable<__nv_bfloat16>(two);
#endif
}


// 2^x on the special-function unit, subnormals flushed (see the header).
__device__ __forceinline__ float ex2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// PRMT, default mode: byte i of the result = byte (s >> 4i) & 7 of y:x.
__device__ __forceinline__ unsigned byte_perm(unsigned x, unsigned y, unsigned s) { return __byte_perm(x, y, s); }

}  // namespace warp
}  // namespace oasr

#endif  // OASR_HOST_EMULATION

namespace oasr {
namespace warp {

// Four e4m3 bytes (a lane's share of an fp8 ldmatrix) -> two packed T pairs: (0, 1) and (2, 3).
template <typename T>
__device__ __forceinline__ void fp8x4_to(unsigned four, unsigned (&out)[2]) {
    out[0] = fp8x2_to<T>(static_cast<unsigned short>(four & 0xffffu));
    out[1] = fp8x2_to<T>(static_cast<unsigned short>(four >> 16));
}

#if !defined(OASR_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// sm_89+, f16: the same two hardware cvts, fed the register's two halves by one unpacking mov, so
// the high half needs no shift first (ptxas reads it as the cvt's .H1 operand). Same values as
// the generic form above (and as its host emulation): only the instruction count differs.
template <>
__device__ __forceinline__ void fp8x4_to<__half>(unsigned four, unsigned (&out)[2]) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n"
        " cvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(out[0]), "=r"(out[1])
        : "r"(four));
}
#endif

// The same, pairing bytes (0, 2) and (1, 3): V's B fragments of the even and odd dims after .trans.
template <typename T>
__device__ __forceinline__ void fp8x4_to_interleaved(unsigned four, unsigned (&out)[2]) {
    fp8x4_to<T>(byte_perm(four, 0u, 0x3120u), out);
}

}  // namespace warp
}  // namespace oasr
