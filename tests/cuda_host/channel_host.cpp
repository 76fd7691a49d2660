// kvzip/gpu/kernels/channel.cu run on the host (emu.h), in the order kvzip/gpu/channel_pack.py
// launches it, for tests/test_channel_kernels_host.py.  argv: input file, output file; both are
// records (u64 byte count, bytes).  Input: int64[7] {op (0 encode, 1 decode, 2 the speed mode's
// auto codebook, 3 the offsets scan alone, 4 the look-back alone, 5 encode with a header
// template), E, M, n, channels, chunk, grid}, then encode and auto: the values (op 5: then the
// template); decode: tables, codes, rest, esc_count, sec_count, sec_codes, esc_pos, esc_exp,
// exp_high; scan: esc_count, sec_count, int64[4] {checked, the three streams' lengths};
// look-back: see look_back_probe.  Output: encode: the payload the kernels wrote (into a buffer
// of 0xAB bytes), then its streams tables, codes, rest, esc_count, sec_count, sec_codes, esc_pos,
// esc_exp, exp_high (op 5: then the blob's header); decode: the values, then the uint64 error
// words of the counts and of the tables; auto: kvz_auto_codebook's LUT row (AUTO_LUT_BYTES) and
// book (16 bytes) of the one tensor (auto_codebook.cu shares SamplePlan and rank_exponents with
// channel.cu); scan: offsets (int64[3 nchunks]) and result (uint64[4]).
#include <chrono>

#include "emu.h"
#include "records.h"
#include "channel.cu"

template <int E, int M, typename T>
static std::vector<Bytes> auto_codebook(const std::vector<Bytes>& in, long long n, int grid) {
    const std::vector<T> src = as<T>(in[1]);
    EncodeJob job{};
    job.src = src.data();
    job.n = n;
    const SamplePlan plan(n);
    const int blocks = (int)std::max<long long>(1, std::min<long long>(cdiv(plan.blocks, AUTO_UNROLL), grid));
    std::vector<u64> work(((1 << E) + 1 + 1) / 2, 0);  // the histogram (2^E u32) and a ticket, zeroed
    std::vector<u8> luts(AUTO_LUT_BYTES), books(16);
    emu_launch(blocks, AUTO_RUN, [&] {
        blockIdx.y = 0;  // one tensor: grid (blocks, 1)
        gridDim.y = 1;
        kvz_auto_codebook<E, M, T>(&job, work.data(), 0, luts.data(), books.data());
    });
    return {bytes_of(luts), bytes_of(books)};
}

// Op 4, the look-back alone, with the waits a GPU's concurrent tiles cause: warp 1 runs
// tile_look_back for tile `c` while warp 0 publishes the words of tiles 0..c-1 in the given
// order, a millisecond apart (pairs of tile, flag << 62 | value), over words that start as `fill`
// (one uint64: 0 or ~0).  Output: the prefix warp 1 got, then the words as they end.
static std::vector<Bytes> look_back_probe(const std::vector<Bytes>& in) {
    const u64 fill = as<u64>(in[1])[0];
    const std::vector<u64> order = as<u64>(in[2]);
    const long long c = as<long long>(in[3])[0], mine = as<long long>(in[3])[1];
    std::vector<u64> status(c + 1, fill);
    u64 got = 0;
    emu_launch(1, 64, [&] {
        const int lane = threadIdx.x & 31;
        if (threadIdx.x >= 32) {
            const u64 p = tile_look_back(status.data(), c, (u64)mine, lane);
            if (lane == 0) got = p;
        } else if (lane == 0) {
            for (size_t k = 0; k + 1 < order.size(); k += 2) {
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
                atomicExch(&status[order[k]], order[k + 1]);
            }
        }
    });
    return {bytes_of(std::vector<u64>{got}), bytes_of(status)};
}

