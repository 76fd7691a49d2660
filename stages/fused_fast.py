"""The fast GPU path of the fused split/pack/escape step: CUDA C++ kernels (fused_fast.cu) run
through CuPy on the caller's stream, writing container blobs in place.

Used on a real GPU (not under the simulator) for every format and chunk size; the Numba kernels
in stages/fused.py remain the generic path (simulator, misaligned buffers) and, with the CPU
twin, the reference these kernels are tested against byte for byte (tests/gpu).

Every call is batched: a list of tensors costs the same launches as one tensor.  Encoding is one
memset, three kernels (dense pass, scan and escape placement, header) and one read-back of the
escape totals (the host synchronisation that learns the compressed sizes); the headers are
written on the GPU.  Decoding reads the headers back once, runs two kernels (scan, dense pass)
and reads back the validation result.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from importlib.resources import files

import numpy as np

from kvzip import container
from kvzip.bitpack import groups
from kvzip.errors import FormatError
from kvzip.frame import Frame

from .fused import _ERRORS
from .top16_pack import codebook_meta

ENABLED = True          # tests switch this off to exercise the Numba-CUDA kernels on a real GPU
WARPS = 8
THREADS = WARPS * 32
MAX_VALUES = 1 << 33    # the look-back packs escape and group totals into 31 bits each
BLOB_ALIGN = 256        # blobs of a batch start on 256-byte boundaries of one buffer
HEAD_SPAN = 4096        # bytes read back per blob to parse its header (more only if it is longer)
_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int"}
_ESCAPE_STREAMS = ["esc_pos", "esc_exp", "exp_high"]
SB_CHUNKS = 256         # chunks per block of kvz_scan (one thread each)

# Shape of the dense kernels per value width in bytes: (groups a lane handles per step, blocks per
# multiprocessor the register budget must allow).  Picked on the H200 with
# benchmarks/sweep_shapes.py and ncu (benchmarks/NOTES.md, v5).
ENCODE_SHAPE = {1: (4, 4), 2: (4, 3), 4: (1, 4)}
DECODE_SHAPE = {1: (4, 3), 2: (4, 3), 4: (1, 4)}


def _instances(fmt):
    """The kernel names of one format: encode, encode-side scan, decode-side scan, decode."""
    args = f"{fmt.exp_bits},{fmt.mant_bits},{_TYPES[fmt.itemsize]}"
    eg, eb = ENCODE_SHAPE[fmt.itemsize]
    dg, db = DECODE_SHAPE[fmt.itemsize]
    return (f"kvz_encode<{args},{eg},{eb}>", f"kvz_scan<{args},EncodeJob>", f"kvz_scan<{args},DecodeJob>",
            f"kvz_decode<{args},{dg},{db}>")


def slot_size(chunk: int) -> int:
    """Escapes kvz_encode keeps per chunk for kvz_scan to place (3 % of the chunk, at least 128:
    on the shipped real KV 0.15 % of 4096-value chunks hold 65 to 68); a chunk with more is
    collected again from the input by one warp, which showed as a 20 us tail in the scan."""
    return max(128, chunk // 32)


@lru_cache(maxsize=None)
def _module(device_id: int, names: tuple):
    import cupy

    source = files("kvzip.stages").joinpath("fused_fast.cu").read_text()
    return cupy.RawModule(code=source, options=("-std=c++17", "-lineinfo"), name_expressions=list(names))


_kernels: dict = {}


def _kernel(name: str, device_id: int):
    k = _kernels.get((name, device_id))
    if k is None:
        from kvzip.formats import FORMATS

        names = tuple(x for fmt in FORMATS.values() for x in _instances(fmt)) + ("kvz_finish_encode", "kvz_gather_heads")
        k = _kernels[(name, device_id)] = _module(device_id, names).get_function(name)
    return k


@lru_cache(maxsize=None)
def _grid_cap(name: str, device_id: int) -> int:
    """Blocks that keep every multiprocessor full (the dense kernels loop over chunks)."""
    import cupy

    k = _kernel(name, device_id)
    per_sm = max(1, min(8, 65536 // max(1, k.num_regs * THREADS)))
    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"] * per_sm


@lru_cache(maxsize=64)
def _device_lut(fmt_name: str, exponents: tuple, device_id: int) -> int:
    """Device address of the encode LUT (kept alive by the cache)."""
    import cupy

    from kvzip.codebook import Codebook

    lut = Codebook(exponents, fmt_name).encode_lut()
    lut[lut == 255] = 0x80  # the kernels' ESC_FLAG: code bits 0, escape bit 7
    with cupy.cuda.Device(device_id):
        arr = cupy.asarray(lut)
    _keep.append(arr)
    return arr.data.ptr


_keep: list = []
_local = threading.local()
P = np.uint64  # kernel pointer arguments travel as 64-bit integers: CuPy marshals those cheaply


class _Call:
    """The host side of one batched call on the current device and stream.

    Every call needs a few small tables on the device, a zeroed counter region and some
    scratch.  They come from one device buffer per thread and device, kept between calls and
    grown when a call needs more (each call ends with a host synchronisation on its stream, so
    the buffer is idle when the next call starts), and the tables go up with one asynchronous
    copy from pinned memory.  Kernels get raw addresses: building CuPy views and passing arrays
    cost ~4 and ~10 us each, which made the host the bottleneck below 64 MiB (NOTES.md, v3)."""

    def __init__(self, sizes: list[int]):
        import cupy

        self.cupy = cupy
        self.device = cupy.cuda.runtime.getDevice()
        self.stream = cupy.cuda.get_current_stream()
        self.offsets, at = [], 0
        for nb in sizes:
            self.offsets.append(at)
            at += -(-max(nb, 1) // 256) * 256
        pool = getattr(_local, "buffers", None)
        if pool is None:
            pool = _local.buffers = {}
        buf = pool.get(self.device)
        if buf is None or buf.nbytes < at:
            pool[self.device] = None  # free the old one first
            buf = pool[self.device] = cupy.empty(max(at, 1 << 20), np.uint8)
        self.base = buf.data.ptr
        self.sizes = sizes

    def ptr(self, i: int) -> int:
        return self.base + self.offsets[i]

    def upload(self, tables: list[np.ndarray]) -> None:
        """Copy tables into regions 0..len(tables)-1 (one host-to-device copy)."""
        from kvzip.backends import get_backend

        end = self.offsets[len(tables) - 1] + tables[-1].nbytes
        host = get_backend("cuda").pinned(end)
        for t, o in zip(tables, self.offsets):
            host[o:o + t.nbytes] = t.reshape(-1).view(np.uint8)
        self.cupy.cuda.runtime.memcpyAsync(self.base, host.ctypes.data, end, 1, self.stream.ptr)

    def zero(self, i: int) -> None:
        self.cupy.cuda.runtime.memsetAsync(self.ptr(i), 0, self.sizes[i], self.stream.ptr)

    def launch(self, name: str, grid, args) -> None:
        grid = grid if isinstance(grid, tuple) else (grid,)
        _kernel(name, self.device)(grid, (THREADS,), args, stream=self.stream)

    def chunk_grid(self, name: str, total_chunks: int) -> int:
        return min(math.ceil(total_chunks / WARPS), _grid_cap(name, self.device))

    def read_back(self, i: int, nbytes: int) -> np.ndarray:
        """The first nbytes of region i, once the stream gets there (the host waits)."""
        from kvzip.backends import get_backend

        host = get_backend("cuda").pinned(nbytes)
        self.cupy.cuda.runtime.memcpyAsync(host.ctypes.data, self.ptr(i), nbytes, 2, self.stream.ptr)
        self.stream.synchronize()
        return host[:nbytes].copy()


def release_workspace() -> None:
    """Free this thread's cached device workspace (it is rebuilt by the next call)."""
    _local.buffers = {}


