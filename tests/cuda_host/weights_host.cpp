// kvzip/gpu/kernels/weights.cu's kernels run on the host (emu.h), in the order
// kvzip/weights/tiled.py and kvzip/gpu/weights.py launch them, for
// tests/weights/test_weights_kernels_host.py.  argv: input file, output file (records.h).
// Input: int64[4] {op (0 encode, 1 decode, 2 codebooks, 3 gemm, 4 wide gemm), M, K, grid}, then encode: W
// (uint16, M x K); decode: blocks, codebook, esc_off, esc_pos, esc_val (a TiledWeight's arrays);
// codebooks: uint32 histograms of 256 bins, one after another; gemm: the five arrays, then x
// (uint16, N x K), bias (uint16, M; empty: none), int64[3] {N, splits, per_split}; wide gemm: the same.
// Output: encode: hist (uint32[256]), book (16), code_of (256), blocks, counts (uint32 a block),
// esc_off (uint32, bands + 1), esc_pos (uint32), esc_val (uint16), the two tickets (uint32: each the
// grid's size after its kernel); decode: W (uint16, M x K); codebooks: each histogram's book
// (16 bytes) and code_of (256 bytes), choose_codebook_block's alone; gemm: y (uint16, N x M), then the
// tickets (uint32, a band: zero again after the call); wide gemm: the same (a ticket a tile).
#include <cmath>

#include "emu.h"
#include "records.h"
#include "weights.cu"

static std::vector<Bytes> encode(const std::vector<Bytes>& in, int M, int K, int grid) {
    const std::vector<u16> w = as<u16>(in[1]);
    const int bands = (M + 15) / 16, chunks = (K + W_CHUNK - 1) / W_CHUNK, blocks_n = bands * chunks;
    // kvzip/gpu/weights.py's workspace: histogram, tickets, code table, escapes a band, zeroed
    std::vector<u32> hist(256, 0), band_counts(bands, 0), counts(blocks_n, 0xABABABABu), esc_off(bands + 1, 0xABABABABu);
    u32 tickets[2] = {0, 0};
    std::vector<u8> book(16, 0xAB), code_of(256, 0xAB), blocks(size_t(blocks_n) * W_BLOCK_U4 * 16, 0xAB);
    const long long n = (long long)M * K;
    emu_launch(grid, W_WARPS * 32, [&] { kvz_w_histogram(w.data(), n, hist.data(), tickets, book.data(), code_of.data()); });
    emu_launch(grid, W_WARPS * 32, [&] {
        kvz_w_encode(w.data(), M, K, code_of.data(), reinterpret_cast<uint4*>(blocks.data()), counts.data(),
                     band_counts.data(), tickets + 1, esc_off.data(), bands, chunks);
    });
    const u32 total = esc_off[bands];  // tiled._encode_cuda's host sync
    std::vector<u32> esc_pos(total, 0xABABABABu);
    std::vector<u16> esc_val(total, 0xABAB);
    if (total)
        emu_launch(grid, W_WARPS * 32, [&] {
            kvz_w_escapes(w.data(), M, K, code_of.data(), counts.data(), esc_off.data(), esc_pos.data(), esc_val.data(),
                          bands, chunks);
        });
    return {bytes_of(hist), bytes_of(book), bytes_of(code_of), bytes_of(blocks), bytes_of(counts), bytes_of(esc_off),
            bytes_of(esc_pos), bytes_of(esc_val), bytes_of(std::vector<u32>(tickets, tickets + 2))};
}

// A TiledWeight's five arrays, records 1-5 of the input.
struct Layout {
    std::vector<u8> blocks, book;
    std::vector<u32> esc_off, esc_pos;
    std::vector<u16> esc_val;
    explicit Layout(const std::vector<Bytes>& in)
        : blocks(as<u8>(in[1])), book(as<u8>(in[2])), esc_off(as<u32>(in[3])), esc_pos(as<u32>(in[4])),
          esc_val(as<u16>(in[5])) {}
    const uint4* block_words() const { return reinterpret_cast<const uint4*>(blocks.data()); }
};

static std::vector<Bytes> decode(const std::vector<Bytes>& in, int M, int K, int grid) {
    const Layout t(in);
    const int bands = (M + 15) / 16, chunks = (K + W_CHUNK - 1) / W_CHUNK;
    std::vector<u16> out(size_t(M) * K, 0xABCD);
    emu_launch(grid, W_WARPS * 32, [&] { kvz_w_decode(t.block_words(), t.book.data(), out.data(), M, K, bands, chunks); });
    if (!t.esc_pos.empty())
        emu_launch((int)((t.esc_pos.size() + 255) / 256), 256, [&] {
            kvz_w_patch(t.esc_off.data(), t.esc_pos.data(), t.esc_val.data(), bands, out.data(), K);
        });
    return {bytes_of(out)};
}

