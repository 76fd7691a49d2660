"""ChannelPack (the ratio mode, docs/format.md section 15) on a CUDA GPU: the kernels of
kvzip/gpu/kernels/channel.cu on CuPy arrays, on the current device and stream, giving the CPU
reference's bytes (stages/channel_pack_cpu.py).  CuPy is imported on first use.

    streams = encode(src, n, fmt, channels, chunk[, tables])   # src: the values' bits, 1-D CuPy array
    blob, payload = encode_blob(src, n, fmt, channels, chunk, head, checksum[, tables])
    dst, error = decode(streams, n, fmt, channels, chunk)
    [(blob, payload), ...] = encode_blobs([(src, n, fmt, channels, chunk, head, checksum, tables), ...])
    [(dst, error), ...] = decode_many([(streams, n, fmt, channels, chunk), ...])

The encoder writes a blob's payload (format.md 15.4) in place: encode_blob behind the header,
with no copy (the staged executor's way for [channel_pack, serialize] on a GPU), encode into a
payload buffer whose streams it returns as views (for Serialize, where other stages or a
version-1 header are involved).  Each call synchronises with the host once: encode reads the
three totals of the variable streams (their lengths), decode reads the error words (the
counts', and the tables', which it checks on the device: no copy of them to the host); the batch
forms (encode_blobs, decode_many) queue every tensor's kernels first and wait once for all of
them (compress_many and decompress_many of the ratio mode: kvzip/staged.py).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvzip import container, layout
from kvzip.auto_codebook import sample_plan
from kvzip.bitpack import groups
from kvzip.channel_codebook import CODE_BITS, TABLE_WIDTH, table_error_text
from kvzip.checksum import sum64
from kvzip.errors import CHANNEL_DECODE_ERRORS

from . import loader
from .launch import NO_ERROR, aligned, cupy, launch

THREADS = 256            # channel.cu's WARPS * 32 (and AUTO_RUN: a thread a sampled run value)
WARPS = THREADS // 32    # a warp a chunk
TILE_THREADS = 256       # CH_TILE_THREADS: the offsets scan's blocks
TILE = 8 * TILE_THREADS  # CH_TILE: chunks a block of the scan


def _tiles(nchunks: int) -> int:
    """The offsets scan's blocks (one even without chunks), each with three look-back words."""
    return max(1, -(-nchunks // TILE))


@lru_cache(maxsize=None)
def _names(fmt) -> dict:
    args, gpl = loader._args(fmt), loader.channel_gpl(fmt)
    return {"histogram": f"kvz_ch_histogram<{args}>", "tables": f"kvz_ch_tables<{fmt.exp_bits}>",
            "encode": f"kvz_ch_encode<{args},{gpl}>", "decode": f"kvz_ch_decode<{args},{gpl}>",
            "scan": "kvz_ch_scan", "compact": "kvz_ch_compact"}


def _launch(name, fmt, blocks, threads, args, shared=0, grid_stride=True):
    launch(loader.channel_kernel, _names(fmt)[name], blocks, threads, args, shared, grid_stride=grid_stride)


@lru_cache(maxsize=1024)
def payload_layout(n: int, fmt, channels: int, chunk: int, ns: int = 0, ne: int = 0, nh: int = 0) -> tuple:
    """({stream: (payload offset, bytes, dtype)}, payload length) of the streams of section 15.4
    (container.ratio_streams) with ns sec_codes bytes, ne escapes and nh exp_high bytes, placed by
    the layout rule (2.4), as channel_offsets.cuh's ch_payload places them on the device.
    Cached per call's arguments (a shape's layout is asked for three times a tensor): callers
    must not change the dict."""
    streams = container.ratio_streams(n, fmt, channels, chunk, ne, nh, ns)
    offsets, payload = layout.place([nb for _, _, nb in streams])
    return {name: (off, nb, dtype) for (name, dtype, nb), off in zip(streams, offsets)}, payload


@lru_cache(maxsize=256)
def payload_bound(n: int, fmt, channels: int, chunk: int) -> int:
    """The most bytes the payload can take: a chunk's variable runs never take more than its
    values' high exponent bits, (E - 3) bytes a group (format.md 15.5), so the variable streams
    together never more than (E - 3) G bytes and their four paddings."""
    return payload_layout(n, fmt, channels, chunk)[1] + (fmt.exp_bits - CODE_BITS) * groups(n) + 4 * layout.ALIGN


class _Workspace:
    """The encoder's scratch arrays carved out of one allocation, 16-byte aligned: ptr(name), the
    address of each (what the kernels take), and the allocation, kept while the kernels run."""

    def __init__(self, **nbytes):
        offsets, total = layout.place(nbytes.values())
        self.memory = cupy().empty(max(total, layout.ALIGN), cupy().uint8)
        base = self.memory.data.ptr
        self._at = {name: base + off for name, off in zip(nbytes, offsets)}
        self.result = None  # the device address of the call's 4 result words
        self.src = None     # the (aligned) values the kernels read
        self.tables = None  # a calibration's tables on the device (_on_device), where given
        self.head_tmpl = None  # the blob header's template on the device (_on_device), where given
        self.head = np.uint64(0)  # its address (0: none)

    def ptr(self, name: str):
        return np.uint64(self._at[name])


def _launch_encode(src, n: int, fmt, channels: int, chunk: int, payload: int, result=None, tables=None,
                   head: bytes | None = None) -> _Workspace:
    """Queue the encode of the n values src (1-D CuPy array of fmt's unsigned dtype) into the
    payload at device address `payload` (payload_bound bytes, 16-byte aligned): the tables from
    the values (or `tables`, the host's uint8[channels * TABLE_WIDTH] of a calibration, on the
    device once per content: _on_device), the encode, the offsets scan, then the compaction,
    on the current stream; with `head` (a version-3 header of this tensor without a payload
    checksum, any counts), the scan also writes the blob's header, counts set and sealed, in the
    len(head) bytes before the payload.  The three
    totals (sec_codes bytes, escapes, exp_high bytes: the streams' lengths, payload_layout) land
    in words 1..3 of `result` (the device address of 4 uint64; None: the workspace's own).
    Returns the workspace, which must stay alive until the stream has run the kernels."""
    cp = cupy()
    src = aligned(src)
    E, HB = fmt.exp_bits, fmt.exp_bits - CODE_BITS
    G, nchunks, gpc = groups(n), -(-n // chunk), chunk // 8
    full_cap, tiles = HB * gpc // 3, _tiles(nchunks)
    fixed = payload_layout(n, fmt, channels, chunk)[0]  # codes, rest and esc_count: placed whatever the counts
    # hist and status first, side by side: one memset zeroes both
    ws = _Workspace(status=8 * 3 * tiles, hist=4 * (channels << E), tables=TABLE_WIDTH * channels if tables is None else 0,
                    sec_count=2 * nchunks, sec_slots=4 * nchunks * (-(-CODE_BITS * chunk // 32)),
                    pos_slots=2 * nchunks * full_cap, exp_slots=nchunks * full_cap, high_slots=HB * G,
                    offsets=8 * 3 * nchunks, result=0 if result is not None else 8 * 4)
    ws.result = np.uint64(result) if result is not None else ws.ptr("result")
    ws.src = src  # kept with the workspace: an aligned copy lives as long as the kernels reading it
    at = {name: np.uint64(payload + fixed[name][0]) for name in ("codes", "rest", "esc_count")}
    stream = cp.cuda.get_current_stream().ptr
    zeroed = int(ws.ptr("hist")) + (4 * (channels << E) if tables is None else 0) - int(ws.ptr("status"))
    cp.cuda.runtime.memsetAsync(int(ws.ptr("status")), 0, zeroed, stream)  # the scan's look-back words (and hist)
    if head is not None:
        ws.head_tmpl = _on_device(head, cp.cuda.Device().id)
        ws.head = np.uint64(ws.head_tmpl.data.ptr)
    if tables is not None:
        ws.tables = _on_device(np.ascontiguousarray(tables, np.uint8).tobytes(), cp.cuda.Device().id)
        at["tables"] = np.uint64(ws.tables.data.ptr)
    else:
        at["tables"] = ws.ptr("tables")
        _launch("histogram", fmt, sample_plan(n).blocks, THREADS, (src, np.int64(n), np.int32(channels), ws.ptr("hist")))
        _launch("tables", fmt, channels, THREADS, (ws.ptr("hist"), at["tables"]))
    _launch("encode", fmt, -(-nchunks // WARPS), THREADS,
            (src, np.int64(n), np.int32(channels), at["tables"], np.int32(chunk), np.int64(nchunks), at["codes"],
             at["rest"], at["esc_count"], ws.ptr("sec_count"), ws.ptr("sec_slots"), ws.ptr("pos_slots"),
             ws.ptr("exp_slots"), ws.ptr("high_slots")), shared=channels << E)
    _scan(at["esc_count"], ws.ptr("sec_count"), nchunks, n, fmt, chunk, ws.ptr("status"), ws.ptr("offsets"), ws.result,
          head=(ws.head, np.uint64(payload - len(head))) if head is not None else None)
    _launch("compact", fmt, max(1, -(-nchunks // WARPS)), THREADS,
            (ws.ptr("sec_count"), np.int64(nchunks), np.int64(n), np.int32(chunk), np.int32(HB),
             np.int32(fmt.rest_bits), np.int32(channels), ws.ptr("offsets"), ws.ptr("sec_slots"), ws.ptr("pos_slots"),
             ws.ptr("exp_slots"), ws.ptr("high_slots"), at["tables"], ws.result, np.uint64(payload)))
    return ws


@lru_cache(maxsize=64)
def _on_device(content: bytes, device: int):
    """Bytes the kernels read, on `device`, copied up once per content: a calibration's tables
    (a ChannelCodebook never changes), a tensor shape's header template.  A copy from pageable
    memory at every call may also wait for the stream's earlier work (CUDA's API synchronisation
    notes: the driver may synchronise with the stream to stage such a copy), which would
    serialise a batch's tensors with the host."""
    cp = cupy()
    with cp.cuda.Device(device):
        out = cp.asarray(np.frombuffer(content, np.uint8))
        cp.cuda.get_current_stream().synchronize()  # in place before any stream's kernels read it
    return out


def _encode_into(src, n: int, fmt, channels: int, chunk: int, payload: int, tables=None) -> tuple[int, int, int]:
    """_launch_encode, then its one wait: returns (sec_codes bytes, escapes, exp_high bytes)."""
    cp = cupy()
    ws = _launch_encode(src, n, fmt, channels, chunk, payload, tables=tables)
    totals = np.empty(3, np.uint64)
    cp.cuda.runtime.memcpyAsync(totals.ctypes.data, int(ws.result) + 8, 24,
                                cp.cuda.runtime.memcpyDeviceToHost, cp.cuda.get_current_stream().ptr)
    cp.cuda.get_current_stream().synchronize()  # the one wait: the streams' lengths (ws is free after it)
    return tuple(int(x) for x in totals)


def encode(src, n: int, fmt, channels: int, chunk: int, tables=None) -> dict:
    """The streams of section 15.4 of the n values src (1-D CuPy array of fmt's unsigned dtype),
    as CuPy arrays: views of one payload buffer, laid out as a blob's payload.  tables: None (the
    values' own) or a calibration's tables stream (host uint8)."""
    cp = cupy()
    buf = cp.empty(payload_bound(n, fmt, channels, chunk), cp.uint8)
    totals = _encode_into(src, n, fmt, channels, chunk, buf.data.ptr, tables)
    streams = payload_layout(n, fmt, channels, chunk, *totals)[0]
    return {name: _view(buf, off, nb, dtype) for name, (off, nb, dtype) in streams.items()}


def encode_blob(src, n: int, fmt, channels: int, chunk: int, head: bytes, checksum: bool, tables=None):
    """(the blob, its payload's length) of the n values src under the version-3 header `head`
    (container.compact_header's for this tensor, any counts, its checksum field 0): the kernels
    write the payload in place behind the header and, without a checksum, the header with its
    counts set (kvz_ch_scan); with one, the host sets counts and checksum after the wait.
    The blob is a view of a buffer of payload_bound's size, as the speed mode's blobs are of
    theirs.  tables: as encode's."""
    return encode_blobs([(src, n, fmt, channels, chunk, head, checksum, tables)])[0]


SCRATCH_PER_WAIT = 256 << 20  # encode_blobs waits once per this much workspace in flight (at least a tensor)


def encode_blobs(jobs: list) -> list[tuple]:
    """encode_blob of each job (src, n, fmt, channels, chunk, head, checksum, tables), in order: every
    tensor's kernels queued one after the other on the current stream and one wait for all their
    totals (one per SCRATCH_PER_WAIT of workspace, which is held until the wait)."""
    cp = cupy()
    out, start = [], 0
    while start < len(jobs):
        results = cp.empty((len(jobs) - start, 4), cp.uint64)
        held, scratch, end = [], 0, start
        while end < len(jobs) and (end == start or scratch < SCRATCH_PER_WAIT):
            src, n, fmt, channels, chunk, head, checksum, tables = jobs[end]
            buf = cp.empty(len(head) + payload_bound(n, fmt, channels, chunk), cp.uint8)
            on_device = not checksum and len(head) == layout.COMPACT_SIZE  # else the host writes it
            ws = _launch_encode(src, n, fmt, channels, chunk, buf.data.ptr + len(head),
                                results.data.ptr + 32 * (end - start), tables, head if on_device else None)
            held.append((buf, ws, on_device))
            scratch += ws.memory.nbytes
            end += 1
        totals = results.get()  # the one wait: every tensor's streams' lengths
        for (buf, _, on_device), row, (_, n, fmt, channels, chunk, head, checksum, _) in zip(held, totals,
                                                                                              jobs[start:end]):
            ns, ne, nh = (int(x) for x in row[1:])
            H, payload = len(head), payload_layout(n, fmt, channels, chunk, ns, ne, nh)[1]
            blob = buf[:H + payload]
            if not on_device or max(ns, ne, nh) >> 32:  # a count the header cannot hold: with_counts says so
                total = sum64(cp, blob[H:]) if checksum else 0
                buf[:H].set(np.frombuffer(container.with_counts(head, ne, nh, ns, checksum=total), np.uint8))
            out.append((blob, payload))
        start = end
    return out


def _view(buf, offset: int, nbytes: int, dtype):
    dtype = np.dtype(dtype)
    return cupy().ndarray((nbytes // dtype.itemsize,), dtype, buf.data + offset)


def _scan(esc_count, sec_count, nchunks, n, fmt, chunk, status, offsets, result, checked=None, head=None):
    """kvz_ch_scan: offsets (int64[3 * nchunks]) and result (uint64[4]) of the counts (arrays or
    addresses); status: its look-back words (uint64[3 * _tiles(nchunks)], all zero or all 0xFF
    bytes).  checked (decode): (tables, channels, (sec_codes bytes, escapes, exp_high bytes)):
    the counts checked against the variable streams' lengths, the first error lowering result[0]
    from the caller's ~0, and the tables checked into result[4] (uint64[5], also ~0 before).
    head (encode): (the header template's address, where the blob's header goes): the header
    written there with the totals as its counts, sealed."""
    tables, channels, (n_sec, n_pos, n_high) = checked or (np.uint64(0), 0, (0, 0, 0))
    head_tmpl, head_at = head or (np.uint64(0), np.uint64(0))
    _launch("scan", fmt, _tiles(nchunks), TILE_THREADS,
            (esc_count, sec_count, np.int64(nchunks), np.int64(n), np.int32(chunk), np.int32(fmt.exp_bits - CODE_BITS),
             np.int32(checked is not None), np.int64(n_sec), np.int64(n_pos), np.int64(n_high), tables,
             np.int32(channels), status, offsets, result, head_tmpl, head_at),
            grid_stride=False)


def decode(s: dict, n: int, fmt, channels: int, chunk: int):
    """(the n values' bits as a CuPy array, None or the FormatError's message) of the streams s
    (CuPy arrays whose dtypes and the lengths n implies the caller has checked: ChannelPack.check
    without its tables, which the scan checks on the device)."""
    return decode_many([(s, n, fmt, channels, chunk)])[0]


def decode_many(jobs: list) -> list[tuple]:
    """decode of each job (streams, n, fmt, channels, chunk), in order: every tensor's kernels
    queued one after the other on the current stream, one wait for all their error words."""
    cp = cupy()
    nchunks = [s["esc_count"].shape[0] for s, *_ in jobs]
    # One allocation of uint64 words: each job's result (5: _scan's), then each job's look-back
    # words, both filled with 0xFF bytes by one memset (the error words' ~0, the look-back's
    # "unpublished"), then each job's offsets.
    status_at = 5 * len(jobs) + np.concatenate([[0], np.cumsum([3 * _tiles(c) for c in nchunks])])
    offsets_at = int(status_at[-1]) + np.concatenate([[0], np.cumsum([3 * c for c in nchunks])])
    words = cp.empty(int(offsets_at[-1]), cp.uint64)
    cp.cuda.runtime.memsetAsync(words.data.ptr, 0xFF, 8 * int(status_at[-1]), cp.cuda.get_current_stream().ptr)
    results = words[:5 * len(jobs)].reshape(len(jobs), 5)
    dsts = []
    for k, (s, n, fmt, channels, chunk) in enumerate(jobs):
        s = {name: aligned(a) for name, a in s.items()}
        result = results[k]
        status = words[status_at[k]:status_at[k + 1]]
        offsets = words[offsets_at[k]:offsets_at[k + 1]]
        _scan(s["esc_count"], s["sec_count"], nchunks[k], n, fmt, chunk, status, offsets, result,
              (s["tables"], channels, (s["sec_codes"].shape[0], s["esc_pos"].shape[0], s["exp_high"].shape[0])))
        dst = cp.empty(n, fmt.uint_dtype)
        _launch("decode", fmt, -(-nchunks[k] // WARPS), THREADS,
                (s["codes"], s["rest"], s["tables"], np.int32(channels), s["esc_count"], s["sec_count"], offsets,
                 s["sec_codes"], s["esc_pos"], s["esc_exp"], s["exp_high"], np.int64(n), np.int32(chunk),
                 np.int64(nchunks[k]), result, dst))
        dsts.append(dst)
    rows = results.get()  # the one wait
    return [(dst, _error(int(row[0]), int(row[4]), fmt)) for dst, row, (_, _, fmt, _, _) in zip(dsts, rows, jobs)]


def _error(counts: int, tables: int, fmt) -> str | None:
    """The FormatError message of a decode's error words (the tables' first, as the CPU path
    checks them first), or None."""
    if tables != NO_ERROR:
        return table_error_text(tables, fmt)
    return None if counts == NO_ERROR else CHANNEL_DECODE_ERRORS[counts % 8]
