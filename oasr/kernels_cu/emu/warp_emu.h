// warp_emu.h -- the host emulation of warp_mma.cuh's primitives (included by
// warp_mma.cuh when OASR_HOST_EMULATION is defined; same names, same
// signatures). Faithful to the PTX ISA's contracts, not merely "a layout that
// works":
//
//   mma_m16n8k16, ldmatrix_*   warp-collective. Every lane deposits what it
//       holds (its a/b registers, or its row address) in the warp's fragment
//       buffer, the warp meets at its barrier, and each lane then computes
//       exactly the elements the PTX ISA assigns to it from the other lanes'
//       deposits (the layouts are drawn in warp_mma.cuh). A kernel that puts
//       the wrong element in a register, or asks for the wrong one back, gets
//       wrong numbers, as on hardware. All 32 lanes must take part (as
//       .sync.aligned requires). Two buffers alternate, so one barrier per
//       call suffices (the same argument as the shuffles in simt_emu.h).
//       mma multiplies exactly (a product of two 16-bit floats fits fp32) and
//       adds in fp32 in k order onto c; the hardware's internal order and
//       rounding are not specified, so tests compare with a tolerance.
//   cp_async_16, cp_async_4 / commit_group / wait_group<N>   deferred. A copy is queued on
//       the issuing thread and performed, source read and destination written,
//       only when that thread's wait_group retires its group. Until then shared
//       memory holds its old bytes: a kernel that reads before waiting (or
//       before the barrier after the wait) reads stale data and fails.
//       Copies never committed are never performed; the queue is dropped at
//       the end of each block.
//   ex2_approx_ftz   flushes like the hardware: a subnormal input is read as
//       (signed) zero, a result below 2^-126 is +0; otherwise std::exp2 in fp32
//       (within the hardware's 2^-22 relative error, not bit-equal to it).
//   byte_perm     PRMT's default mode, byte by byte; a selector nibble with its
//       sign-replicate bit (8) set is refused (abort): the kernels never use that mode.
//   fp8x2_to<T>   the portable bit path of warp_mma.cuh (the sm_80 device
//       path); the sm_89+ hardware cvt is specified to give the same values.
#pragma once

#ifndef OASR_HOST_EMULATION
#error "warp_emu.h is for the host emulation build only"
#endif

#include <cstdlib>

namespace oasr {
namespace warp {

namespace detail {

inline float half_bits_to_float(unsigned bits16, bool bf16) {
    if (bf16) return std::bit_cast<float>(bits16 << 16);
    __half_raw raw;
    raw.x = static_cast<unsigned short>(bits16);
    return __half2float(__half(raw));
}

inline float element(unsigned long long reg, int which, bool bf16) {
    return half_bits_to_float(static_cast<unsigned>(reg >> (16 * which)) & 0xffffu, bf16);
}

// Deposit up to 6 values, meet the warp, return the warp's deposits (valid until the next call).
inline const unsigned long long (*deposit(const unsigned long long* mine, int n))[6] {
    auto& st = oasr_emu::this_thread_state;
    auto& w = *st.warp;
    for (int i = 0; i < n; ++i) w.fragments[st.fragment_phase][st.lane][i] = mine[i];
    w.bar.arrive_and_wait();
    const auto* all = w.fragments[st.fragment_phase];
    st.fragment_phase ^= 1u;
    return all;
}

template <int X, bool Trans>
inline void ldmatrix(unsigned* r, const void* row) {
    const unsigned long long address = reinterpret_cast<unsigned long long>(row);
    const auto* all = deposit(&address, 1);
    const unsigned lane = oasr_emu::this_thread_state.lane;
    const unsigned g = lane / 4, q = lane % 4;
    for (int i = 0; i < X; ++i) {
        unsigned short lo, hi;
        if (!Trans) {  // M_i[g][2q], M_i[g][2q + 1]
            const auto* p = reinterpret_cast<const unsigned short*>(all[8 * i + g][0]);
            lo = p[2 * q];
            hi = p[2 * q + 1];
        } else {  // M_i[2q][g], M_i[2q + 1][g]
            lo = reinterpret_cast<const unsigned short*>(all[8 * i + 2 * q][0])[g];
            hi = reinterpret_cast<const unsigned short*>(all[8 * i + 2 * q + 1][0])[g];
        }
        r[i] = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
    }
}

}  // namespace detail

template <typename T>
inline void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
    static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "mma takes f16 or bf16");
    constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
    const unsigned long long mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    const auto* all = detail::deposit(mine, 6);
    const unsigned lane = oasr_emu::this_thread_state.lane;
    const unsigned g = lane / 4, q = lane % 4;
    // A[r][k] lives in lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2.
    auto A = [&](unsigned r, unsigned k) {
        return detail::element(all[4 * (r % 8) + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)], k % 2, bf16);
    };
    // B[k][n] lives in lane 4 n + (k % 8) / 2, register 4 + (k >= 8), half k % 2.
    auto B = [&](unsigned k, unsigned n) {
        return detail::element(all[4 * n + (k % 8) / 2][4 + (k >= 8)], k % 2, bf16);
    };
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const unsigned row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i % 2);
        float acc = c[i];
        for (unsigned k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
        out[i] = acc;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];  // d may alias c
}

