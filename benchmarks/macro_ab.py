"""Kernel tunings (kvzip/gpu/tuning.py) alternated in one process: each setting rebuilds the
kernels and programs with its changes through tuning.override() (benchmarks/NOTES.md, v23: claim
units of FP8 chunks, since removed; v24: KVZ_QUEUES, and the E5M2 encoder's position tables,
since the only way).

    python benchmarks/macro_ab.py SETTINGS [FORMATS] [rounds]
    python benchmarks/macro_ab.py "queues=1;queues=4" e5m2,bf16 3
    python benchmarks/macro_ab.py "-;e5m2.decode_shape=2x3;KVZ_PENDING=4" e5m2

SETTINGS: settings separated by ";", each of changes separated by "," ("-" for none: the shipped
tunings).  A change is FIELD=VALUE for every format or FMT.FIELD=VALUE for one; FIELD is a Tuning
field or the macro it renders (KVZ_QUEUES for queues), VALUE an integer or, for a shape, GxB.
FORMATS: e5m2 (default), bf16, fp16, fp32, quantize (QuantizeFP8 + E5M2 of the BF16 data), batch
(the BF16 data as 64 tensors through compress_many / decompress_many, as the bench's batch).
Each round, per setting and format: compress and decompress of 2^28 real values (the bench's
data), the call and its graph replay alone (CUDA events, median of 30 after warm-up), the blob
checked against the first setting's and the round trip against the input.
"""
import contextlib
import dataclasses
import sys

import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, batch_parts, format_bits, quantize_pipelines
from kvzip.gpu import graphs, tuning

_MACROS = {f.metadata["name"]: f.name for f in dataclasses.fields(tuning.Tuning) if f.metadata["to"] == "macro"}
_active = contextlib.ExitStack()  # the setting in force


def changes(setting: str) -> dict:
    """{format or None (all): {field: value}} of a setting."""
    out: dict = {}
    for token in (m for m in setting.split(",") if m and m != "-"):
        name, value = token.split("=")
        fmt, _, field = name.rpartition(".")
        field = _MACROS.get(field, field)
        out.setdefault(fmt or None, {})[field] = tuple(int(v) for v in value.split("x")) if "x" in value else int(value)
    return out


def build(setting: str) -> None:
    """The kernels and programs of setting's tunings, from the next call on."""
    global _active
    _active.close()
    _active = contextlib.ExitStack()
    for fmt, fields in changes(setting).items():
        _active.enter_context(tuning.override(formats=None if fmt is None else (fmt,), **fields))
    graphs.release()


def inputs(names: list, n: int) -> dict:
    """name -> (pipeline, input bits, dtype argument, what decoding gives back)."""
    host = _sample_bits(n)
    out = {}
    for name in names:
        if name == "batch":  # 64 x 8 MiB of BF16 through compress_many / decompress_many, as the bench
            parts = batch_parts(cupy.asarray(host))
            out[name] = ("many", parts, "bf16", parts)
        elif name == "quantize":
            x = cupy.asarray(host)
            pipe, qonly = quantize_pipelines()
            out[name] = (pipe, x, "bf16", qonly.decode(qonly.encode(x, dtype="bf16")).reshape(-1))
        else:
            x = cupy.asarray(format_bits(name, host, n))
            out[name] = (kvzip.splitzip_pipeline() if name == "bf16" else None, x, name, x)
    return out


def _same(a, b, flat=False) -> bool:
    """Arrays (or lists of them, a batch's) equal bit for bit; flat: a's raw bits against b's."""
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(u, v, flat) for u, v in zip(a, b))
    return bool(cupy.array_equal(a.reshape(-1).view(b.dtype), b.reshape(-1)) if flat else cupy.array_equal(a, b))


def call_and_graph(timeit, call, stream) -> tuple:
    """(call us, its graph's replay alone us, the call's result): call timed by timeit, then the
    program it just ran replayed (graphs' last entry)."""
    t, out = timeit(call)
    prog = graphs.entries()[-1]  # the program of the call just timed
    g, _ = timeit(lambda: prog.shape.run(stream))
    return t * 1e6, g * 1e6, out


def spans(rows) -> list:
    """Each column of rows (one row a round) as "min-max"."""
    return [f"{min(c):6.1f}-{max(c):6.1f}" for c in zip(*rows)]


def main(settings: str = "-", formats: str = "e5m2", rounds: str = "3", n: int = 1 << 28) -> None:
    data = inputs(formats.split(","), n)
    timeit = _timer(cupy, 30)
    stream = cupy.cuda.get_current_stream()
    times, first = {}, {}
    for r in range(int(rounds)):
        for setting in settings.split(";"):
            build(setting)
            for name, (pipe, x, dtype, expect) in data.items():
                if isinstance(pipe, str):  # "many": a batch
                    encode, decode = (lambda: kvzip.compress_many(x, dtype=dtype)), kvzip.decompress_many
                else:
                    encode = (lambda: pipe.encode(x, dtype=dtype)) if pipe else (lambda: kvzip.compress(x, dtype=dtype))
                    decode = pipe.decode if pipe else kvzip.decompress
                blob = encode()
                assert _same(blob, first.setdefault(name, blob)), f"{setting} {name}: the blob differs"
                row = []
                for call in (encode, lambda: decode(blob)):
                    t, g, out = call_and_graph(timeit, call, stream)
                    row += [t, g]
                assert _same(out, expect, flat=True), f"{setting} {name}: round trip"
                times.setdefault((setting, name), []).append(row)
                print(f"round {r} {setting:<28} {name:<8} encode call {row[0]:6.1f} graph {row[1]:6.1f}"
                      f"  decode call {row[2]:6.1f} graph {row[3]:6.1f} us", flush=True)
    for (setting, name), rows in times.items():
        span = spans(rows)
        print(f"{setting:<28} {name:<8} encode call {span[0]} graph {span[1]}  decode call {span[2]} graph {span[3]} us")


if __name__ == "__main__":
    main(*sys.argv[1:4])
