"""The decoding side of tests/test_fuzz.py, run as its own process so that a crash, a hang or a
memory blow-up on a hostile blob fails that test instead of killing the pytest run.

Protocol, over stdin / stdout: the worker decodes the blobs named on its command line (warming up
every kernel), sets its address-space limit to what it holds then plus the headroom given, and
prints "READY".  Then for each request (an 8-byte little-endian length plus one, then the blob)
it prints one JSON line: {decoder: outcome} where an outcome is ["ok", dtype, shape, sha256 of the
result's bytes], ["FormatError"], or ["other", exception type, message] (the failures the test
looks for).  A zero ends it.
"""
from __future__ import annotations

import hashlib
import json
import resource
import sys

import numpy as np

import kvzip
from kvzip import stages as S

STAGED = kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()], fuse=False)


def decompress_into(blob: bytes):
    """kvzip.decompress_into of the blob into a tensor of the dtype and shape its header names
    (read with container.parse_header, which refuses a bad header as every decoder does); a
    header naming more values than the blob could hold (decoding refuses those) goes to
    decompress, so that no forged shape sizes an allocation here."""
    from kvzip import container
    from kvzip.arrays import numpy_dtype
    from kvzip.formats import get_format

    meta = container.parse_header(blob[:1 << 16], len(blob)).meta
    try:
        shape = tuple(int(d) for d in meta["shape"])
        dtype = numpy_dtype(get_format(meta["dtype"]).name)
    except (KeyError, TypeError, ValueError):
        return kvzip.decompress(blob)
    if any(d < 0 for d in shape) or int(np.prod(shape, dtype=object)) > 16 * len(blob) + 1024:
        return kvzip.decompress(blob)
    out = np.zeros(shape, dtype)
    return kvzip.decompress_into(blob, out)


DECODERS = {
    "decompress": kvzip.decompress,
    "staged": STAGED.decode,
    "decompress_many": lambda b: kvzip.decompress_many([b])[0],
    "info": kvzip.info,
    "decompress_into": decompress_into,
}


def outcome(decode, blob: bytes):
    try:
        out = decode(blob)
    except kvzip.FormatError:
        return ["FormatError"]
    except Exception as e:  # noqa: BLE001 - any other exception is what the fuzz looks for
        return ["other", type(e).__name__, str(e)[:300]]
    if isinstance(out, dict):  # info()
        return ["ok", out["dtype"], list(out["shape"]), None]
    a = np.asarray(out)  # (np.ascontiguousarray would make a 0-d result 1-d)
    return ["ok", a.dtype.name, list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()]


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def main() -> int:
    headroom = int(sys.argv[1])
    for path in sys.argv[2:]:  # warm-up: compile what the blobs need before the limit applies
        blob = open(path, "rb").read()
        for decode in DECODERS.values():
            decode(blob)
    limit = _address_space() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out, inp = sys.stdout, sys.stdin.buffer
    print("READY", flush=True)
    while True:
        n = int.from_bytes(inp.read(8), "little")
        if n == 0:
            return 0
        blob = inp.read(n - 1)
        out.write(json.dumps({name: outcome(d, blob) for name, d in DECODERS.items()}) + "\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
