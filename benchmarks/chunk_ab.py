"""Chunk sizes against each other, alternated in one process: compress and decompress of 2^28 real
values (the bench's data) per format, through splitzip_pipeline(chunk=...) (benchmarks/NOTES.md,
v23).

    python benchmarks/chunk_ab.py [FORMATS] [CHUNKS] [rounds]
    python benchmarks/chunk_ab.py e5m2,bf16 4096,8192,16384,32768 2

Each round, per format and chunk: the call and its graph replay alone (CUDA events, median of 30
after warm-up), the round trip checked, and the ratio.
"""
import sys

import cupy
from macro_ab import call_and_graph, spans

import kvzip
from kvzip.bench import _sample_bits, _timer, format_bits
from kvzip.gpu import graphs


def main(formats: str = "e5m2,bf16", chunks: str = "4096,8192,16384,32768", rounds: str = "2",
         n: int = 1 << 28) -> None:
    host = _sample_bits(n)
    timeit = _timer(cupy, 30)
    stream = cupy.cuda.get_current_stream()
    times = {}
    for fmt in formats.split(","):
        x = cupy.asarray(format_bits(fmt, host, n))
        for r in range(int(rounds)):
            for chunk in (int(c) for c in chunks.split(",")):
                pipe = kvzip.splitzip_pipeline(chunk=chunk)
                graphs.release()
                row = []
                blob = pipe.encode(x, dtype=fmt)
                for call in (lambda: pipe.encode(x, dtype=fmt), lambda: pipe.decode(blob)):
                    t, g, _ = call_and_graph(timeit, call, stream)
                    row += [t, g]
                back = pipe.decode(blob)
                assert cupy.array_equal(back.reshape(-1).view(x.dtype), x)
                ratio = x.nbytes / blob.nbytes
                times.setdefault((fmt, chunk), []).append(row)
                print(f"round {r} {fmt} chunk {chunk:6d} ratio {ratio:.5f}: encode call {row[0]:6.1f} graph {row[1]:6.1f}"
                      f"  decode call {row[2]:6.1f} graph {row[3]:6.1f} us", flush=True)
    for (fmt, chunk), rows in times.items():
        span = spans(rows)
        print(f"{fmt} chunk {chunk:6d}: encode call {span[0]} graph {span[1]}  decode call {span[2]} graph {span[3]} us")


if __name__ == "__main__":
    main(*sys.argv[1:4])
