"""The static SASS counts of benchmarks/NOTES.md r6 and r7: probe kernels that run one piece of the
ratio-mode kernels (kernels/channel.cu) in straight-line code, compiled with NVRTC for sm_90 and
counted by sass_loops.py's disassembly, for the source before those changes (commit 85af26a,
read with git show) and for the working tree's.  No GPU needed.

    python benchmarks/ratio_sass_probes.py [--base REV]

Each count is the instructions up to the probe's first EXIT (predicated or not): the path of a
whole group, before the partial-group tails.  The append probe is one step of two groups a lane.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_loops  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FP8 = ((5, 2), (4, 3))

APPEND_BEFORE = '''
__global__ void probe(u32* sb, u32* sw, int bits, const u32* in, int* out) {
    const int lane = threadIdx.x & 31;
    bits = append_second(sb, sw, bits, in[threadIdx.x], in[threadIdx.x + 128] & 15, lane);
    out[threadIdx.x] = append_second(sb, sw, bits, in[threadIdx.x + 64], in[threadIdx.x + 192] & 15, lane);
}'''
APPEND_AFTER = '''
__global__ void probe(u32* sb, u32* sw, int bits, const u32* in, int* out) {
    const int lane = threadIdx.x & 31;
    u32 sec[2] = {in[threadIdx.x], in[threadIdx.x + 64]}, nsec[2] = {in[threadIdx.x + 128] & 15, in[threadIdx.x + 192] & 15};
    out[threadIdx.x] = append_second<2>(sb, sw, bits, sec, nsec, lane);
}'''


def encode_probe(E: int, M: int, after: bool) -> str:
    R, T = M + 1, "unsigned char"
    store = (f"put_rest_bits<{R}>(rest, g, g - lane, o.rest_bits, true, true, lane); put24(codes, g, g - lane, o.word, true, true, lane);"
             if after else
             f"put_rest<{R}>(rest, g, g - lane, o.r, true, true, lane); put_codes(codes, g, g - lane, o.word, true, true, lane);")
    return f'''
__global__ void probe(const {T}* src, int D, u32* out, u8* rest, u8* codes) {{
    extern __shared__ u8 lut[];
    const int lane = threadIdx.x & 31; const long long g = blockIdx.x * 256 + threadIdx.x;
    Raw<{T}> v; load_raw_full(src, g, v);
    ChannelGroup o; encode_channel_group<{E}, {M}, {T}, true, true>(v, g, 1ll << 40, lut, D, o);
    {store}
    out[g] = o.sec ^ o.nsec ^ o.esc;
}}'''


def decode_probe(E: int, M: int, after: bool) -> str:
    get = "get24" if after else "get_codes"
    return f'''
__global__ void probe(const u8* codes, const u8* rest, int D, unsigned char* dst, long long n) {{
    __shared__ u8 tab[15 * 256];
    const long long g = blockIdx.x * 256 + threadIdx.x;
    RestRaw<{M + 1}> rr; load_rest_raw<{M + 1}>(rest, g, rr);
    u32 e[8];
    listed_exponents<true>({get}(codes, g), 0u, 0u, tab, (u32)(g << 3) & (D - 1), D, D - 1, e);
    store_values<{E}, {M}, unsigned char>(dst, n, g, rr, e);
}}'''


def count(source: str, probe: str, options: list) -> int:
    cubin, lowered = sass_loops.compile_cubin({"code": source + probe, "names": ["probe"], "options": options})
    n = 0
    for _, insn, _, _ in sass_loops.function_sass(cubin, lowered["probe"]):
        n += 1
        if "EXIT" in insn:
            break
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="85af26a", help="the commit before the changes (its channel.cu)")
    args = ap.parse_args(argv)
    from kvzip.gpu import loader

    options = next(u for u in loader.units() if u["unit"] == "channel")["options"]
    before = subprocess.run(["git", "show", f"{args.base}:kvzip/gpu/kernels/channel.cu"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    after = '#include "channel.cu"\n'
    print(f"a step's second-level append (two groups a lane): "
          f"{count(before, APPEND_BEFORE, options)} -> {count(after, APPEND_AFTER, options)}")
    for E, M in FP8:
        print(f"E{E}M{M} one whole group's encode and stores: "
              f"{count(before, encode_probe(E, M, False), options)} -> {count(after, encode_probe(E, M, True), options)}")
    for E, M in FP8:
        print(f"E{E}M{M} one listed group's decode (no code 7): "
              f"{count(before, decode_probe(E, M, False), options)} -> {count(after, decode_probe(E, M, True), options)}")


if __name__ == "__main__":
    main()