def _aligned(a) -> bool:
    return a.data.ptr % 16 == 0


def applicable(backend, n: int = 0, src=None) -> bool:
    """True on a real GPU for a tensor of n values the kernels' counters hold, with src (when
    given) 16-byte aligned."""
    if not ENABLED or backend.name != "cuda" or backend.simulated or n >= MAX_VALUES:
        return False
    return src is None or _aligned(src)


def decode_applicable(frame: Frame) -> bool:
    return applicable(frame.backend, frame.n) and all(_aligned(frame.streams[k]) for k in ("codes", "rest")
                                                      if k in frame.streams)


# ----------------------------------------------------------------------------- encode
@dataclass
class EncodedBatch:
    """Blobs of one encode call, back to back in one device buffer."""

    buffer: object                # cupy uint8 array
    starts: np.ndarray            # byte offset of each blob in buffer
    lengths: np.ndarray           # byte length of each blob
    payload_lengths: np.ndarray

    def blob(self, i: int):
        s = int(self.starts[i])
        return self.buffer[s:s + int(self.lengths[i])]


def _stream_table(n, fmt, nchunks, others, ne, nh):
    """[(name, dtype, nbytes)] in payload order for a fused encode."""
    G = groups(n)
    sizes = {"codes": 4 * G, "rest": fmt.rest_bits * G, "esc_count": 2 * nchunks, "esc_pos": 2 * ne, "esc_exp": ne,
             "exp_high": nh, **{k: v.nbytes for k, v in others.items()}}
    dtypes = {"codes": "uint8", "rest": "uint8", "esc_count": "uint16", "esc_pos": "uint16", "esc_exp": "uint8",
              "exp_high": "uint8", **{k: v.dtype.name for k, v in others.items()}}
    table = [(k, dtypes[k], sizes[k]) for k in container.canonical_order(sizes)]
    if [d[0] for d in table[-3:]] != _ESCAPE_STREAMS:
        raise AssertionError("container.STREAM_ORDER must end with the escape streams")
    return table


