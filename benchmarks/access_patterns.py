"""Which work split lets a pack-like kernel (read 16 B a group, write 4 + 8 B) reach the copy rate?
A development experiment behind benchmarks/NOTES.md (v4): the same arithmetic-free traffic
with a warp per 4096-value chunk (kvzip's split), a block per chunk, and a flat grid-stride loop.

    python benchmarks/access_patterns.py        # 2^28 BF16 values, CUDA events, median of 20
"""
import cupy
import numpy as np

SRC = r"""
typedef unsigned int u32;
__device__ __forceinline__ void pack(const uint4 v, long long g, u32* codes, uint2* rest) {
    codes[g] = v.x ^ v.y ^ v.z ^ v.w;
    rest[g] = make_uint2(v.x + v.y, v.z + v.w);
}
// a warp per chunk of 512 groups, chunks dealt out statically
extern "C" __global__ void warp_chunk(const uint4* in, u32* codes, uint2* rest, long long G) {
    const int lane = threadIdx.x & 31;
    const long long W = (long long)gridDim.x * (blockDim.x / 32);
    for (long long c = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); c * 512 < G; c += W)
        for (int s = 0; s < 512; s += 64) {
            const long long a = c * 512 + s + lane, b = a + 32;
            const uint4 va = in[a], vb = in[b];
            pack(va, a, codes, rest); pack(vb, b, codes, rest);
        }
}
// a block (8 warps) per chunk: warp w takes groups 64w .. 64w + 63
extern "C" __global__ void block_chunk(const uint4* in, u32* codes, uint2* rest, long long G) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (long long c = blockIdx.x; c * 512 < G; c += gridDim.x) {
        const long long a = c * 512 + w * 64 + lane, b = a + 32;
        const uint4 va = in[a], vb = in[b];
        pack(va, a, codes, rest); pack(vb, b, codes, rest);
    }
}
// flat grid-stride, two groups a thread per iteration
extern "C" __global__ void flat(const uint4* in, u32* codes, uint2* rest, long long G) {
    const long long T = (long long)gridDim.x * blockDim.x;
    for (long long a = (long long)blockIdx.x * blockDim.x + threadIdx.x; a < G; a += 2 * T) {
        const long long b = a + T;
        const uint4 va = in[a];
        pack(va, a, codes, rest);
        if (b < G) { const uint4 vb = in[b]; pack(vb, b, codes, rest); }
    }
}
"""


def median_time(k, grid, args, runs=20):
    """Seconds per launch of kernel k on grid blocks of 256 threads: CUDA events, median of runs
    after 3 warm-up launches."""
    for _ in range(3):
        k((grid,), (256,), args)
    times = []
    for _ in range(runs):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        k((grid,), (256,), args)
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) * 1e-3)
    return float(np.median(times))


def print_copy_rate(x):
    """The device-to-device copy of x, the roofline these patterns are measured against."""
    dst = cupy.empty_like(x)
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    cupy.copyto(dst, x)
    a.record()
    cupy.copyto(dst, x)
    b.record()
    b.synchronize()
    t = cupy.cuda.get_elapsed_time(a, b) * 1e-3
    print(f"copy: {t * 1e6:.1f} us, {2 * x.nbytes / t / 1e12:.2f} TB/s")


def main():
    mod = cupy.RawModule(code=SRC)
    n = 1 << 28
    G = n // 8
    x = cupy.random.randint(0, 2**31, size=n // 2, dtype=cupy.uint32).view(cupy.uint16)
    codes = cupy.empty(G, cupy.uint32)
    rest = cupy.empty(2 * G, cupy.uint32)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    moved = x.nbytes + codes.nbytes + rest.nbytes
    for name in ("warp_chunk", "block_chunk", "flat"):
        for blocks_per_sm in (4, 8):
            t = median_time(mod.get_function(name), sms * blocks_per_sm, (x, codes, rest, np.int64(G)))
            print(f"{name:12s} {blocks_per_sm} blocks/SM: {t * 1e6:7.1f} us  {moved / t / 1e12:5.2f} TB/s  "
                  f"({x.nbytes / t / 1e9:6.0f} GB/s of input)")
    print_copy_rate(x)


if __name__ == "__main__":
    main()