static std::vector<Bytes> codebooks(const std::vector<Bytes>& in) {
    const std::vector<u32> hists = as<u32>(in[1]);
    std::vector<Bytes> out;
    for (size_t h = 0; h + 256 <= hists.size(); h += 256) {
        std::vector<u8> book(16, 0xAB), code_of(256, 0xAB);  // every byte must be written
        emu_launch(1, 256, [&] { choose_codebook_block(hists[h + threadIdx.x], book.data(), code_of.data()); });
        out.push_back(bytes_of(book));
        out.push_back(bytes_of(code_of));
    }
    return out;
}

template <int NT>
static std::vector<Bytes> gemm(const std::vector<Bytes>& in, int M, int K) {
    const Layout t(in);
    const std::vector<u16> x = as<u16>(in[6]), bias = as<u16>(in[7]);
    const std::vector<long long> p = as<long long>(in[8]);
    const int N = (int)p[0], splits = (int)p[1], per_split = (int)p[2];
    const int bands = (M + 15) / 16, chunks = (K + W_CHUNK - 1) / W_CHUNK;
    std::vector<u16> y(size_t(N) * M, 0xABCD);
    std::vector<float> partial(size_t(bands) * splits * 16 * N);
    std::vector<u32> tickets(bands, 0);
    gridDim.y = splits;
    for (int split = 0; split < splits; ++split)  // emu_launch's grid is one-dimensional: y by hand
        emu_launch(bands, W_WARPS * 32, [&] {
            blockIdx.y = split;
            kvz_w_gemm<NT>(t.block_words(), t.book.data(), t.esc_off.data(), t.esc_pos.data(), t.esc_val.data(), x.data(),
                           K, bias.empty() ? nullptr : bias.data(), y.data(), M, partial.data(), tickets.data(), M, K, N,
                           chunks, per_split);
        });
    gridDim.y = 1;
    return {bytes_of(y), bytes_of(tickets)};
}

// kvz_w_gemm_wide<NT> over the grid kvzip/gpu/weights.py's gemm_wide launches: (row blocks, splits,
// n blocks), y and z by hand.
template <int NT>
static std::vector<Bytes> gemm_wide(const std::vector<Bytes>& in, int M, int K) {
    const Layout t(in);
    const std::vector<u16> x = as<u16>(in[6]), bias = as<u16>(in[7]);
    const std::vector<long long> p = as<long long>(in[8]);
    const int N = (int)p[0], splits = (int)p[1], per_split = (int)p[2];
    const int bands = (M + 15) / 16, chunks = (K + W_CHUNK - 1) / W_CHUNK;
    const int row_blocks = (bands + W_WARPS - 1) / W_WARPS, n_blocks = (N + 8 * NT - 1) / (8 * NT);
    std::vector<u16> y(size_t(N) * M, 0xABCD);
    std::vector<float> partial(size_t(row_blocks) * n_blocks * splits * W_WARPS * 16 * 8 * NT, NAN);
    std::vector<u32> tickets(row_blocks * n_blocks, 0);
    gridDim.y = splits;
    gridDim.z = n_blocks;
    for (int nb = 0; nb < n_blocks; ++nb)
        for (int split = 0; split < splits; ++split)
            emu_launch(row_blocks, W_WARPS * 32, [&] {
                blockIdx.y = split;
                blockIdx.z = nb;
                kvz_w_gemm_wide<NT>(t.block_words(), t.book.data(), t.esc_off.data(), t.esc_pos.data(), t.esc_val.data(),
                                    x.data(), K, bias.empty() ? nullptr : bias.data(), y.data(), M, partial.data(),
                                    tickets.data(), M, K, N, chunks, per_split);
            });
    gridDim.y = gridDim.z = 1;
    return {bytes_of(y), bytes_of(tickets)};
}

int main(int argc, char** argv) {
    const std::vector<Bytes> in = read_records(argv[1]);
    const std::vector<long long> p = as<long long>(in[0]);
    const int M = (int)p[1], K = (int)p[2], grid = (int)p[3];
    std::vector<Bytes> out;
    if (p[0] == 0) out = encode(in, M, K, grid);
    else if (p[0] == 1) out = decode(in, M, K, grid);
    else if (p[0] == 2) out = codebooks(in);
    else if (p[0] == 3) {
        const int N = (int)as<long long>(in[8])[0];
        out = N <= 8 ? gemm<1>(in, M, K) : N <= 16 ? gemm<2>(in, M, K) : gemm<4>(in, M, K);
    } else {
        const int N = (int)as<long long>(in[8])[0];
        out = N <= 8    ? gemm_wide<1>(in, M, K)
              : N <= 16 ? gemm_wide<2>(in, M, K)
              : N <= 32 ? gemm_wide<4>(in, M, K)
              : N <= 64 ? gemm_wide<8>(in, M, K)
                        : gemm_wide<16>(in, M, K);
    }
    write_records(argv[2], out);
    return 0;
}
