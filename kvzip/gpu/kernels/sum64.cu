// sum64 (kvzip/checksum.py, docs/format.md section 4.2) on the device: over one payload, or fused
// with the copies that build a kvzip.transfer message from its tensors (gather) or take one apart
// into them (scatter), so that a message costs one pass and one launch however many tensors it
// carries.
//
// Word i of a payload (little-endian uint64, i counted from the payload's start) adds
// term(w_i, i) = mix(w_i + i * GOLDEN) into the total mod 2^64.  Addition mod 2^64 is associative
// and commutative, so the order of the additions cannot change the result: it is the NumPy
// reference's, bit for bit (tests/gpu/test_checksum_gpu.py).  Each thread sums its words in a
// register, a warp adds its threads' sums by shuffles and one atomic per warp adds that into the
// total.  blockDim.x is a multiple of 32, so every lane of a warp reaches the shuffles.
//
// A message (docs/transfer.md) is its parts laid end to end: part p's bytes at offset off[p] (a
// multiple of 8, increasing), len[p] bytes long, and zero bytes from off[p] + len[p] up to the
// next part (or the message's end).  A part table row is three int64: a device address, off, len.

#define KVZ_GOLDEN 0x9E3779B97F4A7C15ull

__device__ __forceinline__ unsigned long long kvz_term(unsigned long long w, unsigned long long i) {
    unsigned long long z = w + i * KVZ_GOLDEN + KVZ_GOLDEN;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ void kvz_add_total(unsigned long long acc, unsigned long long* total) {
    for (int d = 16; d > 0; d >>= 1)
        acc += __shfl_down_sync(0xffffffffu, acc, d);
    if ((threadIdx.x & 31) == 0)
        atomicAdd(total, acc);
}

// The last part whose offset is <= byte, or -1 before the first part (parts: rows of 3 int64).
__device__ __forceinline__ int kvz_part_of(const long long* __restrict__ parts, int count, unsigned long long byte) {
    int lo = 0, hi = count - 1, found = -1;
    while (lo <= hi) {
        const int mid = (lo + hi) >> 1;
        if ((unsigned long long)__ldg(parts + 3 * mid + 1) <= byte) {
            found = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return found;
}

extern "C" __global__ void kvz_sum64(const unsigned long long* __restrict__ w, unsigned long long n,
                                     unsigned long long* total) {
    unsigned long long acc = 0;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        acc += kvz_term(w[i], i);
    kvz_add_total(acc, total);
}

// Builds the message of n_words words at dst from its parts (sources anywhere, any alignment) and
// sums it.  A word holds bytes of at most one part: every offset is a multiple of 8.
extern "C" __global__ void kvz_gather_sum64(const long long* __restrict__ parts, int count,
                                            unsigned long long* __restrict__ dst, unsigned long long n_words,
                                            unsigned long long* total) {
    unsigned long long acc = 0;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_words; i += step) {
        unsigned long long w = 0;
        const int p = kvz_part_of(parts, count, 8 * i);
        if (p >= 0) {
            const unsigned long long at = 8 * i - (unsigned long long)__ldg(parts + 3 * p + 1);
            const unsigned long long len = (unsigned long long)__ldg(parts + 3 * p + 2);
            const unsigned char* src = (const unsigned char*)__ldg(parts + 3 * p) + at;
            if (at + 8 <= len && ((size_t)src & 7) == 0) {
                w = __ldg((const unsigned long long*)src);
            } else {
                for (unsigned long long b = 0; b < 8 && at + b < len; ++b)
                    w |= (unsigned long long)src[b] << (8 * b);
            }
        }
        dst[i] = w;
        acc += kvz_term(w, i);
    }
    kvz_add_total(acc, total);
}

// Sums the message of n_words words at src and copies each part's len bytes out of it to the
// part's address (any alignment); words outside every part are only summed.
extern "C" __global__ void kvz_scatter_sum64(const long long* __restrict__ parts, int count,
                                             const unsigned long long* __restrict__ src, unsigned long long n_words,
                                             unsigned long long* total) {
    unsigned long long acc = 0;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_words; i += step) {
        const unsigned long long w = src[i];
        acc += kvz_term(w, i);
        const int p = kvz_part_of(parts, count, 8 * i);
        if (p < 0)
            continue;
        const unsigned long long at = 8 * i - (unsigned long long)__ldg(parts + 3 * p + 1);
        const unsigned long long len = (unsigned long long)__ldg(parts + 3 * p + 2);
        if (at >= len)
            continue;
        unsigned char* out = (unsigned char*)__ldg(parts + 3 * p) + at;
        if (at + 8 <= len && ((size_t)out & 7) == 0) {
            *(unsigned long long*)out = w;
        } else {
            for (unsigned long long b = 0; b < 8 && at + b < len; ++b)
                out[b] = (unsigned char)(w >> (8 * b));
        }
    }
    kvz_add_total(acc, total);
}