inline void ldmatrix_x2(unsigned (&r)[2], const void* row) { detail::ldmatrix<2, false>(r, row); }
inline void ldmatrix_x4(unsigned (&r)[4], const void* row) { detail::ldmatrix<4, false>(r, row); }
inline void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) { detail::ldmatrix<2, true>(r, row); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) { detail::ldmatrix<4, true>(r, row); }

inline void cp_async_16(void* smem, const void* gmem, bool fill) {
    oasr_emu::this_thread_state.async_copies.push_back({smem, fill ? gmem : nullptr, 16});
}

inline void cp_async_4(void* smem, const void* gmem, bool fill) {
    oasr_emu::this_thread_state.async_copies.push_back({smem, fill ? gmem : nullptr, 4});
}

inline void cp_async_commit_group() {
    auto& st = oasr_emu::this_thread_state;
    std::size_t committed = 0;
    for (std::size_t n : st.async_groups) committed += n;
    st.async_groups.push_back(st.async_copies.size() - committed);
}

template <int N>
inline void cp_async_wait_group() {
    static_assert(N >= 0, "wait_group takes a non-negative count");
    auto& st = oasr_emu::this_thread_state;
    if (st.async_groups.size() <= static_cast<std::size_t>(N)) return;
    const std::size_t retire = st.async_groups.size() - N;  // the oldest groups
    std::size_t copies = 0;
    for (std::size_t i = 0; i < retire; ++i) copies += st.async_groups[i];
    for (std::size_t i = 0; i < copies; ++i) {
        const auto& c = st.async_copies[i];
        if (c.src) {
            std::memcpy(c.dst, c.src, c.bytes);
        } else {
            std::memset(c.dst, 0, c.bytes);
        }
    }
    st.async_copies.erase(st.async_copies.begin(), st.async_copies.begin() + static_cast<std::ptrdiff_t>(copies));
    st.async_groups.erase(st.async_groups.begin(), st.async_groups.begin() + static_cast<std::ptrdiff_t>(retire));
}

inline float ex2_approx_ftz(float x) {
    if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.f, x);  // .ftz: subnormal inputs read as 0
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;  // .ftz: subnormal results flush to +0
}

inline unsigned byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long xy = (static_cast<unsigned long long>(y) << 32) | x;
    unsigned out = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (s >> (4 * i)) & 0xfu;
        if (sel & 8u) std::abort();  // sign-replicate mode: not emulated, not used
        out |= static_cast<unsigned>((xy >> (8 * sel)) & 0xffu) << (8 * i);
    }
    return out;
}

template <typename T>
inline unsigned fp8x2_to(unsigned short two) {
    return fp8x2_portable<T>(two);
}

}  // namespace warp
}  // namespace oasr
