// simt_emu.h -- run oasr's CUDA kernels on the CPU, for tests that have no GPU.
//
// The kernels in kernels_cu/ are plain CUDA C++. When OASR_HOST_EMULATION is
// defined, common.cuh includes this header instead of relying on nvcc/NVRTC,
// and g++ (C++20) compiles the *same* kernel source as host code. The header
// supplies the CUDA built-ins the kernels use, with these semantics:
//
//   launch      oasr_emu::launch(grid, block, body) runs the grid's blocks one
//               after another, in blockIdx order x, then y, then z. The threads
//               of a block are real std::threads (one pool per launch, reused
//               for every block); each thread runs body() with its own
//               threadIdx/blockIdx (thread_local) and then waits at the block's
//               barrier, so no thread starts block n+1 before all finished n.
//               One launch runs at a time per shared library (a mutex).
//   __shared__  `static`: one copy per kernel instantiation, shared by all the
//               threads of the running block. Since blocks run one at a time,
//               that is per-block storage. It is NOT cleared between blocks,
//               so a kernel that reads shared memory it did not write in the
//               same block reads the previous block's values, not garbage.
//   __syncthreads()  a std::barrier over the block's threads.
//   __syncwarp(), __shfl_*_sync()  a std::barrier over the 32 threads of the
//               warp (fewer in a partial last warp). A shuffle writes its value
//               into a per-warp exchange buffer, waits at the warp barrier and
//               reads its source lane's slot; two buffers alternate, so one
//               barrier per shuffle suffices. The `mask` argument is ignored:
//               every lane of the warp must take part (the kernels only shuffle
//               in converged code). `width` is honoured for xor/down/idx.
//   mma, ldmatrix, cp.async   emu/warp_emu.h (included through warp_mma.cuh):
//               warp-collective fragment exchange through a second per-warp
//               buffer (`fragments`); cp.async copies queued per thread
//               (ThreadState::async_copies) and performed at wait_group.
//   types       __half, __nv_bfloat16 and __nv_fp8_e4m3/e5m2 come from the CUDA
//               toolkit's headers, which compile as host code under g++ and
//               round like the device does. dim3/uint3/float4/uint4 come from
//               vector_types.h. Math (expf, exp2f, fmaxf, ...) is <cmath>.
//
// What emulation cannot show: timing and occupancy; register or shared-memory
// limits (the compile report covers those); races between warps that a real
// GPU could schedule differently (threads here interleave as the OS pleases,
// which finds some races but proves nothing); reads of shared memory left over
// from another block (see __shared__); out-of-bounds global accesses (no
// sanitizer; the tests poison pools so stray reads show up as NaN); warp-
// synchronous code without __syncwarp (lanes here are not in lockstep, so such
// code fails here, which is the intended strictness). Kernels must not return
// early from some threads of a block and reach a barrier in others: that
// deadlocks here (and is undefined on a GPU).

#pragma once

#ifndef OASR_HOST_EMULATION
#error "simt_emu.h is for the host emulation build only (define OASR_HOST_EMULATION)"
#endif

#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <vector_types.h>  // uint3, dim3, float2/4, uint2/4 (host definitions)
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

// -- execution-space keywords --------------------------------------------------
// crt/host_defines.h maps __global__/__device__/__host__ to nothing for a host
// compiler; __shared__ becomes function-scope static storage (see above).
#undef __shared__
#define __shared__ static
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __restrict__
#define __restrict__ __restrict
#endif

namespace oasr_emu {

constexpr unsigned kWarpSize = 32;

struct Warp {
    explicit Warp(unsigned lanes) : lanes(lanes), bar(static_cast<std::ptrdiff_t>(lanes)) {}
    unsigned lanes;  // threads in this warp (32 except a partial last warp)
    std::barrier<> bar;
    alignas(64) unsigned long long exchange[2][kWarpSize] = {};
    // Fragment exchange of the warp-collective primitives (emu/warp_emu.h):
    // per lane up to 6 registers (mma's a[4], b[2]) or one address (ldmatrix).
    alignas(64) unsigned long long fragments[2][kWarpSize][6] = {};
};

struct Block {
    Block(unsigned nthreads) : bar(static_cast<std::ptrdiff_t>(nthreads)) {
        for (unsigned first = 0; first < nthreads; first += kWarpSize) {
            unsigned lanes = nthreads - first < kWarpSize ? nthreads - first : kWarpSize;
            warps.push_back(std::make_unique<Warp>(lanes));
        }
    }
    std::barrier<> bar;
    std::vector<std::unique_ptr<Warp>> warps;
};

struct ThreadState {
    Block* block = nullptr;
    Warp* warp = nullptr;
    unsigned lane = 0;
    unsigned phase = 0;  // which exchange buffer the next shuffle uses
    unsigned fragment_phase = 0;  // which fragment buffer the next mma / ldmatrix uses
    // cp.async (emu/warp_emu.h): this thread's queued copies, in issue order, and
    // how many of them each committed group holds (oldest first). Dropped at the
    // end of every block: a copy never lands in another block's shared memory.
    struct AsyncCopy {
        void* dst;
        const void* src;  // null: fill with zeros
        unsigned bytes;
    };
    std::vector<AsyncCopy> async_copies;
    std::vector<std::size_t> async_groups;
};

inline thread_local ThreadState this_thread_state;

inline std::mutex& launch_mutex() {
    static std::mutex m;
    return m;
}

}  // namespace oasr_emu

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

