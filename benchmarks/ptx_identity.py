"""The fast path's kernels as PTX, without a GPU: compiles every name expression the kernel loader
builds (all formats, all kernels, the quantize module too) from a source tree with NVRTC and
writes one normalised PTX file per kernel, so two trees (a refactor and the commit before it)
can be compared kernel by kernel.  NVRTC needs no GPU: `pip install nvidia-cuda-nvrtc` (CUDA 13)
and cuda-bindings; LD_LIBRARY_PATH must reach libnvrtc.so (or cuda-pathfinder finds it).

    python benchmarks/ptx_identity.py TREE OUT            # OUT/<module>/<kernel>.ptx
    python benchmarks/ptx_identity.py --compare OUT_A OUT_B

TREE: a checkout (the working tree, or `git worktree add /tmp/base REV`).  A tree with
kvzip/gpu/loader.py is asked for its modules (loader.units(): code, options, name expressions);
an older one (one fused_fast.cu with quantize_lookup.cuh put in front by Python) is
reconstructed the way its programs.py and quantize_kernels.py built them.  The options are the
product's (-std=c++17 -lineinfo, the tuning's -D macros, -I the kernels folder) less the
sources digest (-DKVZ_SOURCES, which only keys CuPy's cache), plus -arch=compute_90.

Normalised: `.loc` / `.file` lines, comments and debug sections dropped (line numbers move when
code moves between files).  Each kernel's file holds its .entry and the .func bodies it calls;
_module.ptx the rest (globals, declarations, in module order).  benchmarks/NOTES.md ("Kernel
source split (redesign)") has the result for the split of fused_fast.cu.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ARCH = "-arch=compute_90"

_LEGACY = r'''
import json
from kvzip.formats import FORMATS
from kvzip.gpu import programs, quantize_kernels
names = [x for f in FORMATS.values() for x in programs._instances(f)] + ["kvz_gather_heads", "kvz_check_heads"]
names += [x for f in FORMATS.values() if f.itemsize == 1
          for x in (programs._dequantizing_decode(f), *programs._quantizing_encode(f))]
opts = ["-std=c++17", "-lineinfo"]
print(json.dumps([
    {"unit": "fused", "code": quantize_kernels.cuda_source("fused_fast.cu"), "options": opts, "names": names},
    {"unit": "quantize", "code": quantize_kernels.cuda_source("quantize_fast.cu"), "options": opts,
     "names": list(quantize_kernels._names())}]))
'''
_CURRENT = r'''
import json
from kvzip.gpu import loader
print(json.dumps(loader.units()))
'''


def units(tree: Path) -> list:
    """[{unit, code, options, names}] of tree's kernel modules, as its loader would build them."""
    script = _CURRENT if (tree / "kvzip" / "gpu" / "loader.py").exists() else _LEGACY
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", script], cwd=tree, env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def _check(result):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"NVRTC: {err}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def nvrtc_read(prog, size_of, read) -> bytes:
    """One of NVRTC's outputs (log, PTX, cubin) copied out through a fresh bytearray. NVRTC
    writes into the buffer it is given; a bytes object there is unsafe, since `b" " * 1` is
    CPython's shared one-byte singleton and an empty log (size 1) would overwrite it for the
    whole process."""
    buf = bytearray(_check(size_of(prog)))
    _check(read(prog, buf))
    return bytes(buf)


def compile_ptx(code: str, options: list, names: list) -> tuple[str, dict]:
    """(module PTX, {name expression: lowered name})."""
    from cuda.bindings import nvrtc

    prog = _check(nvrtc.nvrtcCreateProgram(code.encode(), b"kvzip.cu", 0, [], []))
    for name in names:
        _check(nvrtc.nvrtcAddNameExpression(prog, name.encode()))
    opts = [o.encode() for o in options if not o.startswith("-DKVZ_SOURCES")] + [ARCH.encode()]
    result = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(result[0]) != 0:
        log = nvrtc_read(prog, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog)
        raise RuntimeError(log.decode(errors="replace"))
    ptx = nvrtc_read(prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
    lowered = {n: _check(nvrtc.nvrtcGetLoweredName(prog, n.encode())).decode() for n in names}
    nvrtc.nvrtcDestroyProgram(prog)
    return ptx.rstrip(b"\0 ").decode(), lowered


_DROP = re.compile(r"^\s*(\.loc\b|\.file\b|//|\$L__(func_begin|func_end|tmp)\d+:)")


def normalise(ptx: str) -> list[str]:
    """ptx's lines less line info, comments and debug sections."""
    out, depth, section = [], 0, False
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section"):
            section, depth = True, 0
        if section:
            depth += line.count("{") - line.count("}")
            section = depth > 0 or "{" not in line and line.lstrip().startswith(".section")
            continue
        if _DROP.match(line) or not line.strip():
            continue
        out.append(line.rstrip())
    return out


_ITEM = re.compile(r"^(\.visible |\.weak |\.extern )?\.(entry|func)\b")


def items(lines: list[str]) -> tuple[list, dict]:
    """(module-level lines, {symbol: body lines}) of normalised PTX: each .entry and .func
    definition (with its braces) a body; declarations and globals stay module-level."""
    module, bodies, i = [], {}, 0
    while i < len(lines):
        line = lines[i]
        if _ITEM.match(line):
            j, depth, opened = i, 0, False
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                opened = opened or "{" in lines[j]
                if (not opened and lines[j].rstrip().endswith(";")) or (opened and depth == 0):
                    break
                j += 1
            block = lines[i:j + 1]
            name = re.search(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)", " ".join(block)).group(1)
            if opened:
                bodies[name] = block
            else:
                module.extend(block)
            i = j + 1
        else:
            module.append(line)
            i += 1
    return module, bodies


def _calls(body: list[str], bodies: dict) -> list[str]:
    text = "\n".join(body)
    return [n for n in bodies if re.search(r"call(\.uni)?\s*(\([^)]*\),\s*)?" + re.escape(n) + r"\b", text)]


def _file_name(expr: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", expr).strip("_") + ".ptx"


def write(tree: Path, out: Path) -> int:
    count = 0
    for u in units(tree):
        ptx, lowered = compile_ptx(u["code"], u["options"], u["names"])
        module, bodies = items(normalise(ptx))
        d = out / u["unit"]
        d.mkdir(parents=True, exist_ok=True)
        (d / "_module.ptx").write_text("\n".join(module) + "\n")
        for expr, sym in lowered.items():
            seen, todo = [], [sym]
            while todo:  # the entry, then every .func it reaches, in first-call order
                s = todo.pop(0)
                if s in seen or s not in bodies:
                    continue
                seen.append(s)
                todo += _calls(bodies[s], bodies)
            text = "\n".join(line for s in seen for line in bodies[s])
            (d / _file_name(expr)).write_text(f"// {expr}\n{text}\n")
            count += 1
    return count


def compare(a: Path, b: Path) -> int:
    """Prints the files that differ or exist on one side; returns their count."""
    fa = {p.relative_to(a) for p in a.rglob("*.ptx")}
    fb = {p.relative_to(b) for p in b.rglob("*.ptx")}
    bad = 0
    for rel in sorted(fa | fb):
        if rel not in fa or rel not in fb:
            print(f"only in {'B' if rel not in fa else 'A'}: {rel}")
            bad += 1
        elif (a / rel).read_text() != (b / rel).read_text():
            print(f"differs: {rel}")
            bad += 1
    print(f"{len(fa & fb)} files in both, {bad} differing or unmatched")
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(1 if compare(Path(sys.argv[2]), Path(sys.argv[3])) else 0)
    print(write(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()), "kernels written")
