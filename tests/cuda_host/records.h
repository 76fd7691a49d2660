// The host harnesses' file format and byte helpers (channel_host.cpp, channel_rans_host.cpp,
// weights_host.cpp, fused_host.cpp): a file is records, each a u64 byte count and the bytes.
#pragma once

#include <cstdio>
#include <cstring>
#include <vector>

using Bytes = std::vector<unsigned char>;

inline std::vector<Bytes> read_records(const char* path) {
    std::vector<Bytes> out;
    FILE* f = std::fopen(path, "rb");
    unsigned long long len;
    while (std::fread(&len, 8, 1, f) == 1) {
        Bytes b(len + 16);
        if (len && std::fread(b.data(), 1, len, f) != len) break;
        b.resize(len);
        out.push_back(b);
    }
    std::fclose(f);
    return out;
}

inline void write_records(const char* path, const std::vector<Bytes>& out) {
    FILE* f = std::fopen(path, "wb");
    for (const Bytes& b : out) {
        const unsigned long long len = b.size();
        std::fwrite(&len, 8, 1, f);
        if (len) std::fwrite(b.data(), 1, len, f);
    }
    std::fclose(f);
}

template <typename T>
inline Bytes bytes_of(const std::vector<T>& v) {
    Bytes b(v.size() * sizeof(T));
    if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
    return b;
}

template <typename T>
inline std::vector<T> as(const Bytes& b) {
    std::vector<T> v(b.size() / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), b.data(), b.size());
    return v;
}

inline long long cdiv(long long a, long long b) { return (a + b - 1) / b; }

// f(Format<E, M, T>{}) for the format of E exponent and M mantissa bits (kvzip.formats).
template <int E_, int M_, typename T_>
struct Format {
    static constexpr int E = E_, M = M_;
    using T = T_;
};
template <typename F>
inline auto with_format(long long E, long long M, F&& f) {
    if (E == 8 && M == 7) return f(Format<8, 7, unsigned short>{});
    if (E == 5 && M == 10) return f(Format<5, 10, unsigned short>{});
    if (E == 8 && M == 23) return f(Format<8, 23, unsigned int>{});
    if (E == 4 && M == 3) return f(Format<4, 3, unsigned char>{});
    return f(Format<5, 2, unsigned char>{});
}
