// kvzip/gpu/kernels/weights_book.cuh (kvz_w_codebook) run on the host (emu.h), for
// tests/weights/test_codebook_kernel_host.py.  argv: input file, output file, records as in
// records.h.  Input: uint32 histograms of 256 bins, one after another.  Output: for each, its
// book (16 bytes) and code_of (256 bytes) as two records.
#include "emu.h"
#include "records.h"
#include "weights_book.cuh"

int main(int argc, char** argv) {
    const std::vector<Bytes> in = read_records(argv[1]);
    const std::vector<unsigned> hists = as<unsigned>(in[1]);
    std::vector<Bytes> out;
    for (size_t h = 0; h + 256 <= hists.size(); h += 256) {
        std::vector<unsigned char> book(16, 0xAB), code_of(256, 0xAB);  // every byte must be written
        emu_launch(1, 256, [&] { kvz_w_codebook(hists.data() + h, book.data(), code_of.data()); });
        out.push_back(bytes_of(book));
        out.push_back(bytes_of(code_of));
    }
    write_records(argv[2], out);
    return 0;
}