@dataclass(frozen=True)
class _Plan:
    """Everything about one tensor's blob that does not depend on its values: the header
    template, stream offsets, padding ranges.  Cached, so a serving loop that compresses the
    same shapes over and over pays for it once."""

    n: int
    G: int
    nchunks: int
    header: bytes
    table: tuple
    off: dict
    nxt: dict
    pads: tuple
    table_at: int
    blob_bytes: int          # worst-case blob size (BLOB_ALIGN-rounded)
    exp_bytes: int           # scratch for esc_exp
    high_bytes: int          # scratch for exp_high


_plans: dict = {}


def _plan(frame: Frame, fmt, cb, chunk: int, flags: int, pipeline_key: str) -> _Plan:
    others = tuple((k, a.dtype.name, a.nbytes) for k, a in frame.streams.items() if k != "data")
    meta = frame.meta
    key = (fmt.name, frame.n, tuple(meta["shape"]), meta["dtype"], chunk, flags, cb.exponents, cb.name,
           pipeline_key, repr(meta.get("quantize_fp8")), others)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    n = frame.n
    G, HB = groups(n), fmt.high_exp_bits
    nchunks = -(-n // chunk)
    full = dict(meta)
    full["codebook"] = codebook_meta(cb)
    table = _stream_table(n, fmt, nchunks, {k: frame.streams[k] for k, _, _ in others}, 0, 0)
    header = container.build_header(full, table, flags)
    offsets, _ = container.layout([d[2] for d in table])
    off = {d[0]: o for d, o in zip(table, offsets)}
    nxt = {d[0]: offsets[j + 1] if j + 1 < len(offsets) else None for j, d in enumerate(table)}
    size = {d[0]: d[2] for d in table}
    pads = tuple(x for k in ("codes", "rest", "esc_count") for x in (off[k] + size[k], nxt[k]))
    plan = _Plan(n, G, nchunks, header, tuple(table), off, nxt, pads,
                 container.PREFIX.size + 16 * (len(table) - 3),  # esc_pos's entry; esc_exp, exp_high follow
                 -(-(len(header) + off["esc_pos"] + HB * G + 48) // BLOB_ALIGN) * BLOB_ALIGN,
                 HB * G // 3 + 1, HB * G + 1)
    if len(_plans) > 4096:
        _plans.clear()
    _plans[key] = plan
    return plan


_config_keys: dict = {}


def _config_key(config) -> str:
    """repr of a pipeline config, remembered by identity (pipelines hand out one config object;
    the entry keeps it alive so its id stays unique)."""
    hit = _config_keys.get(id(config))
    if hit is None or hit[0] is not config:
        if len(_config_keys) > 256:
            _config_keys.clear()
        hit = _config_keys[id(config)] = (config, repr(config))
    return hit[1]


def encode_batch(frames: list[Frame], top16, chunk: int, checksum: bool) -> EncodedBatch:
    """Encode tensor frames of one format straight into container blobs (Serialize included)."""
    import cupy

    fmt = frames[0].format
    cb = top16.codebook_for(fmt)
    HB = fmt.high_exp_bits
    flags = container.FLAG_CHECKSUM if checksum else 0
    k = len(frames)
    plans, srcs = [], []
    for frame in frames:
        plans.append(_plan(frame, fmt, cb, chunk, flags, _config_key(frame.meta.get("pipeline"))))
        srcs.append(frame.expect("data", fmt.uint_dtype, frame.n))
    templates = {}
    for p in plans:
        templates.setdefault(p.header, sum(len(h) for h in templates))
    starts = list(accumulate((p.blob_bytes for p in plans), initial=0))
    chunk_base = list(accumulate((p.nchunks for p in plans), initial=0))
    sb_base = list(accumulate((-(-p.nchunks // SB_CHUNKS) for p in plans), initial=0))
    exp_at = list(accumulate((p.exp_bytes for p in plans), initial=0))
    high_at = list(accumulate((p.high_bytes for p in plans), initial=0))
    total_chunks, total_sb, slot = chunk_base[-1], sb_base[-1], slot_size(chunk)

    buffer = cupy.empty(max(starts[-1], 1), np.uint8)
    tmpl_host = np.frombuffer(b"".join(templates), np.uint8)
    # Workspace: encode jobs | finish jobs | templates | zeroed work | sizes | esc_exp and exp_high
    # scratch | escape slots.  The tables hold device addresses inside it, so it is laid out first.
    sizes_nb, work_nb = 24 * k, 8 * (1 + k + total_sb)
    ws = _Call([96 * k, 112 * k, tmpl_host.nbytes, work_nb, sizes_nb, exp_at[-1], high_at[-1],
                2 * total_chunks * slot, total_chunks * slot])
    tmpl_ptr, exp_ptr, high_ptr, base = ws.ptr(2), ws.ptr(5), ws.ptr(6), buffer.data.ptr
    slot_pos, slot_exp = ws.ptr(7), ws.ptr(8)
    enc_rows, fin_rows = [], []
    for i, (p, src) in enumerate(zip(plans, srcs)):
        blob_at = base + starts[i]
        pay = blob_at + len(p.header)
        e_at, h_at = exp_ptr + exp_at[i], high_ptr + high_at[i]
        enc_rows.append((src.data.ptr, p.n, pay + p.off["codes"], pay + p.off["rest"], pay + p.off["esc_count"],
                         pay + p.off["esc_pos"], e_at, h_at, slot_pos + 2 * slot * chunk_base[i],
                         slot_exp + slot * chunk_base[i], chunk_base[i], sb_base[i]))
        fin_rows.append((blob_at, tmpl_ptr + templates[p.header], len(p.header), p.table_at, e_at, h_at,
                         p.off["esc_pos"], *p.pads, 0 if checksum else 1))
        for name, a in frames[i].streams.items():  # small streams ahead of the codes (QuantizeFP8's scales)
            if name != "data":
                flat = a.reshape(-1).view(np.uint8)
                region = buffer[starts[i] + len(p.header) + p.off[name]: starts[i] + len(p.header) + p.nxt[name]]
                region[:flat.shape[0]] = flat
                region[flat.shape[0]:] = 0
    ws.upload([np.array(enc_rows, np.uint64), np.array(fin_rows, np.uint64), tmpl_host])
    ws.zero(3)
    enc_dev, fin_dev, work, sizes = P(ws.ptr(0)), P(ws.ptr(1)), P(ws.ptr(3)), P(ws.ptr(4))

    enc, scan, _, _ = _instances(fmt)
    if total_chunks:
        lut = P(_device_lut(fmt.name, cb.exponents, ws.device))
        ws.launch(enc, ws.chunk_grid(enc, total_chunks), (enc_dev, np.int32(k), np.int64(total_chunks), np.int32(chunk),
                                                          np.int32(slot), lut))
        ws.launch(scan, total_sb, (enc_dev, np.int32(k), np.int32(chunk), np.int32(slot), lut, work, work))
    # Enough blocks that copying the escapes (~0.1 % of values) is not latency-bound on one SM's worth.
    ws.launch("kvz_finish_encode", (max(1, min(128, total_chunks // 64)), k), (fin_dev, work, np.int32(k), np.int32(HB), sizes))
    # The one host synchronisation: the escape totals fix each blob's length.
    got = ws.read_back(4, sizes_nb).view(np.uint64).reshape(k, 3).astype(np.int64)
    header_lens = np.array([len(p.header) for p in plans], np.int64)
    lengths = header_lens + got[:, 2]
    if checksum:  # the payload is final: hash it and write the header from the host
        from kvzip.checksum import sum64

        for i, (p, frame) in enumerate(zip(plans, frames)):
            s, h = int(starts[i]), int(header_lens[i])
            digest = sum64(cupy, buffer[s + h: s + int(lengths[i])])
            others = {k: a for k, a in frame.streams.items() if k != "data"}
            meta = dict(frame.meta)
            meta["codebook"] = codebook_meta(cb)
            table = _stream_table(p.n, fmt, p.nchunks, others, int(got[i, 0]), int(got[i, 1]))
            buffer[s:s + h].set(np.frombuffer(container.build_header(meta, table, flags, digest), np.uint8))
    return EncodedBatch(buffer, np.array(starts[:-1], np.int64), lengths, got[:, 2])


# ----------------------------------------------------------------------------- decode
def read_heads(blobs) -> list[bytes]:
    """The first bytes of each blob (enough for its header) with one device-to-host copy."""
    k = len(blobs)
    jobs = np.array([(b.data.ptr, b.shape[0]) for b in blobs], np.uint64).reshape(k, 2)
    ws = _Call([jobs.nbytes, k * HEAD_SPAN])
    ws.upload([jobs])
    ws.launch("kvz_gather_heads", (4, k), (P(ws.ptr(0)), np.int32(HEAD_SPAN), P(ws.ptr(1))))
    host = ws.read_back(1, k * HEAD_SPAN)
    heads = []
    for i, b in enumerate(blobs):
        head = host[i * HEAD_SPAN: i * HEAD_SPAN + min(HEAD_SPAN, b.shape[0])].tobytes()
        if len(head) >= container.PREFIX.size:  # a header longer than the span: fetch it whole
            header_len = int.from_bytes(head[12:16], "little")
            if HEAD_SPAN < header_len <= min(container.MAX_HEADER, b.shape[0]):
                head = b[:header_len].get().tobytes()
        heads.append(head)
    return heads


def decode_batch(frames: list[Frame], chunk: int, codebooks: list) -> list:
    """Decode the fused streams of frames of one format and chunk size (already checked by
    FusedSplitPackEscape.check); returns raw-bit arrays.  Per-chunk counts, positions and totals
    are validated by the kernel, which reports the first problem of each blob."""
    import cupy

    fmt = frames[0].format
    k = len(frames)
    rows, plans, out_at, chunk_base, sb_base = [], [], 0, 0, 0
    for frame, cb in zip(frames, codebooks):
        n = frame.n
        st = frame.streams
        dlo, dhi = _dlut_words(cb)
        rows.append((st["codes"].data.ptr, st["rest"].data.ptr, st["esc_count"].data.ptr, st["esc_pos"].data.ptr,
                     st["esc_exp"].data.ptr, st["exp_high"].data.ptr, n, st["esc_pos"].shape[0],
                     st["exp_high"].shape[0], out_at, dlo, dhi, chunk_base, sb_base))
        plans.append((out_at, n))
        out_at += -(-n * fmt.itemsize // BLOB_ALIGN) * BLOB_ALIGN
        nchunks = -(-n // chunk)
        chunk_base += nchunks
        sb_base += -(-nchunks // SB_CHUNKS)
    out = cupy.empty(max(out_at, 1), np.uint8)
    jobs = np.array(rows, np.uint64).reshape(k, 14)
    jobs[:, 9] += np.uint64(out.data.ptr)
    ws = _Call([jobs.nbytes, 8 * (1 + k + sb_base), 8 * chunk_base])
    ws.upload([jobs])
    ws.zero(1)
    table, work, chunk_off = P(ws.ptr(0)), P(ws.ptr(1)), P(ws.ptr(2))
    _, _, scan, dec = _instances(fmt)
    if chunk_base:
        ws.launch(scan, sb_base, (table, np.int32(k), np.int32(chunk), np.int32(0), P(0), work, chunk_off))
        ws.launch(dec, ws.chunk_grid(dec, chunk_base), (table, np.int32(k), np.int64(chunk_base), np.int32(chunk),
                                                        chunk_off, work))
    # The validation result: the tensor errors after the work counter.
    errors = ws.read_back(1, 8 * (1 + k)).view(np.uint64)[1:]
    bad = np.nonzero(errors)[0]
    if bad.size:
        i = int(bad[0])
        where = f"blob {i}: " if k > 1 else ""
        raise FormatError(where + _ERRORS.get(int(errors[i]), f"decode error {int(errors[i])}"))
    return [cupy.ndarray((n,), fmt.uint_dtype, out.data + at) for at, n in plans]


@lru_cache(maxsize=256)
def _dlut_words_cached(exponents: tuple) -> tuple[int, int]:
    lo = sum(int(e) << (8 * i) for i, e in enumerate(exponents[:8]))
    hi = sum(int(e) << (8 * i) for i, e in enumerate(exponents[8:]))
    return lo, hi


def _dlut_words(cb) -> tuple[int, int]:
    """The codebook as two 64-bit words: code c -> byte c (the decode kernels' lookup table)."""
    return _dlut_words_cached(tuple(cb.exponents))
