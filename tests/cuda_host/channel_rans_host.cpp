// kvzip/gpu/kernels/channel_rans.cu run on the host (emu.h), in the order kvzip/gpu/channel_rans.py
// launches it, for tests/test_channel_rans_kernels_host.py.  argv: input file, output file (records,
// records.h).  Input: int64[11] {op (0 histogram, 1 encode, 2 decode, 3 tables), E, M, n, channels,
// chunk, grid (the most blocks of a grid-stride kernel), shift, groups, a, b}, then
//   histogram: the values; a, b: slice_channels, per_block; grid: the blocks (histogram_plan's);
//   tables: the histogram (uint32[channels << E]);
//   encode: the values, the tables' words (device_tables);
//   decode: rest, states, words, word_count, esc_exp, esc_count, the tables' words; a: search_top.
// Output: histogram: uint32[channels << E]; tables: the tables stream, the table words, the
// uint32 info (kvz_rans_tables's); encode: rest, states, word_count, esc_count, words,
// esc_exp; decode: the values, then the uint64 error word.
#include "emu.h"
#include "records.h"
#include "channel_rans.cu"

template <int E, int M, typename T>
static std::vector<Bytes> run(const std::vector<Bytes>& in, const std::vector<long long>& p) {
    const long long op = p[0], n = p[3];
    const int D = (int)p[4], chunk = (int)p[5], grid = (int)p[6], shift = (int)p[7], ng = (int)p[8];
    const long long nchunks = cdiv(n, chunk), G = cdiv(n, 8);
    const auto blocks = [&](long long work) { return (int)std::min<long long>(cdiv(work, RANS_WARPS), grid); };
    std::vector<long long> offsets(2 * nchunks + 1);
    std::vector<u64> result(4);
    std::vector<u32> word_count(nchunks), esc_count(nchunks);
    auto scan = [&](int checked, long long nw, long long ne) {
        emu_launch(1, RANS_SCAN_THREADS, [&] {
            kvz_rans_offsets(word_count.data(), esc_count.data(), nchunks, n, chunk, checked, nw, ne, offsets.data(),
                             result.data());
        });
    };
    if (op == 0) {
        const std::vector<T> src = as<T>(in[1]);
        std::vector<u32> hist((size_t)D << E);
        if (grid)
            emu_launch(grid, RANS_HIST_THREADS,
                       [&] { kvz_rans_histogram<E, M, T>(src.data(), n, D, (int)p[9], p[10], hist.data()); });
        return {bytes_of(hist)};
    }
    if (op == 3) {
        const std::vector<u32> hist = as<u32>(in[1]);
        std::vector<u32> stream(cdiv(RANS_MAX_STREAM_BYTES, 4)), words(RANS_MAX_TABLE_WORDS), info(RANS_INFO_WORDS);
        emu_launch(1, RANS_TABLES_THREADS, [&] { kvz_rans_tables<E>(hist.data(), D, stream.data(), words.data(), info.data()); });
        std::vector<u8> bytes(info[1]);
        std::memcpy(bytes.data(), stream.data(), info[1]);
        words.resize(info[2]);
        return {bytes_of(bytes), bytes_of(words), bytes_of(info)};
    }
    const std::vector<u32> tables = as<u32>(in.back());
    if (op == 1) {
        const std::vector<T> src = as<T>(in[1]);
        std::vector<u8> rest((M + 1) * G), esc_slots(n + 1);
        std::vector<u32> states(32 * nchunks);
        std::vector<u16> word_slots(n + 1);
        if (nchunks)
            emu_launch(blocks(nchunks), RANS_WARPS * 32, [&] {
                kvz_rans_encode<E, M, T>(src.data(), n, D, shift, tables.data(), (int)tables.size(), ng, chunk,
                                         nchunks, rest.data(), states.data(), word_count.data(), esc_count.data(),
                                         word_slots.data(), esc_slots.data());
            });
        scan(0, 0, 0);
        std::vector<u16> words(result[2] + 1);
        std::vector<u8> esc_exp(result[3] + 1);
        if (nchunks)
            emu_launch(blocks(nchunks), RANS_WARPS * 32, [&] {
                kvz_rans_compact(word_count.data(), esc_count.data(), nchunks, n, chunk, offsets.data(),
                                 word_slots.data(), esc_slots.data(), words.data(), esc_exp.data());
            });
        words.resize(result[2]);
        esc_exp.resize(result[3]);
        return {bytes_of(rest), bytes_of(states), bytes_of(word_count), bytes_of(esc_count), bytes_of(words),
                bytes_of(esc_exp)};
    }
    const std::vector<u8> rest = as<u8>(in[1]), esc_exp = as<u8>(in[5]);
    const std::vector<u32> states = as<u32>(in[2]);
    const std::vector<u16> words = as<u16>(in[3]);
    word_count = as<u32>(in[4]);
    esc_count = as<u32>(in[6]);
    scan(1, (long long)words.size(), (long long)esc_exp.size());
    std::vector<T> dst(n);
    if (nchunks)
        emu_launch(blocks(nchunks), RANS_WARPS * 32, [&] {
            kvz_rans_decode<E, M, T>(rest.data(), states.data(), words.data(), word_count.data(), esc_exp.data(),
                                     esc_count.data(), offsets.data(), tables.data(), (int)tables.size(), ng,
                                     (int)p[9], D, shift, n, chunk, nchunks, result.data(), dst.data());
        });
    return {bytes_of(dst), bytes_of(std::vector<u64>{result[0]})};
}

int main(int argc, char** argv) {
    const std::vector<Bytes> in = read_records(argv[1]);
    const std::vector<long long> p = as<long long>(in[0]);
    write_records(argv[2], with_format(p[1], p[2], [&](auto f) {
        using F = decltype(f);
        return run<F::E, F::M, typename F::T>(in, p);
    }));
    return 0;
}
