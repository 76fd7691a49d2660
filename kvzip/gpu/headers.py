"""The generated CUDA headers: kernels/layout.cuh from kvzip/layout.py (the blob's layout),
kernels/abi_check.cuh from kvzip/gpu/abi.py (the job tables' layout, static_assert-checked
against the C structs) and kernels/rans_rule.cuh from stages/channel_rans.py (the storage mode's
writer's rule).  tests/test_layout.py, tests/test_abi.py and
tests/test_storage_mode.py fail when the committed files are not this text.

    python -m kvzip.gpu.headers --check   # exit 1 if a committed header differs
    python -m kvzip.gpu.headers --write   # regenerate them
"""
from __future__ import annotations

import sys

from kvzip import layout
from kvzip.stages import channel_rans

from . import abi

HEADERS = ((layout.cuh_path, layout.cuh), (abi.cuh_path, abi.cuh), (channel_rans.cuh_path, channel_rans.cuh))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in (["--check"], ["--write"]):
        sys.stderr.write("usage: python -m kvzip.gpu.headers --check | --write\n")
        return 2
    stale = []
    for path, text in HEADERS:
        if path().read_text() != text():
            stale.append(path().name)
            if argv == ["--write"]:
                path().write_text(text())
    if stale:
        print(("rewrote " if argv == ["--write"] else "stale: ") + ", ".join(stale))
    return 1 if stale and argv == ["--check"] else 0


if __name__ == "__main__":
    sys.exit(main())
