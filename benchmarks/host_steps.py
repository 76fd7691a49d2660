"""What each host step of a fast-path call costs, timed alone in a loop (development aid).

    python benchmarks/host_steps.py [log2_values]     # default: 28

host_phases.py says how much of a call's wall time is Python ahead of the graph launch and after
its wait; this splits that time into the steps kvzip.decompress and kvzip.compress take on the
full fast path (kvzip/execution.py: decode, encode; a call not like the thread's last, which
the shortcuts of v22 skip), each run 2000 times in a loop (median of five such loops, less the
cost of an empty call), on a CuPy caller's BF16 tensor and its blob.  Then whole calls with the
graph's launch and wait stubbed out, repeated (the shortcuts) and on the full path: the steps
alone in a loop add up to about half of the whole path's time (v22's first measurement).
"""
import sys
import time

import cupy
import numpy as np

import kvzip
from kvzip import api, arrays, execution
from kvzip.backends import get_backend
from kvzip.bench import _sample_bits
from kvzip.gpu import graphs, programs, layout_cache


def cost_us(step, n=2000) -> float:
    """Median over five loops of n calls of step(), in microseconds a call."""
    loops = []
    for _ in range(5):
        t = time.perf_counter_ns()
        for _ in range(n):
            step()
        loops.append((time.perf_counter_ns() - t) / n / 1e3)
    return float(np.median(loops))


def report(title, steps) -> None:
    empty = cost_us(lambda: None)
    print(title, flush=True)
    total = 0.0
    for name, step in steps:
        us = cost_us(step) - empty
        total += us
        print(f"  {name:<44} {us:6.2f} us", flush=True)
    print(f"  {'sum':<44} {total:6.2f} us", flush=True)


def decode_steps(blob) -> list:
    u8, origin = arrays.import_bytes(blob)
    be = get_backend("cuda")
    layout = layout_cache.guess(u8.shape[0])
    pair = layout_cache._fused_dequantize((layout,), (u8,))
    views = layout_cache._views((layout,), pair, origin)
    prog, stream = programs.decode_program(layout.fmt, layout.chunk, (layout.n,), None, (layout.key,))
    out = arrays.ResultBuffer(prog.out_bytes, origin)
    staged, ptr = prog.shape.staged, u8.data.ptr

    def stage_row():
        for i, relative in enumerate(prog.row_streams):
            staged[i] = relative + ptr
        staged[9] = prog.out_offset + out.ptr
        staged[prog.heads_at] = ptr
        staged[prog.heads_at + 1] = u8.shape[0]

    def context():
        with origin.stream_context():
            pass

    got = views(out, prog.offsets)
    return [
        ("arrays.import_bytes", lambda: arrays.import_bytes(blob)),
        ("backends.get_backend", lambda: get_backend("cuda")),
        ("origin.stream_context (enter, exit)", context),
        ("the alignment check", lambda: type(u8) is arrays.cupy_ndarray() and not arrays.aligned(u8)),
        ("programs.applicable", lambda: programs.applicable(be, 0, u8)),
        ("layout_cache.guess", lambda: layout_cache.guess(u8.shape[0])),
        ("layout_cache._fused_dequantize", lambda: layout_cache._fused_dequantize((layout,), (u8,))),
        ("layout_cache._views", lambda: layout_cache._views((layout,), pair, origin)),
        ("programs.decode_program (device, stream, key)",
         lambda: programs.decode_program(layout.fmt, layout.chunk, (layout.n,), None, (layout.key,))),
        ("arrays.ResultBuffer", lambda: arrays.ResultBuffer(prog.out_bytes, origin)),
        ("run_one: staged addresses", stage_row),
        ("-- between launch and wait: views", lambda: views(out, prog.offsets)),
        ("-- after the wait: the error word", lambda: int(prog.shape.down64[1])),
        ("-- after the wait: layout_cache._note", lambda: layout_cache._note(layout)),
        ("-- after the wait: layout_cache._handed_out",
         lambda: layout_cache._handed_out([got[0]], [u8], (layout,), pair, views, origin)),
    ]


def encode_steps(x) -> list:
    bits, fmt, shape, origin = arrays.import_tensor(x, "bf16")
    be = get_backend("cuda")
    pipe = api._default(None, False, api.DEFAULT_CHUNK)
    lane = execution.encoder(pipe, fmt, shape, be, origin).lane_for(bits)
    device, stream = programs._current()
    prog = programs._encode_program((lane.plan,), lane, device)
    buffer = arrays.ResultBuffer(prog.total, origin)
    staged, ptr = prog.shape.staged, bits.data.ptr

    def stage_addresses():
        staged[0] = ptr
        for at, relative in prog.one:
            staged[at] = relative + buffer.ptr

    def context():
        with origin.stream_context():
            pass

    places = buffer.places(prog.starts)

    def blobs():
        payloads = prog.shape.down64[2:3].tolist()
        return buffer.blobs(prog.starts, [prog._blob_length(t, p) for t, p in enumerate(payloads)], places)

    return [
        ("arrays.import_tensor", lambda: arrays.import_tensor(x, "bf16")),
        ("backends.get_backend", lambda: get_backend("cuda")),
        ("origin.stream_context (enter, exit)", context),
        ("api._default", lambda: api._default(None, False, api.DEFAULT_CHUNK)),
        ("execution.encoder + lane_for", lambda: execution.encoder(pipe, fmt, shape, be, origin).lane_for(bits)),
        ("programs._current", programs._current),
        ("programs._encode_program", lambda: programs._encode_program((lane.plan,), lane, device)),
        ("arrays.ResultBuffer", lambda: arrays.ResultBuffer(prog.total, origin)),
        ("launch: staged addresses", stage_addresses),
        ("-- between launch and wait: buffer.places", lambda: buffer.places(prog.starts)),
        ("-- after the wait: lengths and blobs", blobs),
    ]


def stubbed_call_us(call) -> float:
    """A whole call's host cost with the graph's launch and wait stubbed out (the wait hands back
    the last call's download: no error), in a loop: the steps above as one path."""
    launch, wait = graphs.CallShape.launch, graphs.CallShape.wait
    graphs.CallShape.launch = lambda self, stream: None
    graphs.CallShape.wait = lambda self, stream: self.host_down
    try:
        return cost_us(call) - cost_us(lambda: None)
    finally:
        graphs.CallShape.launch, graphs.CallShape.wait = launch, wait


def main(argv) -> None:
    log2 = int(argv[0]) if argv else 28
    x = cupy.asarray(_sample_bits(1 << log2))
    blob = kvzip.compress(x, dtype="bf16")
    kvzip.compress(x, dtype="bf16")
    kvzip.decompress(blob)
    kvzip.decompress(blob)  # the layout guessed, the program cached: the steps below are the usual call's
    report(f"decompress, BF16 2^{log2}, a CuPy blob", decode_steps(blob))
    report(f"compress, BF16 2^{log2}, a CuPy array", encode_steps(x))
    for label, forget in (("repeated (the shortcuts)", False), ("the full path (kept calls dropped)", True)):
        def again(call, name):
            if forget:
                return lambda: (graphs.remember(name, None), call())
            return call
        d = stubbed_call_us(again(lambda: kvzip.decompress(blob), "decode"))
        e = stubbed_call_us(again(lambda: kvzip.compress(x, dtype="bf16"), "encode"))
        print(f"whole calls, launch and wait stubbed, {label}: decompress {d:.2f} us, compress {e:.2f} us", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