inline void __syncthreads() { oasr_emu::this_thread_state.block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) { oasr_emu::this_thread_state.warp->bar.arrive_and_wait(); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

namespace oasr_emu {

// One shuffle: publish `value`, wait for the warp, read lane `src` (or keep
// our own value when `src` is outside the warp / the segment, as CUDA does).
template <typename T>
inline T exchange(T value, int src, bool keep_own) {
    static_assert(sizeof(T) <= sizeof(unsigned long long) && std::is_trivially_copyable_v<T>);
    ThreadState& st = this_thread_state;
    Warp& w = *st.warp;
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    w.exchange[st.phase][st.lane] = bits;
    w.bar.arrive_and_wait();
    T out = value;
    if (!keep_own && src >= 0 && static_cast<unsigned>(src) < w.lanes) {
        std::memcpy(&out, &w.exchange[st.phase][src], sizeof(T));
    }
    st.phase ^= 1u;
    return out;
}

}  // namespace oasr_emu

template <typename T>
inline T __shfl_sync(unsigned /*mask*/, T value, int src_lane, int width = warpSize) {
    int lane = static_cast<int>(oasr_emu::this_thread_state.lane);
    int base = lane & ~(width - 1);
    return oasr_emu::exchange(value, base + (src_lane & (width - 1)), false);
}

template <typename T>
inline T __shfl_xor_sync(unsigned /*mask*/, T value, int lane_mask, int width = warpSize) {
    int lane = static_cast<int>(oasr_emu::this_thread_state.lane);
    int src = lane ^ lane_mask;
    bool outside = (src & ~(width - 1)) != (lane & ~(width - 1));
    return oasr_emu::exchange(value, src, outside);
}

template <typename T>
inline T __shfl_down_sync(unsigned /*mask*/, T value, unsigned delta, int width = warpSize) {
    int lane = static_cast<int>(oasr_emu::this_thread_state.lane);
    int src = lane + static_cast<int>(delta);
    bool outside = (src & ~(width - 1)) != (lane & ~(width - 1));
    return oasr_emu::exchange(value, src, outside);
}

template <typename T>
inline T __ldg(const T* p) { return *p; }

inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __int_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }

namespace oasr_emu {

// Run `body` (a callable that invokes the kernel with its arguments) over the
// grid. See the header comment for the execution model.
template <typename Body>
void launch(dim3 grid, dim3 block, Body&& body) {
    std::lock_guard<std::mutex> serial(launch_mutex());
    const unsigned nthreads = block.x * block.y * block.z;
    if (nthreads == 0 || grid.x * grid.y * grid.z == 0) return;
    Block state(nthreads);
    auto worker = [&](unsigned tid) {
        ThreadState& st = this_thread_state;
        st.block = &state;
        st.warp = state.warps[tid / kWarpSize].get();
        st.lane = tid % kWarpSize;
        st.phase = 0;
        st.fragment_phase = 0;
        threadIdx = uint3{tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)};
        blockDim = block;
        gridDim = grid;
        for (unsigned z = 0; z < grid.z; ++z)
            for (unsigned y = 0; y < grid.y; ++y)
                for (unsigned x = 0; x < grid.x; ++x) {
                    blockIdx = uint3{x, y, z};
                    body();
                    st.async_copies.clear();
                    st.async_groups.clear();
                    state.bar.arrive_and_wait();  // block done: the next may reuse __shared__
                }
        st = ThreadState{};
    };
    std::vector<std::thread> pool;
    pool.reserve(nthreads - 1);
    for (unsigned tid = 1; tid < nthreads; ++tid) pool.emplace_back(worker, tid);
    worker(0);
    for (auto& t : pool) t.join();
}

// Cast the launcher's untyped arguments (pointers arrive as void*, scalars as
// themselves) to the kernel's parameter types and call it.
template <typename P, typename A>
inline P arg_cast(A a) {
    if constexpr (std::is_pointer_v<P>) {
        return static_cast<P>(const_cast<void*>(static_cast<const void*>(a)));
    } else {
        return static_cast<P>(a);
    }
}

// The launcher declares each argument from the registry's kind (ptr: const void*, i32: int,
// f32: float). A kernel parameter must be exactly that type (any pointer for ptr): a GPU launch
// packs the arguments by kind, so a kernel taking, say, long long or double where the registry
// says i32 or f32 would read a wrong value and shift every later argument. arg_cast would hide
// that here, so the build refuses it instead (checked by tests/test_kernel_launch.py).
template <typename P, typename A>
struct KindMatches {
    static constexpr bool value =
        std::is_pointer_v<A> ? std::is_pointer_v<P> : (!std::is_pointer_v<P> && std::is_same_v<P, A>);
    static_assert(value,
                  "oasr_emu::invoke: a kernel parameter's C++ type P differs from the registry's kind of "
                  "the launcher's argument A (ptr: any pointer, i32: int, f32: float); fix the kernel or "
                  "oasr/fast/kernels/registry.py");
};

template <typename... P, typename... A>
inline void invoke(void (*kernel)(P...), A... args) {
    static_assert(sizeof...(P) == sizeof...(A), "launcher passes the wrong number of kernel arguments");
    static_assert((KindMatches<P, A>::value && ...), "kernel parameter types differ from the registry's kinds");
    kernel(arg_cast<P>(args)...);
}

}  // namespace oasr_emu
