// warp_primitives.cu -- small kernels that drive oasr/kernels_cu/warp_mma.cuh one
// primitive at a time, built only for tests/test_warp_primitives.py (host
// emulation; they would compile with NVRTC too). Each kernel is one warp (or
// one block) and writes what its lanes hold, so the test can compare it with
// torch through the documented layouts. The kernels named *_misuse_* are wrong
// on purpose; the tests require that their results are wrong.
#include "warp_mma.cuh"

namespace oasr_test {

using oasr::warp::cp_async_16;
using oasr::warp::cp_async_commit_group;
using oasr::warp::cp_async_wait_group;

// A 16 x 8 fp32 C/D fragment back to row-major memory (rows g and g + 8, columns 2q, 2q + 1).
__device__ inline void store_d(float* d_out, const float (&d)[4]) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    d_out[g * 8 + 2 * q] = d[0];
    d_out[g * 8 + 2 * q + 1] = d[1];
    d_out[(g + 8) * 8 + 2 * q] = d[2];
    d_out[(g + 8) * 8 + 2 * q + 1] = d[3];
}

// One m16n8k16: A (16 x 16, row-major), B (16 x 8, row-major: B[k][n]) of T,
// C (16 x 8) fp32 in, D (16 x 8) fp32 out. Fragments are built by hand from
// the layout in warp_mma.cuh (no ldmatrix). misuse = 1 swaps a[1] and a[2]
// (rows g + 8 and columns 2q + 8 confused), misuse = 2 transposes the lane
// grid of B (column 2q instead of g).
template <typename T, int misuse>
__global__ void mma_kernel(const unsigned short* a_in, const unsigned short* b_in, const float* c_in, float* d_out) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    auto A = [&](int r, int k) { return static_cast<unsigned>(a_in[r * 16 + k]); };
    auto B = [&](int k, int n) { return static_cast<unsigned>(b_in[k * 8 + n]); };
    unsigned a[4] = {A(g, 2 * q) | A(g, 2 * q + 1) << 16, A(g + 8, 2 * q) | A(g + 8, 2 * q + 1) << 16,
                     A(g, 2 * q + 8) | A(g, 2 * q + 9) << 16, A(g + 8, 2 * q + 8) | A(g + 8, 2 * q + 9) << 16};
    if (misuse == 1) {
        const unsigned t = a[1];
        a[1] = a[2];
        a[2] = t;
    }
    const int n = misuse == 2 ? (lane % 8) : g;
    const int k0 = misuse == 2 ? 2 * (lane / 8) : 2 * q;
    unsigned b[2] = {B(k0, n) | B(k0 + 1, n) << 16, B(k0 + 8, n) | B(k0 + 9, n) << 16};
    float c[4] = {c_in[g * 8 + 2 * q], c_in[g * 8 + 2 * q + 1], c_in[(g + 8) * 8 + 2 * q],
                  c_in[(g + 8) * 8 + 2 * q + 1]};
    float d[4];
    oasr::warp::mma_m16n8k16<T>(d, a, b, c);
    store_d(d_out, d);
}

// X 8 x 8 matrices of 16-bit elements (in: X * 64 values, matrix-major, rows of
// 8) through shared memory; lane l < 8X gives the address of row l % 8 of
// matrix l / 8. out[lane * X + i] = the lane's register i.
template <int X, int trans>
__global__ void ldmatrix_kernel(const unsigned short* in, unsigned* out) {
    __shared__ __align__(16) unsigned short tile[4 * 64];
    const int lane = threadIdx.x % 32;
    for (int i = lane; i < X * 64; i += 32) tile[i] = in[i];
    __syncwarp();
    const unsigned short* row = tile + ((lane / 8) % X) * 64 + (lane % 8) * 8;
    unsigned r[4] = {0, 0, 0, 0};
    if constexpr (X == 2) {
        unsigned r2[2];
        if (trans) {
            oasr::warp::ldmatrix_x2_trans(r2, row);
        } else {
            oasr::warp::ldmatrix_x2(r2, row);
        }
        r[0] = r2[0];
        r[1] = r2[1];
    } else {
        if (trans) {
            oasr::warp::ldmatrix_x4_trans(r, row);
        } else {
            oasr::warp::ldmatrix_x4(r, row);
        }
    }
    for (int i = 0; i < X; ++i) out[lane * X + i] = r[i];
}

