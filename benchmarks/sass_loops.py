"""Static SASS of kvzip's kernels, without a GPU: compiles a loader unit with NVRTC for sm_90,
disassembles it with nvdisasm and prints, for one kernel, every loop (a backward branch and the
instructions from its target to it) with its instruction count and the source lines that
issue the most of them, and with --blocks its basic blocks (to follow one path by hand); first
ptxas's registers and spills for it.  A
loop body's count is an upper bound on what one iteration issues: branches inside it skip
some, and a kernel's whole-group and partial-group paths are both in it; a path's count,
divided by the values it handles, predicts what ncu's `smsp__inst_executed` would measure a
value, to be checked on a GPU.

    pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm cuda-bindings     # CUDA 13, no GPU needed
    python benchmarks/sass_loops.py channel 'kvz_ch_encode<8,7,unsigned short,2>' [--values 16] [--top 12]

The unit is one of kvzip.gpu.loader.units() (fused, quantize, weights, channel, channel_rans);
the kernel is its name expression as the loader writes it.  --values divides each loop's count.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ptx_identity import _check, nvrtc_read  # noqa: E402  (NVRTC's (status, value) results, its outputs)

ARCH = b"-arch=sm_90"
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_LINE = re.compile(r'//## File "([^"]*)", line (\d+)')
_BRANCH = re.compile(r"\b(?:BRA|BRX)\b[^`]*`\((\.L_x_\d+)\)")


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    import nvidia  # the pip wheel nvidia-cuda-nvdisasm puts it under nvidia/cu13/bin
    for root in nvidia.__path__:
        for p in Path(root).glob("*/bin/nvdisasm"):
            return str(p)
    raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm")


def compile_cubin(unit: dict, log: list | None = None) -> tuple[bytes, dict]:
    """(cubin for sm_90, {name expression: lowered name}) of one loader unit; ptxas's report
    (registers, spills, a line per kernel) appended to `log` where one is given."""
    from cuda.bindings import nvrtc

    prog = _check(nvrtc.nvrtcCreateProgram(unit["code"].encode(), b"kvzip.cu", 0, [], []))
    for name in unit["names"]:
        _check(nvrtc.nvrtcAddNameExpression(prog, name.encode()))
    opts = [o.encode() for o in unit["options"]] + [ARCH] + ([b"--ptxas-options=-v"] if log is not None else [])
    ok = int(nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]) == 0
    text = nvrtc_read(prog, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog)
    if not ok:
        raise RuntimeError(text.decode(errors="replace"))
    if log is not None:
        log.extend(text.decode(errors="replace").splitlines())
    cubin = nvrtc_read(prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
    lowered = {n: _check(nvrtc.nvrtcGetLoweredName(prog, n.encode())).decode() for n in unit["names"]}
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin, lowered


def registers(log: list, symbol: str) -> str:
    """ptxas's registers and spills line for one kernel of a compile_cubin log."""
    out, mine = [], False
    for line in log:
        if "Compiling entry function" in line:
            mine = f"'{symbol}'" in line
        elif mine and ("Used" in line or "spill" in line):
            out.append(line.split(":", 1)[-1].strip().removeprefix("ptxas").strip(" ."))
    return "; ".join(out)


def function_sass(cubin: bytes, symbol: str) -> list[tuple[int, str, tuple[str, int], str | None]]:
    """[(address, instruction, (source file, line), label at this address or None)] of one function."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm(), "-c", "-g", f.name], check=True, capture_output=True, text=True).stdout
    start = text.find(f".text.{symbol}:")
    if start < 0:
        raise SystemExit(f"{symbol} not in the cubin")
    end = text.find("\n\t.section", start)
    out, line, label = [], ("?", 0), None
    for raw in text[start:end if end > 0 else None].splitlines()[1:]:
        if m := _LINE.search(raw):
            line = (m.group(1), int(m.group(2)))
        elif m := _LABEL.match(raw.strip()):
            label = m.group(1)
        elif m := _INSN.match(raw):
            out.append((int(m.group(1), 16), m.group(2), line, label))
            label = None
    return out


def loops(sass: list) -> list[tuple[int, int]]:
    """(first index, last index) of each backward branch's span, innermost (shortest) first."""
    where = {lab: i for i, (_, _, _, lab) in enumerate(sass) if lab}
    spans = set()
    for i, (_, insn, _, _) in enumerate(sass):
        m = _BRANCH.search(insn)
        if m and m.group(1) in where and where[m.group(1)] <= i:
            spans.add((where[m.group(1)], i))
    return sorted(spans, key=lambda s: (s[1] - s[0], s[0]))


def blocks(body: list) -> list[tuple[int, int]]:
    """(first, last) indices of body's basic blocks: a label starts one, a branch or exit ends one."""
    out, first = [], 0
    for i, (_, insn, _, label) in enumerate(body):
        if label and i > first:
            out.append((first, i - 1))
            first = i
        if re.search(r"\b(BRA|BRX|EXIT|RET)\b", insn):
            out.append((first, i))
            first = i + 1
    if first < len(body):
        out.append((first, len(body) - 1))
    return out


def report(unit_name: str, kernel: str, values: int, top: int, show_blocks: bool = False) -> None:
    from kvzip.gpu import loader

    unit = next((u for u in loader.units() if u["unit"] == unit_name), None)
    if unit is None:
        raise SystemExit(f"no unit {unit_name!r}: {[u['unit'] for u in loader.units()]}")
    if kernel not in unit["names"]:
        raise SystemExit(f"{kernel!r} is not a name expression of {unit_name}: {unit['names']}")
    log: list = []
    cubin, lowered = compile_cubin(unit, log)
    sass = function_sass(cubin, lowered[kernel])
    files = {}

    def text(where):
        name, line = where
        if name not in files:
            path = Path(name)
            files[name] = (unit["code"] if path.name == "kvzip.cu" else path.read_text() if path.exists() else "").splitlines()
        lines = files[name]
        return f"{Path(name).name}:{line}", lines[line - 1].strip() if 0 < line <= len(lines) else "?"

    print(f"{kernel}: {len(sass)} instructions; {registers(log, lowered[kernel])}")
    for first, last in loops(sass):
        body = sass[first:last + 1]
        per = f", {len(body) / values:.1f} a value" if values > 1 else ""
        print(f"\nloop {body[0][3]} (0x{body[0][0]:x}-0x{body[-1][0]:x}): {len(body)} instructions{per}")
        for where, count in Counter(s[2] for s in body).most_common(top):
            at, code = text(where)
            print(f"  {count:4d}  {at:24s} {code[:100]}")
        if show_blocks:
            for a, b in blocks(body):
                where, _ = Counter(s[2] for s in body[a:b + 1]).most_common(1)[0]
                branch = body[b][1][:60] if "BRA" in body[b][1] else ""
                print(f"    block 0x{body[a][0]:x} {b - a + 1:4d}  {text(where)[0]:24s} {branch}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("unit")
    ap.add_argument("kernel")
    ap.add_argument("--values", type=int, default=1, help="values one iteration of the hot loop handles")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--blocks", action="store_true", help="also list each loop's basic blocks")
    a = ap.parse_args()
    report(a.unit, a.kernel, a.values, a.top, a.blocks)
