"""Building and calling the host harnesses (channel_host.cpp, channel_rans_host.cpp,
weights_host.cpp): a kernel unit of kvzip/gpu/kernels/ compiled with tests/cuda_host/emu.h into a program that reads its
arguments from a file of records and writes its results to another (records.h)."""
from __future__ import annotations

import re
import struct
import subprocess
from pathlib import Path

import numpy as np

from kvzip.gpu import loader, tuning

HERE = Path(__file__).resolve().parent
# A dynamic shared array: on the host a pointer into emu.h's buffer (blocks run one at a time).
DYNAMIC_SHARED = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")


def build(unit: str, main: str, out: Path) -> Path:
    """The harness main (a .cpp here) around the kernel source unit (a file of kvzip/gpu/kernels/),
    built in out, where every kernel file is copied with its dynamic shared arrays made pointers
    into emu.h's buffer (out comes first on the include path)."""
    assert unit in loader.sources(), unit
    for name, src in loader.sources().items():  # every file: headers declare dynamic shared arrays too
        (out / name).write_text(DYNAMIC_SHARED.sub(r"\1* \2 = reinterpret_cast<\1*>(emu_dynamic_shared);", src))
    defines = [o for o in loader.options(tuning.tuning_for(None).macros()) if o.startswith("-D")]
    exe = out / Path(main).stem
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-w", *defines, f"-I{out}", f"-I{HERE}",
                    f"-I{loader.kernels_dir()}", str(HERE / main), "-o", str(exe)], check=True)
    return exe


def _records(arrays) -> bytes:
    return b"".join(struct.pack("<Q", a.nbytes) + np.ascontiguousarray(a).tobytes() for a in arrays)


def _read(path: Path) -> list[bytes]:
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        out.append(data[at + 8:at + 8 + length])
        at += 8 + length
    return out


def call(exe: Path, tmp_path: Path, params, arrays) -> list[bytes]:
    """exe's results (the records it writes) for the int64 params and the arrays after them."""
    (tmp_path / "in").write_bytes(_records([np.asarray(params, np.int64), *arrays]))
    subprocess.run([str(exe), str(tmp_path / "in"), str(tmp_path / "out")], check=True, timeout=300)
    return _read(tmp_path / "out")