// D (16 x 8) = A (16 x 16) B (16 x 8) through shared memory, ldmatrix and one
// mma: A by ldmatrix_x4, B stored transposed (bt[n][k], like K in attention)
// by ldmatrix_x2, or stored as is (b[k][n], like V) by ldmatrix_x2_trans.
// misuse = 1 loads the [k][n] B without .trans (the mistake the attention
// kernel would make with V).
template <typename T, int b_is_kn, int misuse>
__global__ void tile_mma_kernel(const T* a_in, const T* b_in, float* d_out) {
    __shared__ __align__(16) T a[16 * 16];
    __shared__ __align__(16) T b[16 * 8];
    const int lane = threadIdx.x % 32;
    for (int i = lane; i < 256; i += 32) a[i] = a_in[i];
    for (int i = lane; i < 128; i += 32) b[i] = b_in[i];
    __syncwarp();
    unsigned af[4], bf[2];
    oasr::warp::ldmatrix_x4(af, a + (lane % 16) * 16 + (lane / 16) * 8);
    if (b_is_kn) {  // b[k][n]: rows are k; 8 x 8 blocks k 0-7 and k 8-15, transposed
        const T* row = b + (lane % 16) * 8;
        if (misuse == 1) {
            oasr::warp::ldmatrix_x2(bf, row);
        } else {
            oasr::warp::ldmatrix_x2_trans(bf, row);
        }
    } else {  // b[n][k]: rows are n; blocks k 0-7 and k 8-15 of the same 8 rows
        oasr::warp::ldmatrix_x2(bf, b + (lane % 8) * 16 + ((lane / 8) % 2) * 8);
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    oasr::warp::mma_m16n8k16<T>(d, af, bf, d);
    store_d(d_out, d);
}

// cp.async groups. Each thread owns 5 shared slots of 16 bytes, first set to
// the byte 0xAB, then copies src chunks into them: group 0 = slot 0, group 1 =
// slot 1 and (zero-filled, fill = false) slot 2, group 2 = slot 3 and two
// 4-byte copies into slot 4 (bytes 0-3 from src, bytes 4-7 zero-filled; 8-15
// untouched). After wait_group<2>, <1>, <0> (step 0, 1, 2) it snapshots its
// slots into out[step][thread][slot] (16 bytes each). pattern = 1
// interleaves: commits groups 0 and 1, waits <1>, then issues and commits
// group 2 before the next waits. misuse = 1 skips the waits and reads after
// a __syncthreads only.
template <int pattern, int misuse>
__global__ void cp_async_kernel(const unsigned char* src, unsigned char* out) {
    constexpr int S = 5;
    __shared__ __align__(16) unsigned char slots[128][S][16];
    const int t = threadIdx.x, n = blockDim.x;
    for (int s = 0; s < S; ++s)
        for (int i = 0; i < 16; ++i) slots[t][s][i] = 0xAB;
    auto snapshot = [&](int step) {
        for (int s = 0; s < S; ++s)
            for (int i = 0; i < 16; ++i) out[((step * n + t) * S + s) * 16 + i] = slots[t][s][i];
    };
    auto chunk = [&](int s) { return src + (t * S + s) * 16; };
    auto group2 = [&] {
        cp_async_16(slots[t][3], chunk(3), true);
        oasr::warp::cp_async_4(slots[t][4], chunk(4), true);
        oasr::warp::cp_async_4(slots[t][4] + 4, chunk(4) + 4, false);
        cp_async_commit_group();
    };
    cp_async_16(slots[t][0], chunk(0), true);
    cp_async_commit_group();
    cp_async_16(slots[t][1], chunk(1), true);
    cp_async_16(slots[t][2], chunk(2), false);
    cp_async_commit_group();
    if (pattern == 0) group2();
    if (misuse) {
        __syncthreads();
        snapshot(0);
        snapshot(1);
        snapshot(2);
        return;
    }
    if (pattern == 0) {
        cp_async_wait_group<2>();
        snapshot(0);
        cp_async_wait_group<1>();
        snapshot(1);
    } else {
        cp_async_wait_group<1>();
        snapshot(0);
        group2();
        cp_async_wait_group<1>();
        snapshot(1);
    }
    cp_async_wait_group<0>();
    snapshot(2);
}

// Every pair of e4m3 bytes: in[i] is a 16-bit pair (low byte first), out[i] its packed f16x2 / bf16x2.
template <typename T>
__global__ void fp8x2_kernel(const unsigned short* in, unsigned* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = oasr::warp::fp8x2_to<T>(in[i]);
}

// ex2.approx.ftz on n inputs. misuse = 1 computes 2^x as 2^(x - 100) * 2^100, a kernel that relies
// on gradual underflow (the intermediate is subnormal for x < -26): the flush makes it 0.
template <int misuse>
__global__ void ex2_kernel(const float* in, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = misuse ? oasr::warp::ex2_approx_ftz(in[i] - 100.f) * 0x1p100f : oasr::warp::ex2_approx_ftz(in[i]);
}

// out[i] = byte_perm(x[i], y[i], s[i]) (a template only because the test launcher names instantiations).
template <int unused>
__global__ void byte_perm_kernel(const unsigned* x, const unsigned* y, const unsigned* s, unsigned* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = oasr::warp::byte_perm(x[i], y[i], s[i]);
}

// fp8x4_to<T> (interleaved = 0) or fp8x4_to_interleaved<T> (1) on n words: out[2i], out[2i + 1].
template <typename T, int interleaved>
__global__ void fp8x4_kernel(const unsigned* in, unsigned* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned r[2];
    if (interleaved) {
        oasr::warp::fp8x4_to_interleaved<T>(in[i], r);
    } else {
        oasr::warp::fp8x4_to<T>(in[i], r);
    }
    out[2 * i] = r[0];
    out[2 * i + 1] = r[1];
}

// The fp8 K path of attention v3: S (16 x 16 fp32) = Q (16 x 32, T) K^T, K 16 keys x 32 e4m3 bytes held
// in shared memory (rows padded to 48 bytes), one ldmatrix_x4 (matrices: keys 0-7 / 8-15 x dims 0-15 /
// 16-31), each lane's 4 bytes widened by fp8x4_to, Q's A fragments loaded in the matching dim order
// (k 2q, 2q+1 <- dims 4q, 4q+1; k 2q+8, 2q+9 <- dims 4q+2, 4q+3). misuse = 1 widens with the
// interleaved pairing (V's), which puts the wrong dims under Q.
template <typename T, int misuse>
__global__ void fp8_k_tile_kernel(const T* q, const unsigned char* k, float* s_out) {
    __shared__ __align__(16) unsigned char tile[16 * 48];
    const int lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
    for (int i = lane; i < 16 * 32; i += 32) tile[(i / 32) * 48 + i % 32] = k[i];
    __syncwarp();
    unsigned qf[2][4];
    for (int kk = 0; kk < 2; ++kk)
        for (int h = 0; h < 2; ++h) {
            const T* row = q + (g + 8 * h) * 32 + kk * 16 + 4 * qd;
            qf[kk][h] = *reinterpret_cast<const unsigned*>(row);
            qf[kk][2 + h] = *reinterpret_cast<const unsigned*>(row + 2);
        }
    unsigned kf[4];
    oasr::warp::ldmatrix_x4(kf, tile + (((lane / 8) % 2) * 8 + lane % 8) * 48 + (lane / 16) * 16);
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (int i = 0; i < 4; ++i) {
        unsigned b[2];
        if (misuse) {
            oasr::warp::fp8x4_to_interleaved<T>(kf[i], b);
        } else {
            oasr::warp::fp8x4_to<T>(kf[i], b);
        }
        oasr::warp::mma_m16n8k16<T>(sc[i % 2], qf[i / 2], b, sc[i % 2]);
    }
    for (int n = 0; n < 2; ++n)
        for (int e = 0; e < 4; ++e) s_out[(g + 8 * (e / 2)) * 16 + 8 * n + 2 * qd + e % 2] = sc[n][e];
}

// The fp8 V path of attention v3: O (16 x 32 fp32) = P (16 x 16 keys, bf16) V, V 16 keys x 32 e4m3
// bytes in shared memory, one ldmatrix_x4_trans, fp8x4_to_interleaved giving the B fragments of the
// even and the odd dims of each 16-dim slab; O is stored back in dim order. misuse = 1 widens with
// the plain pairing (K's), which mixes two keys' dims into one column.
template <int misuse>
__global__ void fp8_v_tile_kernel(const __nv_bfloat16* p, const unsigned char* v, float* o_out) {
    using BF = __nv_bfloat16;
    __shared__ __align__(16) unsigned char tile[16 * 48];
    const int lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
    for (int i = lane; i < 16 * 32; i += 32) tile[(i / 32) * 48 + i % 32] = v[i];
    __syncwarp();
    auto P = [&](int r, int c) { return *reinterpret_cast<const unsigned*>(p + r * 16 + c); };
    const unsigned a[4] = {P(g, 2 * qd), P(g + 8, 2 * qd), P(g, 8 + 2 * qd), P(g + 8, 8 + 2 * qd)};
    unsigned vf[4];
    oasr::warp::ldmatrix_x4_trans(vf, tile + (((lane / 8) % 2) * 8 + lane % 8) * 48 + (lane / 16) * 16);
    float o[4][4] = {};
    for (int sl = 0; sl < 2; ++sl) {
        unsigned lo_keys[2], hi_keys[2];
        if (misuse) {
            oasr::warp::fp8x4_to<BF>(vf[2 * sl], lo_keys);
            oasr::warp::fp8x4_to<BF>(vf[2 * sl + 1], hi_keys);
        } else {
            oasr::warp::fp8x4_to_interleaved<BF>(vf[2 * sl], lo_keys);
            oasr::warp::fp8x4_to_interleaved<BF>(vf[2 * sl + 1], hi_keys);
        }
        const unsigned even[2] = {lo_keys[0], hi_keys[0]}, odd[2] = {lo_keys[1], hi_keys[1]};
        oasr::warp::mma_m16n8k16<BF>(o[2 * sl], a, even, o[2 * sl]);
        oasr::warp::mma_m16n8k16<BF>(o[2 * sl + 1], a, odd, o[2 * sl + 1]);
    }
    for (int sl = 0; sl < 2; ++sl)
        for (int h = 0; h < 2; ++h) {
            float* row = o_out + (g + 8 * h) * 32 + 16 * sl + 4 * qd;
            row[0] = o[2 * sl][2 * h];
            row[1] = o[2 * sl + 1][2 * h];
            row[2] = o[2 * sl][2 * h + 1];
            row[3] = o[2 * sl + 1][2 * h + 1];
        }
}

}  // namespace oasr_test