template <int E, int M, typename T, int GPL>
static std::vector<Bytes> run(const std::vector<Bytes>& in, long long n, int D, int chunk, int grid) {
    const long long op = as<long long>(in[0])[0];
    if (op == 2) return auto_codebook<E, M, T>(in, n, grid);
    if (op == 4) return look_back_probe(in);
    const int HB = E - 3, R = M + 1, gpc = chunk / 8;
    const long long G = cdiv(n, 8), nchunks = cdiv(n, chunk);
    const auto blocks = [&](long long work) { return (int)std::min<long long>(cdiv(work, 8), grid); };
    std::vector<long long> offsets(3 * nchunks + 1);
    std::vector<u64> result(5);
    const int tiles = (int)std::max<long long>(1, cdiv(nchunks, CH_TILE));
    const bool dec = op == 1;
    std::vector<u8> tables(D * 15);
    std::vector<u16> esc_count(nchunks), sec_count(nchunks);
    // The look-back's words start unpublished: filled with 0xFF bytes where the scan is checked
    // (decode: one fill with the error words, as channel_pack.decode_many does), zeroed otherwise
    // (encode: with the histogram); the error words (result[0], result[4]) are the caller's ~0.
    // head_tmpl, head (encode): the header's template and where the scan writes the blob's header.
    auto scan_of = [&](const u16* esc, const u16* sec, int checked, long long ns, long long ne, long long nh,
                       const u8* head_tmpl = nullptr, u8* head = nullptr) {
        std::vector<u64> status(3 * tiles, checked ? ~0ull : 0ull);
        result[0] = result[4] = ~0ull;
        emu_launch(tiles, CH_TILE_THREADS, [&] {
            kvz_ch_scan(esc, sec, nchunks, n, chunk, HB, checked, ns, ne, nh, tables.data(), D, status.data(),
                        offsets.data(), result.data(), head_tmpl, head);
        });
    };
    auto scan = [&](int checked, long long ns, long long ne, long long nh) {
        scan_of(esc_count.data(), sec_count.data(), checked, ns, ne, nh);
    };
    if (op == 3) {  // the offsets scan alone
        esc_count = as<u16>(in[1]);
        sec_count = as<u16>(in[2]);
        const std::vector<long long> len = as<long long>(in[3]);  // checked, sec_codes bytes, escapes, exp_high bytes
        scan((int)len[0], len[1], len[2], len[3]);
        offsets.resize(3 * nchunks);
        result.resize(4);
        return {bytes_of(offsets), bytes_of(result)};
    }
    if (!dec) {
        const std::vector<T> src = as<T>(in[1]);
        std::vector<u32> hist((size_t)D << E);
        const SamplePlan plan(n);
        if (plan.blocks)
            emu_launch((int)std::min<long long>(plan.blocks, grid), AUTO_RUN,
                       [&] { kvz_ch_histogram<E, M, T>(src.data(), n, D, hist.data()); });
        emu_launch(D, AUTO_RUN, [&] { kvz_ch_tables<E>(hist.data(), tables.data()); });
        // The payload as kvzip/gpu/channel_pack.py lays it out: codes, rest and esc_count at the
        // places the layout rule gives them, the rest after the scan (ch_payload).
        const auto up = [](long long x) { return (x + 15) & ~15ll; };
        const long long at_rest = up(3 * G), at_esc = up(at_rest + R * G);
        // The blob: its header's KVZ_COMPACT_SIZE bytes (written by the scan's last tile with a
        // template, op 5), then the payload.
        std::vector<u8> blob(KVZ_COMPACT_SIZE + up(at_esc + 2 * nchunks) + HB * G + 64 + 2 * up(2 * nchunks) + 16 * D + 64,
                             0xAB);
        u8* payload = blob.data() + KVZ_COMPACT_SIZE;
        const std::vector<u8> head_tmpl = op == 5 ? as<u8>(in[2]) : std::vector<u8>();
        u16* esc = reinterpret_cast<u16*>(payload + at_esc);
        std::vector<u8> exp_slots(nchunks * (HB * gpc / 3) + 1), high_slots(HB * G + 1);
        std::vector<u16> pos_slots(nchunks * (HB * gpc / 3) + 1);
        std::vector<u32> sec_slots(nchunks * cdiv(3 * chunk, 32) + 1);
        if (nchunks)
            emu_launch(blocks(nchunks), 256, [&] {
                kvz_ch_encode<E, M, T, GPL>(src.data(), n, D, tables.data(), chunk, nchunks, payload,
                                            payload + at_rest, esc, sec_count.data(), sec_slots.data(),
                                            pos_slots.data(), exp_slots.data(), high_slots.data());
            });
        scan_of(esc, sec_count.data(), 0, 0, 0, 0, head_tmpl.empty() ? nullptr : head_tmpl.data(),
                payload - KVZ_COMPACT_SIZE);
        emu_launch(std::max(1, blocks(nchunks)), 256, [&] {
            kvz_ch_compact(sec_count.data(), nchunks, n, chunk, HB, R, D, offsets.data(), sec_slots.data(),
                           pos_slots.data(), exp_slots.data(), high_slots.data(), tables.data(), result.data(),
                           payload);
        });
        const ChPayload p = ch_payload(n, R, nchunks, D, result.data());
        if (KVZ_COMPACT_SIZE + p.at[CH_STREAMS] > (long long)blob.size()) return {};
        const auto bytes = [&](long long at, long long len) { return Bytes(payload + at, payload + at + len); };
        const auto stream = [&](int k) { return bytes(p.at[k], p.len[k]); };
        // payload order: codes, rest, esc_count, esc_pos, esc_exp, exp_high, sec_codes, sec_count, tables
        std::vector<Bytes> out = {bytes(0, p.at[CH_STREAMS]), stream(8), stream(0), stream(1), stream(2), stream(7),
                                  stream(6), stream(3), stream(4), stream(5)};
        if (op == 5) out.push_back(Bytes(blob.begin(), blob.begin() + KVZ_COMPACT_SIZE));
        return out;
    }
    tables = as<u8>(in[1]);
    const std::vector<u8> codes = as<u8>(in[2]), rest = as<u8>(in[3]);
    esc_count = as<u16>(in[4]);
    sec_count = as<u16>(in[5]);
    const std::vector<u8> sec_codes = as<u8>(in[6]), esc_exp = as<u8>(in[8]), exp_high = as<u8>(in[9]);
    const std::vector<u16> esc_pos = as<u16>(in[7]);
    scan(1, (long long)sec_codes.size(), (long long)esc_pos.size(), (long long)exp_high.size());
    std::vector<T> dst(n);
    if (nchunks)
        emu_launch(blocks(nchunks), 256, [&] {
            kvz_ch_decode<E, M, T, GPL>(codes.data(), rest.data(), tables.data(), D, esc_count.data(), sec_count.data(),
                                        offsets.data(), sec_codes.data(), esc_pos.data(), esc_exp.data(),
                                        exp_high.data(), n, chunk, nchunks, result.data(), dst.data());
        });
    return {bytes_of(dst), bytes_of(std::vector<u64>{result[0], result[4]})};
}

int main(int argc, char** argv) {
    const std::vector<Bytes> in = read_records(argv[1]);
    const std::vector<long long> p = as<long long>(in[0]);
    const long long E = p[1], M = p[2], n = p[3];
    const int D = (int)p[4], chunk = (int)p[5], grid = (int)p[6];
    const std::vector<Bytes> out = with_format(E, M, [&](auto f) {
        using F = decltype(f);
        return run<F::E, F::M, typename F::T, sizeof(typename F::T) == 4 ? 1 : 2>(in, n, D, chunk, grid);  // channel_gpl
    });
    write_records(argv[2], out);
    return 0;
}
