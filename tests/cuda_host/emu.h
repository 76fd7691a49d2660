// Just enough of CUDA to run a kernel source on the host, for tests: every GPU thread of a block is
// a std::thread, blocks run one after another (so static variables stand for __shared__ memory),
// and each warp intrinsic is a rendezvous of the warp's 32 threads.  Kernels must call warp
// intrinsics with the full mask and in convergent code, as kvzip's kernels do.
#pragma once

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __noinline__
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__
#define __align__(x) __attribute__((aligned(x)))  // GNU's may stand between decl-specifiers, as CUDA's does
#define __builtin_assume(x) ((void)0)
#define __isGlobal(p) true

struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
struct dim3 { unsigned x = 1, y = 1, z = 1; };

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline unsigned char emu_dynamic_shared[256 * 1024];

struct EmuWarp {
    std::barrier<> bar{32};
    unsigned long long v[32];
};
struct EmuBlock {
    std::barrier<> bar;
    std::atomic<int> count{0};
    explicit EmuBlock(int threads) : bar(threads) {}
};
inline thread_local EmuWarp* emu_warp;
inline thread_local EmuBlock* emu_block;

inline int emu_lane() { return threadIdx.x & 31; }
// every lane's x, after the warp has met
template <typename T>
inline void emu_gather(T x, T out[32]) {
    emu_warp->v[emu_lane()] = (unsigned long long)x;
    emu_warp->bar.arrive_and_wait();
    for (int i = 0; i < 32; i++) out[i] = (T)emu_warp->v[i];
    emu_warp->bar.arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp->bar.arrive_and_wait(); }
inline void __syncthreads() { emu_block->bar.arrive_and_wait(); }
inline int __syncthreads_count(int p) {
    __syncthreads();
    if (p) emu_block->count++;
    __syncthreads();
    const int c = emu_block->count.load();
    __syncthreads();
    if (threadIdx.x == 0) emu_block->count = 0;
    __syncthreads();
    return c;
}
inline int __syncthreads_and(int p) { return __syncthreads_count(p != 0) == (int)blockDim.x; }
inline int __syncthreads_or(int p) { return __syncthreads_count(p != 0) != 0; }
template <typename T>
inline T __shfl_sync(unsigned, T x, int src) { T a[32]; emu_gather(x, a); return a[src & 31]; }
template <typename T>
inline T __shfl_up_sync(unsigned, T x, int d) { T a[32]; emu_gather(x, a); return emu_lane() >= d ? a[emu_lane() - d] : x; }
template <typename T>
inline T __shfl_down_sync(unsigned, T x, int d) { T a[32]; emu_gather(x, a); return emu_lane() + d < 32 ? a[emu_lane() + d] : x; }
template <typename T>
inline T __shfl_xor_sync(unsigned, T x, int m) { T a[32]; emu_gather(x, a); return a[(emu_lane() ^ m) & 31]; }
inline unsigned __ballot_sync(unsigned, int p) {
    int a[32];
    emu_gather(p ? 1 : 0, a);
    unsigned m = 0;
    for (int i = 0; i < 32; i++) m |= (unsigned)(a[i] != 0) << i;
    return m;
}
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }
inline unsigned __match_any_sync(unsigned, unsigned x) {
    unsigned a[32];
    emu_gather(x, a);
    unsigned m = 0;
    for (int i = 0; i < 32; i++) m |= (unsigned)(a[i] == x) << i;
    return m;
}
inline unsigned __reduce_max_sync(unsigned, unsigned x) {
    unsigned a[32];
    emu_gather(x, a);
    unsigned m = 0;
    for (int i = 0; i < 32; i++) m = a[i] > m ? a[i] : m;
    return m;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { __threadfence(); }
inline void __nanosleep(unsigned) {}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
// PRMT's default mode: selector nibble k picks byte (nibble & 7) of y:x, and with its bit 3 set
// that byte's sign bit replicated (0x00 or 0xFF).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long b = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int k = 0; k < 4; k++) {
        const unsigned nib = (s >> (4 * k)) & 15, byte = (unsigned)(b >> (8 * (nib & 7))) & 0xFF;
        r |= (nib & 8 ? (byte & 0x80 ? 0xFFu : 0u) : byte) << (8 * k);
    }
    return r;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (s & 31));
}
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
inline unsigned long long __cvta_generic_to_shared(const void* p) { return (unsigned long long)p; }
inline unsigned __vmaxu2(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int k = 0; k < 32; k += 16) { const unsigned x = (a >> k) & 0xFFFF, y = (b >> k) & 0xFFFF; r |= (x > y ? x : y) << k; }
    return r;
}
inline unsigned __vcmpltu2(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int k = 0; k < 32; k += 16) r |= (((a >> k) & 0xFFFF) < ((b >> k) & 0xFFFF) ? 0xFFFFu : 0u) << k;
    return r;
}
template <typename T>
inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <typename T>
inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <typename T>
inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
template <typename T>
inline T atomicCAS(T* p, T expect, T v) { __atomic_compare_exchange_n(p, &expect, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); return expect; }
// CUDA's: the old value; the new one old + 1, or 0 where old >= limit
inline unsigned atomicInc(unsigned* p, unsigned limit) {
    unsigned old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (!__atomic_compare_exchange_n(p, &old, old >= limit ? 0u : old + 1u, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <typename T>
inline T atomicMin(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <typename T>
inline T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v > old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <typename T, typename U> inline T min(T a, U b) { return a < (T)b ? a : (T)b; }
template <typename T, typename U> inline T max(T a, U b) { return a > (T)b ? a : (T)b; }

// grid blocks of `threads` threads, one block after another, each thread running body().
inline void emu_launch(int grid, int threads, const std::function<void()>& body) {
    gridDim.x = grid;
    blockDim.x = threads;
    for (int b = 0; b < grid; b++) {
        EmuBlock block(threads);
        std::vector<std::unique_ptr<EmuWarp>> warps;
        for (int w = 0; w < threads / 32; w++) warps.push_back(std::make_unique<EmuWarp>());
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; t++)
            ts.emplace_back([&, t] {
                threadIdx.x = t;
                blockIdx.x = b;
                emu_warp = warps[t / 32].get();
                emu_block = &block;
                body();
            });
        for (auto& t : ts) t.join();
    }
}
