"""Which lane-to-group mapping lets an E5M2-like pass (read 8 B a group, write 4 + 3 B; decode the
mirror) reach the copy rate?  A development experiment behind benchmarks/NOTES.md (v17), the FP8
twin of access_patterns.py: arithmetic-free traffic in kvzip's split (a warp per 4096-value chunk,
steps of GPL groups a lane), with

- group: a lane per 8-value group (kvz_encode / kvz_decode up to v16): 8-byte loads, 4-byte code
  stores, rest as 24 words a warp (shuffles) on encode and three byte loads on decode;
- quad: a lane per 4 consecutive groups: two 16-byte loads, one 16-byte code store, the 12 rest
  bytes as three aligned words;
- pf: the same with the next step's loads issued before this step's stores (a register double
  buffer).

    python benchmarks/fp8_patterns.py        # 2^28 E5M2 values, CUDA events, median of 20
"""
import cupy
import numpy as np

from access_patterns import median_time, print_copy_rate  # (run from benchmarks/ as a script)

SRC = r"""
typedef unsigned int u32;
typedef unsigned char u8;
#define FULL 0xffffffffu
#define GPC 512   // groups a chunk

__device__ __forceinline__ void rest24_warp(u8* p, u32 bits, int lane) {
    const int g = (4 * lane) / 3, off = 4 * lane - 3 * g;
    const u32 a = __shfl_sync(FULL, bits, g & 31), b = __shfl_sync(FULL, bits, (g + 1) & 31);
    if (lane < 24) reinterpret_cast<u32*>(p)[lane] = (u32)((((unsigned long long)b << 24) | a) >> (8 * off));
}

// encode, a lane per group, GPL groups a lane a step
template <int GPL>
__global__ void enc_group(const uint2* in, u32* codes, u8* rest, long long chunks) {
    const int lane = threadIdx.x & 31;
    const long long W = (long long)gridDim.x * (blockDim.x / 32);
    for (long long c = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); c < chunks; c += W)
        for (int s = 0; s < GPC; s += 32 * GPL) {
            uint2 v[GPL];
#pragma unroll
            for (int q = 0; q < GPL; q++) v[q] = in[c * GPC + s + q * 32 + lane];
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const long long g = c * GPC + s + q * 32 + lane;
                codes[g] = v[q].x ^ v[q].y;
                rest24_warp(rest + (g - lane) * 3, (v[q].x + v[q].y) & 0xFFFFFFu, lane);
            }
        }
}

// encode, a lane per 4 consecutive groups, GPL quads a lane a step (quads q * 32 + lane)
template <int GPL>
__global__ void enc_quad(const uint4* in, uint4* codes, u32* rest, long long chunks) {
    const int lane = threadIdx.x & 31;
    const long long W = (long long)gridDim.x * (blockDim.x / 32);
    for (long long c = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); c < chunks; c += W)
        for (int s = 0; s < GPC / 4; s += 32 * GPL) {
            uint4 a[GPL], b[GPL];
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const long long u = c * (GPC / 4) + s + q * 32 + lane;
                a[q] = in[2 * u]; b[q] = in[2 * u + 1];
            }
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const long long u = c * (GPC / 4) + s + q * 32 + lane;
                codes[u] = make_uint4(a[q].x ^ a[q].y, a[q].z ^ a[q].w, b[q].x ^ b[q].y, b[q].z ^ b[q].w);
                rest[3 * u] = a[q].x + a[q].y; rest[3 * u + 1] = a[q].z + b[q].x; rest[3 * u + 2] = b[q].y + b[q].z;
            }
        }
}

// enc_quad with the next step's loads in flight while this step stores
template <int GPL>
__global__ void enc_quad_pf(const uint4* in, uint4* codes, u32* rest, long long chunks) {
    const int lane = threadIdx.x & 31;
    const long long W = (long long)gridDim.x * (blockDim.x / 32);
    for (long long c = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); c < chunks; c += W) {
        uint4 a[GPL], b[GPL];
#pragma unroll
        for (int q = 0; q < GPL; q++) {
            const long long u = c * (GPC / 4) + q * 32 + lane;
            a[q] = in[2 * u]; b[q] = in[2 * u + 1];
        }
        for (int s = 0; s < GPC / 4; s += 32 * GPL) {
            uint4 na[GPL], nb[GPL];
            if (s + 32 * GPL < GPC / 4) {
#pragma unroll
                for (int q = 0; q < GPL; q++) {
                    const long long u = c * (GPC / 4) + s + 32 * GPL + q * 32 + lane;
                    na[q] = in[2 * u]; nb[q] = in[2 * u + 1];
                }
            }
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const long long u = c * (GPC / 4) + s + q * 32 + lane;
                codes[u] = make_uint4(a[q].x ^ a[q].y, a[q].z ^ a[q].w, b[q].x ^ b[q].y, b[q].z ^ b[q].w);
                rest[3 * u] = a[q].x + a[q].y; rest[3 * u + 1] = a[q].z + b[q].x; rest[3 * u + 2] = b[q].y + b[q].z;
            }
#pragma unroll
            for (int q = 0; q < GPL; q++) { a[q] = na[q]; b[q] = nb[q]; }
        }
    }
}

// decode, a lane per group: a code word, three rest bytes, an 8-byte store
template <int GPL>
__global__ void dec_group(const u32* codes, const u8* rest, uint2* out, long long chunks) {
    const int lane = threadIdx.x & 31;
    const long long W = (long long)gridDim.x * (blockDim.x / 32);
    for (long long c = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); c < chunks; c += W)
        for (int s = 0; s < GPC; s += 32 * GPL) {
            u32 w[GPL], r[GPL];
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const long long g = c * GPC + s + q * 32 + lane;
                w[q] = codes[g];
                r[q] = rest[3 * g] | (rest[3 * g + 1] << 8) | (rest[3 * g + 2] << 16);
            }
#pragma unroll
            for (int q = 0; q < GPL; q++) out[c * GPC + s + q * 32 + lane] = make_uint2(w[q] ^ r[q], w[q] + r[q]);
        }
}

// decode, a lane per 4 consecutive groups: a 16-byte code load, three rest words, two 16-byte stores
template <int GPL>
__global__ void dec_quad(const uint4* codes, const u32* rest, uint4* out, long long chunks) {
    const int lane = threadIdx.x & 31;
    const long long W = (long long)gridDim.x * (blockDim.x / 32);
    for (long long c = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); c < chunks; c += W)
        for (int s = 0; s < GPC / 4; s += 32 * GPL) {
            uint4 w[GPL];
            u32 r0[GPL], r1[GPL], r2[GPL];
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const long long u = c * (GPC / 4) + s + q * 32 + lane;
                w[q] = codes[u]; r0[q] = rest[3 * u]; r1[q] = rest[3 * u + 1]; r2[q] = rest[3 * u + 2];
            }
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const long long u = c * (GPC / 4) + s + q * 32 + lane;
                out[2 * u] = make_uint4(w[q].x ^ r0[q], w[q].x + r0[q], w[q].y ^ r1[q], w[q].y + r1[q]);
                out[2 * u + 1] = make_uint4(w[q].z ^ r2[q], w[q].z + r2[q], w[q].w ^ r0[q], w[q].w + r1[q]);
            }
        }
}
"""
NAMES = [f"{k}<{g}>" for k in ("enc_group", "enc_quad", "enc_quad_pf", "dec_group", "dec_quad") for g in (1, 2, 4)]


def main():
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=NAMES)
    n = 1 << 28
    chunks = n // 4096
    x = cupy.random.randint(0, 2**31, size=n // 4, dtype=cupy.uint32)
    codes = cupy.empty(n // 8, cupy.uint32)
    rest = cupy.empty(3 * n // 32, cupy.uint32)
    out = cupy.empty_like(x)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    moved = x.nbytes + codes.nbytes + rest.nbytes
    for name in NAMES:
        k = mod.get_function(name)
        args = (x, codes, rest, np.int64(chunks)) if name.startswith("enc") else (codes, rest, out, np.int64(chunks))
        for blocks_per_sm in (3, 4, 6, 8):
            t = median_time(k, sms * blocks_per_sm, args)
            print(f"{name:16s} {blocks_per_sm} blocks/SM: {t * 1e6:7.1f} us  {moved / t / 1e12:5.2f} TB/s  "
                  f"({x.nbytes / t / 1e9:6.0f} GB/s of E5M2)")
    print_copy_rate(x)


if __name__ == "__main__":
    main()
