"""The fast GPU path of the fused split/pack/escape step: CUDA C++ kernels (kernels/fused.cu) run
through CuPy on the caller's stream, writing container blobs in place.

Used on a real GPU (not under the simulator) for every format and chunk size; the Numba kernels
in stages/fused.py remain the generic path (simulator, misaligned buffers) and, with the CPU
twin, the reference these kernels are tested against byte for byte (tests/gpu).

Every call is batched: a list of tensors costs the same launches as one tensor.  Encoding is a
table upload (which also zeroes the kernels' counters), two kernels (the dense pass, which also
sums the escapes; the scan, which places them and writes each blob's padding and header) and one
read-back of the escape totals (the host synchronisation that learns the compressed sizes).
Decoding blobs of a layout decoded before uploads its table and runs two kernels: the scan, whose
first blocks check each header against the guessed layout and fill in its escape fields, and the
dense pass; one read-back returns the validation result.  Blobs of unknown layouts (or a wrong
guess) have their headers read back once first (with what kvz_check_heads found of each: CRC,
escape-table arithmetic, lengths).  Each such sequence is
a program cached per call shape and replayed as one CUDA graph (kvzip/gpu/graphs.py); the job
tables keep every address that does not move between calls.  In the graph each kernel is the
programmatic dependent of the one before (kvzip/gpu/dependent_launch.py): resident before that one
ends, and, for kvz_decode, decoding each warp's first chunk while the scan still runs.

QuantizeFP8 with one scale per tensor can ride inside: a quantizing encode program (one tensor)
takes the 16-bit input, runs quantize_kernels's amax and table kernels, and kvz_encode<..., QT>
turns each value into its FP8 code as it loads; a dequantizing decode program builds each blob's
256-entry table from its scale and kvz_decode<..., DQ> stores 16-bit values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import numpy as np

from kvzip import container, layout
from kvzip.auto_codebook import sample_plan
from kvzip.bitpack import groups
from kvzip.codebook import codebook_meta
from kvzip.errors import FormatError, decode_error_text
from kvzip.formats import FORMATS
from kvzip.frame import Frame

from . import graphs, loader, quantize_kernels, tuning
from .abi import (AMAX_ARGS, AUTO_CODEBOOK_ARGS, CHECK_HEADS_ARGS, CHECKS, DECODE, DECODE_ARGS, DEQUANT_TABLES_ARGS,
                  ENCODE, ENCODE_ARGS, FINISH, GATHER_HEADS_ARGS, HEADS, QUANT_TABLE_ARGS, SCAN_ARGS, SIZES, aligned)
from .results import allocate
from .graphs import Region as R
from .tuning import tuning_for

ENABLED = True          # tests switch this off to exercise the Numba-CUDA kernels on a real GPU
WARPS = 8
THREADS = WARPS * 32
MAX_VALUES = 1 << 33    # the look-back packs escape and group totals into 31 bits each
BLOB_ALIGN = 256        # blobs of a batch start on 256-byte boundaries of one buffer
HEAD_SPAN = 2048        # bytes read back per blob to parse its header (more only if it is longer;
                        # the default pipelines' headers are 624 to 848 bytes;
                        # kvz_check_heads stages at most 4096 in shared memory)
SB_CHUNKS = 256         # chunks per block of kvz_scan (one thread each)
QUEUE_WORDS = 128       # work words of the dense kernels' chunk queues (common.cuh's QUEUE_WORDS)
# The tunables (kernel shapes, queue and check knobs, the decode tail's split, the early return of
# encode calls and the early verdict of decode calls) are per format in kvzip/gpu/tuning.py;
# benchmarks change them through tuning.override().


def slot_size(chunk: int, fmt_name: str) -> int:
    """Entries of kvz_encode's per-chunk escape slot (2-byte position, 1-byte exponent each):
    a third of the chunk's high exponent bytes (HB a group), rounded up to 16, so every chunk
    that is not plane-coded fits its escapes in the slot, and a plane-coded chunk's high bytes
    fit in its 3 * slot bytes, where kvz_encode leaves them for kvz_scan to place (encode.cu)."""
    return -(-FORMATS[fmt_name].high_exp_bits * (chunk // 8) // 48) * 16


_kernels: dict = {}


def _kernel(name: str, device_id: int):
    k = _kernels.get((name, device_id))
    if k is None:
        k = _kernels[(name, device_id)] = loader.fused_kernel(name, device_id)
    return k


@lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


@lru_cache(maxsize=None)
def _grid_cap(name: str, device_id: int) -> int:
    """Blocks that keep every multiprocessor full (the dense kernels loop over chunks)."""
    k = _kernel(name, device_id)
    per_sm = max(1, min(8, 65536 // max(1, k.num_regs * THREADS)))
    return _sm_count(device_id) * per_sm


tuning.on_change(lambda: (_kernels.clear(), _grid_cap.cache_clear()))


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
P = np.uint64  # kernel pointer arguments travel as 64-bit integers: CuPy marshals those cheaply


GROUPS_MASK = (1 << 31) - 1  # kvz_encode's totals: escapes << 31 | plane-coded groups (encode.cu)
VALUE_MASK = (1 << 62) - 1   # the totals below the ready flag (bit 63)


def payload_bytes(var_base: int, totals: int, hb: int) -> int:
    """A fused blob's payload length from kvz_encode's totals (escapes << 31 | plane-coded
    groups, any flag above bit 61 ignored): esc_pos starts at var_base, esc_exp and exp_high
    follow on 16-byte boundaries (layout.escape_layout; finish_blob's arithmetic)."""
    return layout.escape_payload_len(var_base, totals >> 31 & VALUE_MASK >> 31, hb * (totals & GROUPS_MASK))


def _pinned_words(k: int) -> np.ndarray:
    """k zeroed uint64 words of pinned host memory, which kernels can write (mapped)."""
    import cupyx

    return cupyx.zeros_pinned((max(k, 1),), np.uint64)


def _launch(name: str, device: int, grid, args) -> tuple:
    """A launch op for graphs (kernels get raw addresses: CuPy views and array arguments
    cost enough host time to make the host the bottleneck below 64 MiB; benchmarks/NOTES.md, v3).
    Every kernel of the fused module (kernels/fused.cu) begins with await_predecessor(), so each
    is a "dependent" op."""
    return ("dependent", _kernel(name, device), grid if isinstance(grid, tuple) else (grid,), (THREADS,), args)


def _chunk_grid(name: str, device: int, total_chunks: int) -> int:
    return min(math.ceil(total_chunks / WARPS), _grid_cap(name, device))


def _current():
    import cupy

    return cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream()


def release_workspace() -> None:
    """Free this thread's cached device workspaces and CUDA graphs (rebuilt by the next call)."""
    graphs.release()


def applicable(backend, n: int = 0, src=None) -> bool:
    """True on a real GPU for a tensor of n values the kernels' counters hold, with src (when
    given) 16-byte aligned."""
    if not ENABLED or backend.name != "cuda" or backend.simulated or n >= MAX_VALUES:
        return False
    return src is None or aligned(src)


def decode_applicable(frame: Frame) -> bool:
    return applicable(frame.backend, frame.n) and all(aligned(frame.streams[k]) for k in ("codes", "rest")
                                                      if k in frame.streams)


# ----------------------------------------------------------------------------- encode
@dataclass
class EncodedBatch:
    """Blobs of one encode call, back to back in one device buffer."""

    buffer: object                # cupy uint8 array
    starts: list                  # byte offset of each blob in buffer
    lengths: np.ndarray           # byte length of each blob
    fits: np.ndarray              # False where the payload came out larger than the values (store raw)
    plans: tuple

    def blob(self, i: int):
        import cupy

        # A constructor call: slicing a CuPy array costs several microseconds more.
        return cupy.ndarray((int(self.lengths[i]),), np.uint8, self.buffer.data + int(self.starts[i]))


def _stream_table(n, fmt, nchunks, others, ne, nh):
    """[(name, dtype, nbytes)] in payload order for a fused encode."""
    G = groups(n)
    sizes = {"codes": 4 * G, "rest": fmt.rest_bits * G, "esc_count": 2 * nchunks, "esc_pos": 2 * ne, "esc_exp": ne,
             "exp_high": nh, **{k: v.nbytes for k, v in others.items()}}
    dtypes = {**dict(layout.FUSED_STREAMS), **{k: v.dtype.name for k, v in others.items()}}
    table = [(k, dtypes[k], sizes[k]) for k in layout.canonical_order(sizes)]
    if tuple(d[0] for d in table[-3:]) != layout.ESCAPE_STREAMS:
        raise AssertionError("layout.STREAM_ORDER must end with the escape streams")
    return table


@dataclass(frozen=True)
class _Plan:
    """Everything about one tensor's blob that does not depend on its values: the header
    template, stream offsets, padding ranges.  Cached, so a serving loop that compresses the
    same shapes over and over pays for it once."""

    n: int
    G: int
    nchunks: int
    flags: int
    header: bytes
    table: tuple
    off: dict
    nxt: dict
    pads: tuple
    table_at: int            # where the escape entries go in a version-1 header (0 in a compact one)
    compact: bool            # a version-2 header: escapes and exp_high bytes go in its fixed fields
    raw_payload: int         # payload bytes of the values stored raw (the size fallback's)
    blob_bytes: int          # worst-case blob size (BLOB_ALIGN-rounded): escape streams of at most
                             # HB bytes a group (a chunk is plane-coded past HB * groups / 3 escapes)


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
    header = container.header_for(full, table, flags)
    offsets, _ = layout.place([d[2] for d in table])
    off = {d[0]: o for d, o in zip(table, offsets)}
    nxt = {d[0]: offsets[j + 1] if j + 1 < len(offsets) else None for j, d in enumerate(table)}
    size = {d[0]: d[2] for d in table}
    pads = tuple(x for k in ("codes", "rest", "esc_count") for x in (off[k] + size[k], nxt[k]))
    compact = layout.version_of(header) == layout.COMPACT_VERSION
    plan = _Plan(n, G, nchunks, flags, header, tuple(table), off, nxt, pads,
                 0 if compact else layout.escapes_at(len(table)), compact,  # esc_pos's entry; esc_exp, exp_high follow
                 layout.place([a.nbytes for a in frame.streams.values()])[1],
                 -(-(len(header) + off["esc_pos"] + HB * G + layout.ESCAPE_SLACK) // BLOB_ALIGN) * BLOB_ALIGN)
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


ENCODE_COLUMNS = ENCODE.columns  # EncodeJob's 8-byte fields (kvzip/gpu/abi.py)
ENCODE_SIZES_REGION = 4  # an encode program's workspace region where the scan writes each blob's SIZES row
AUTO_LUT_BYTES = 256     # a tensor's LUT row for kvz_auto_codebook (2^E <= 256; kernels/auto_codebook.cu)
AUTO_UNROLL = 8          # runs a kvz_auto_codebook thread reads a step (AUTO_UNROLL there)
AUTO_BLOCKS_PER_SM = 4   # kvz_auto_codebook's blocks a launch: few and fat (each adds its histogram
                         # to the tensor's with global atomics on the same few words)
Q_SCALE = ENCODE.col("q_scale")  # its column for the quantizing encode: where the blob's scale goes
FINISH_COLUMNS = FINISH.columns  # FinishJob's 8-byte fields
_SRC = ENCODE.col("src")
_N_ESC, _N_HIGH, _PAYLOAD = (SIZES.col(name) for name in SIZES.names)  # what finish_blob writes a blob
_ENCODE_OUT = [ENCODE.col(name) for name in ("codes", "rest", "esc_count", "esc_pos")]  # in the output buffer


class _EncodeProgram:
    """The GPU side of encode_batch for one batch shape (the plans of its tensors, in order): its
    CallShape, and the job tables with every address that does not move between calls filled in
    (the blobs' addresses are relative to the output buffer, the inputs' are added per call).

    quantize (one tensor): the name of its 16-bit source format; the input is then those values,
    and the program runs QuantizeFP8 (per tensor) first: amax and table kernels of
    quantize_kernels, the table kernel writing the blob's scales stream, then the quantizing
    instances of kvz_encode and kvz_scan."""

    def __init__(self, plans: tuple, fmt, cb, chunk: int, device: int, quantize: str | None = None,
                 into: bool = False):
        """cb: the batch's codebook, or None: each tensor's own, chosen on the device first
        (kvz_auto_codebook; the plans' headers are then compact, their codebook filled in).
        into: for kvzip/gpu/into.py, which issues the program itself: nothing is published to
        or downloaded for the host."""
        k = len(plans)
        if quantize and k != 1:
            raise ValueError("a quantizing encode program takes one tensor")
        self.plans = plans  # held: the cache key is their ids
        templates = {}
        for p in plans:
            templates.setdefault(p.header, sum(len(h) for h in templates))
        starts = list(accumulate((p.blob_bytes for p in plans), initial=0))
        chunk_base = list(accumulate((p.nchunks for p in plans), initial=0))
        sb_base = list(accumulate((-(-p.nchunks // SB_CHUNKS) for p in plans), initial=0))
        total_chunks, total_sb, slot = chunk_base[-1], sb_base[-1], slot_size(chunk, fmt.name)
        tmpl_host = np.frombuffer(b"".join(templates), np.uint8)
        # work: scan ticket, totals, look-back, kvz_encode's chunk queues, each tensor's chunks done
        self.sizes_nb, work_nb = SIZES.nbytes * k, 8 * (1 + k + total_sb + QUEUE_WORDS + k)
        auto = cb is None
        # auto: kvz_auto_codebook's histograms (2^E words a tensor) and tickets after the work
        # words, zeroed with them
        hist_at = work_nb
        if auto:
            work_nb += 4 * k * ((1 << fmt.exp_bits) + 1)
        enc, scan, _, _ = loader.instances(fmt)
        ops = [("upload", 3), ("zero", 3)]
        if quantize:
            enc, scan = loader.quantizing_encode(fmt)
            amax, table = quantize_kernels.kernels(quantize, fmt.name, device)
            p = plans[0]
            ops += [("zero", 7),
                    ("launch", amax, (quantize_kernels.grid(p.n // 8, device),), (quantize_kernels.THREADS,),
                     AMAX_ARGS(src=0, src_at=R(0), n=p.n, out=R(7))),  # src_at: the job table's first word (EncodeJob.src)
                    ("launch", table, (quantize_kernels.TABLE_BYTES // quantize_kernels.THREADS,), (quantize_kernels.THREADS,),
                     QUANT_TABLE_ARGS(amax=R(7), scale=0, addrs=R(0), scale_word=Q_SCALE,
                                      scale_span=p.nxt["scales"] - p.off["scales"], table=R(8)))]
        regions = (ENCODE.nbytes * k, FINISH.nbytes * k, tmpl_host.nbytes, work_nb, self.sizes_nb,
                   2 * total_chunks * slot, total_chunks * slot) + ((16, quantize_kernels.TABLE_BYTES) if quantize else ())
        luts_region = len(regions)  # auto: each tensor's LUT row, then its 16 codebook bytes
        if auto:
            regions += (k * AUTO_LUT_BYTES, k * 16)
            runs = max(sample_plan(p.n).blocks for p in plans)
            grid = (max(1, min(-(-runs // AUTO_UNROLL), _sm_count(device) * AUTO_BLOCKS_PER_SM // k)), k)
            ops.append(_launch(loader.auto_codebook(fmt), device, grid,
                               AUTO_CODEBOOK_ARGS(jobs=R(0), work=R(3), hist_at=hist_at // 8, luts=R(luts_region),
                                                  books=R(luts_region + 1))))
        else:
            lut = _device_lut(fmt.name, cb.exponents, device)
        # kvz_encode writes each tensor's totals here (pinned, mapped) as soon as it has them.
        self.ready = _pinned_words(k)
        if total_chunks:
            ops.append(_launch(enc, device, _chunk_grid(enc, device, total_chunks),
                               ENCODE_ARGS(jobs=R(0), njobs=k, total_chunks=total_chunks, chunk=chunk, slot=slot,
                                           work=R(3), queue_at=1 + k + total_sb,
                                           ready=0 if into else self.ready.ctypes.data)))
        ops.append(_launch(scan, device, k + total_sb,  # k blocks finish the blobs (headers)
                           SCAN_ARGS(jobs=R(0), njobs=k, chunk=chunk, slot=slot, work=R(3), chunk_off=0, fin=R(1),
                                     sizes=R(ENCODE_SIZES_REGION), heads=0, expect=0, span=0, down=0, flag=0, runs=0)))
        if not into:
            ops.append(("download", ENCODE_SIZES_REGION, self.sizes_nb))
        # Regions: encode jobs | finish jobs | templates | zeroed work | sizes | escape slots |
        # (quantize) amax, table | (auto) LUT rows, codebooks.
        ws = self.shape = graphs.CallShape(regions, tuple(ops))
        self.books = ws.ptr(luts_region + 1) if auto else None
        slot_pos, slot_exp = ws.ptr(5), ws.ptr(6)
        enc_rows, fin_rows = [], []
        for i, p in enumerate(plans):
            pay = starts[i] + len(p.header)
            enc_rows.append(dict(n=p.n, codes=pay + p.off["codes"], rest=pay + p.off["rest"],
                                 esc_count=pay + p.off["esc_count"], esc_pos=pay + p.off["esc_pos"],
                                 slot_pos=slot_pos + 2 * slot * chunk_base[i], slot_exp=slot_exp + slot * chunk_base[i],
                                 chunk_base=chunk_base[i], sb_base=sb_base[i],
                                 q_table=ws.ptr(8) if quantize else 0, q_scale=pay + p.off["scales"] if quantize else 0,
                                 lut=ws.ptr(luts_region) + AUTO_LUT_BYTES * i if auto else lut))
            fin_rows.append(dict(blob=starts[i], tmpl=ws.ptr(2) + templates[p.header], header_len=len(p.header),
                                 table_at=p.table_at, var_base=p.off["esc_pos"], pad=p.pads,
                                 write_header=0 if p.flags & layout.FLAG_CHECKSUM else 1, compact=int(p.compact),
                                 codebook=self.books + 16 * i if auto else 0))
        ws.put(0, ENCODE.rows(enc_rows))  # src: added per call
        ws.put(1, FINISH.rows(fin_rows))
        ws.put(2, tmpl_host)
        # Per call only the inputs' and the output buffer's addresses change: where they go in the
        # staged tables (as uint64 indices), and the output-relative values to add the buffer to.
        fin_at = ws.offsets[1] // 8
        self.src_at = np.arange(k) * ENCODE_COLUMNS + _SRC
        out_cols = np.array(_ENCODE_OUT + ([Q_SCALE] if quantize else []))  # codes .. esc_pos (scales)
        self.out_at = np.concatenate([(np.arange(k)[:, None] * ENCODE_COLUMNS + out_cols).ravel(),
                                      fin_at + np.arange(k) * FINISH_COLUMNS + FINISH.col("blob")])
        self.out_rel = ws.staged[self.out_at].copy()  # codes, rest, esc_count, esc_pos; each blob's start
        # One tensor: item writes beat the index arrays.
        self.one = list(zip(self.out_at.tolist(), self.out_rel.tolist())) if k == 1 else None
        self.starts = starts[:-1]  # each blob's byte offset in the output buffer
        self.total = starts[-1]
        self.header_lens = np.array([len(p.header) for p in plans], np.int64)
        self.hb = fmt.high_exp_bits
        self.early_return = tuning_for(fmt.name).early_return
        self.var_bases = [p.off["esc_pos"] for p in plans]  # where each payload's escape streams start
        self.pending = [p.nchunks > 0 for p in plans]  # tensors kvz_encode publishes (the others: no escapes)
        self.publishes = any(self.pending)
        self.raw_payloads = np.array([p.raw_payload for p in plans], np.int64)
        self.header_list, self.raw_list = self.header_lens.tolist(), self.raw_payloads.tolist()

    def run(self, src_ptrs: list[int], out_ptr: int, stream) -> np.ndarray:
        """Encode into the buffer at out_ptr; returns (escapes, high-exponent bytes, payload bytes)
        per tensor, once the GPU is done."""
        self.launch(src_ptrs, out_ptr, stream)
        return self.wait(stream)

    def launch(self, src_ptrs: list[int], out_ptr: int, stream) -> None:
        """run's first half: start the encode and return (wait gives the result)."""
        staged = self.shape.staged
        if self.one is not None:
            words = self.shape.words
            words[_SRC] = src_ptrs[0]
            for at, relative in self.one:
                words[at] = relative + out_ptr
        else:
            staged[self.src_at] = src_ptrs
            staged[self.out_at] = self.out_rel + P(out_ptr)
        self.shape.launch(stream)

    def wait(self, stream) -> np.ndarray:
        got = self.shape.wait(stream)[:self.sizes_nb]
        return got.view(np.uint64).reshape(-1, SIZES.columns).astype(np.int64)

    def encode(self, src_ptrs: list[int], origin, stream) -> list:
        """The blobs of the tensors at src_ptrs as origin's arrays (CuPy's without one), None where
        a payload came out larger than the values.  The host's work happens before the launch or
        while the GPU runs: a CuPy or torch caller's blobs are built as kvz_encode publishes each
        tensor's totals, while the others and the scan run, and (Tuning.early_return) handed out while
        the scan finishes them on the stream; other callers' once the GPU is done."""
        buffer = allocate(self.total, origin)
        # A CuPy or torch caller's blobs (views, no copy: safe before the scan ends) are sized as
        # published.
        early = bool(self.starts) and (origin is None or origin.framework in ("cupy", "torch"))
        if early:
            self.ready.fill(0)
        self.launch(src_ptrs, buffer.ptr, stream)
        places = buffer.places(self.starts)  # while the GPU encodes
        blobs = None
        if early:
            try:  # each blob is built as its length comes
                blobs = buffer.blobs(self.starts, self._published_lengths(stream), places)
            except _Unpublished:
                pass
        if blobs is not None:
            # Once a tensor's totals are published the upload before kvz_encode is done (the staging
            # is free), and with all of them kvz_encode too (ready is free).
            if self.early_return and self.publishes:
                self.shape.detach(stream)
            else:
                self.shape.wait(stream)
            return blobs
        self.shape.wait(stream)
        payloads = self.shape.down64[_PAYLOAD:SIZES.columns * len(self.starts):SIZES.columns].tolist()  # SIZES rows
        return buffer.blobs(self.starts, [self._blob_length(t, p) for t, p in enumerate(payloads)], places)

    def chosen_codebooks(self) -> np.ndarray:
        """uint8 (tensors, 16): the codebooks kvz_auto_codebook chose in the last call (auto)."""
        ws, at = self.shape, self.books - self.shape.base
        return ws.buffer[at:at + 16 * len(self.plans)].get().reshape(-1, 16)

    def _blob_length(self, t: int, payload: int) -> int | None:
        """Blob t's length with a payload of that many bytes; None where that is more than the
        values take raw (the general path then stores them raw)."""
        return self.header_list[t] + payload if payload <= self.raw_list[t] else None

    def _published_lengths(self, stream):
        """Each blob's length (None: stored raw), from the totals kvz_encode publishes in ready
        (zeroed before the launch; totals | 1 << 63 once published), yielded tensor by tensor as
        they come (finish_blob's layout arithmetic); raises _Unpublished if the stream finished
        without publishing one (not expected: the caller then reads the sizes the scan wrote).
        The wait is graphs.await_word's, which gives the GIL up between looks by
        sched_yield, not time.sleep(0), which sleeps out the timer slack (benchmarks/NOTES.md,
        v18)."""
        ready = self.ready
        for t, pending in enumerate(self.pending):
            if pending and not graphs.await_word(ready, t, stream):
                raise _Unpublished
            totals = int(ready[t]) if pending else 1 << 63
            yield self._blob_length(t, payload_bytes(self.var_bases[t], totals, self.hb))


class _Unpublished(Exception):
    """A stream finished without kvz_encode publishing a tensor's totals."""


@lru_cache(maxsize=None)
def auto_placeholder(fmt):
    """The codebook an auto plan's header template holds until kvz_auto_codebook's replaces it."""
    from kvzip.codebook import Codebook

    return Codebook(range(16), fmt)


def plans_for(frames: list[Frame], top16, chunk: int, checksum: bool) -> tuple | None:
    """(plans, codebook: None for auto) of tensor frames of one format, or None where an auto
    codebook cannot be written on the GPU (a version-1 header: n >= 2**32, a long shape; the
    staged executor then encodes them)."""
    fmt = frames[0].format
    cb = None if top16.auto else top16.codebook_for(fmt)
    flags = layout.FLAG_CHECKSUM if checksum else 0
    plans = tuple(_plan(frame, fmt, cb or auto_placeholder(fmt), chunk, flags, _config_key(frame.meta.get("pipeline")))
                  for frame in frames)
    return None if cb is None and not all(p.compact for p in plans) else (plans, cb)


def encode_batch(frames: list[Frame], plans: tuple, cb, chunk: int) -> EncodedBatch:
    """Encode tensor frames of one format straight into container blobs (Serialize included),
    by plans_for's plans and codebook."""
    import cupy

    fmt = frames[0].format
    flags = plans[0].flags
    checksum = bool(flags & layout.FLAG_CHECKSUM)
    srcs = [frame.expect("data", fmt.uint_dtype, frame.n).data.ptr for frame in frames]
    device, stream = _current()
    prog = graphs.cached(("encode", device, *map(id, plans), None),  # ids are safe: the program holds the plans
                              lambda: _EncodeProgram(plans, fmt, cb, chunk, device))
    buffer = cupy.empty(max(prog.total, 1), np.uint8)
    starts = prog.starts
    for i, (p, frame) in enumerate(zip(plans, frames)):
        if len(frame.streams) > 1:  # small streams ahead of the codes (QuantizeFP8's scales)
            at = int(starts[i]) + len(p.header)
            for name, a in frame.streams.items():
                if name != "data":
                    flat = a.reshape(-1).view(np.uint8)
                    region = buffer[at + p.off[name]: at + p.nxt[name]]
                    region[:flat.shape[0]] = flat
                    region[flat.shape[0]:] = 0
    # The one host synchronisation: the escape totals fix each blob's length.
    got = prog.run(srcs, buffer.data.ptr, stream)
    header_lens = prog.header_lens
    lengths = header_lens + got[:, _PAYLOAD]
    if checksum:  # the payload is final: hash it and write the header from the host
        from kvzip.checksum import sum64
        from kvzip.codebook import Codebook

        books = prog.chosen_codebooks() if cb is None else None
        for i, (p, frame) in enumerate(zip(plans, frames)):
            s, h = int(starts[i]), int(header_lens[i])
            digest = sum64(cupy, buffer[s + h: s + int(lengths[i])])
            others = {k: a for k, a in frame.streams.items() if k != "data"}
            meta = dict(frame.meta)
            meta["codebook"] = codebook_meta(cb if books is None else Codebook(books[i].tolist(), fmt))
            table = _stream_table(p.n, fmt, p.nchunks, others, int(got[i, _N_ESC]), int(got[i, _N_HIGH]))
            buffer[s:s + h].set(np.frombuffer(container.header_for(meta, table, flags, digest), np.uint8))
    return EncodedBatch(buffer, starts, lengths, got[:, _PAYLOAD] <= prog.raw_payloads, plans)


@dataclass(frozen=True)
class EncodeLane:
    """A pipeline's encode of tensors of one format and shape once the general path has run it on
    the fast path (kvzip/gpu/executor.py's ShapeEncoder keeps one per shape): the plan and
    codebook, so the next tensor of the shape goes straight to its program."""

    plan: _Plan
    fmt: object
    codebook: object
    chunk: int
    quantize: str | None = None  # QuantizeFP8 per tensor in front: the 16-bit source format taken

    def encode(self, bits, origin=None):
        """The blob of bits (a 16-byte aligned CuPy array of plan.n values), or None when the
        payload comes out larger than the values (the general path then stores them raw) or
        the lane quantizes and quantize_kernels is off.  origin (the caller, a kvzip.arrays.Origin): hand the
        blob out as that caller's array (else CuPy's)."""
        if not self.usable():
            return None
        device, stream = _current()
        return self.program(device).encode([bits.data.ptr], origin, stream)[0]

    def usable(self) -> bool:
        """Whether the fast path may run this lane now (tests switch the kernels off)."""
        return ENABLED and (not self.quantize or quantize_kernels.ENABLED)

    def program(self, device: int) -> _EncodeProgram:
        """This thread's program for this lane's tensors on device."""
        return _encode_program((self.plan,), self, device)


def encode_lanes(lanes: list[EncodeLane], bits: list, origin=None, ptrs: list[int] | None = None) -> list:
    """EncodeLane.encode for several tensors of one pipeline and format (and caller, origin) in
    one program run (quantizing lanes: a run each, their tables per tensor).  bits: the inputs
    (arrays over the values; only their addresses are read).  ptrs: those addresses, if the
    caller has them already (then only quantizing lanes read bits)."""
    first = lanes[0]
    # A serving loop's batch is one lane k times: its plans without a Python step a tensor (no
    # generators here: they cost host time ahead of the launch; benchmarks/NOTES.md, v25).
    uniform = lanes.count(first) == len(lanes)
    if first.quantize if uniform else any(lane.quantize for lane in lanes):
        if not quantize_kernels.ENABLED:
            return [None] * len(lanes)
        if len(lanes) > 1:
            return [lane.encode(b, origin) for lane, b in zip(lanes, bits)]
    device, stream = _current()
    plans = (first.plan,) * len(lanes) if uniform else tuple(lane.plan for lane in lanes)
    prog = _encode_program(plans, first, device)
    return prog.encode(ptrs if ptrs is not None else [b.data.ptr for b in bits], origin, stream)


def _encode_program(plans: tuple, first: EncodeLane, device: int) -> _EncodeProgram:
    """This thread's program for lanes of these plans (first: one of them, for the format,
    codebook, chunk size and quantizing source)."""
    return graphs.cached(("encode", device, *map(id, plans), first.quantize),  # encode_batch's key too
                              lambda: _EncodeProgram(plans, first.fmt, first.codebook, first.chunk, device,
                                                     first.quantize))


# ----------------------------------------------------------------------------- decode
class _HeadsProgram:
    """head_block for k blobs: the gather and check kernels and one download."""

    def __init__(self, k: int, device: int):
        self.shape = graphs.CallShape(
            (HEADS.nbytes * k, k * HEAD_SPAN, CHECKS.nbytes * k),
            (("upload", 1), _launch("kvz_gather_heads", device, (4, k), GATHER_HEADS_ARGS(jobs=R(0), span=HEAD_SPAN, dst=R(1))),
             _launch("kvz_check_heads", device, k, CHECK_HEADS_ARGS(heads=R(0), span=HEAD_SPAN, checks=R(2))),
             ("download", 1, self.download_bytes(k))))
        assert self.shape.offsets[2] == self.shape.offsets[1] + k * HEAD_SPAN  # one download takes both

    @staticmethod
    def download_bytes(k: int) -> int:
        # Regions 1 and 2 back to back (a region is padded to 256 bytes; k * HEAD_SPAN already is).
        return k * HEAD_SPAN + CHECKS.nbytes * k


def head_block(ptrs: list[int], sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The first HEAD_SPAN bytes of each blob (at device address ptrs[i], sizes[i] bytes long;
    fewer where a blob is shorter, the rest of its row undefined) as one (len(ptrs), HEAD_SPAN)
    array, and what kvz_check_heads found of each header (layout_cache.head_checks' rows),
    with one device-to-host copy.  Both are this thread's staging memory: valid until the next
    head_block call for as many blobs."""
    k = len(ptrs)
    device, stream = _current()
    ws = graphs.cached(("heads", device, k), lambda: _HeadsProgram(k, device)).shape
    ws.staged[_HEAD_PTR:HEADS.columns * k:HEADS.columns] = ptrs
    ws.staged[_HEAD_LEN:HEADS.columns * k:HEADS.columns] = sizes
    got = ws.run(stream)
    return got[:k * HEAD_SPAN].reshape(k, HEAD_SPAN), got[k * HEAD_SPAN:_HeadsProgram.download_bytes(k)].view(
        np.uint64).reshape(k, CHECKS.columns)


def heads_from_block(block: np.ndarray, blobs) -> list[bytes]:
    """Each blob's head as bytes from head_block's rows (a header longer than HEAD_SPAN is fetched
    whole)."""
    heads = []
    for row, b in zip(block, blobs):
        head = row[:min(HEAD_SPAN, b.shape[0])].tobytes()
        if len(head) >= layout.PREFIX_SIZE:
            header_len = layout.HEADER_LEN.read(head)
            if HEAD_SPAN < header_len <= min(layout.MAX_HEADER, b.shape[0]):
                head = b[:header_len].get().tobytes()
        heads.append(head)
    return heads


DECODE_COLUMNS = DECODE.columns  # DecodeJob's 8-byte fields (kvzip/gpu/abi.py)
DQ_TABLE, DQ_SCALE = DECODE.col("dq_table"), DECODE.col("dq_scale")  # its columns for the dequantizing decode
_DST = DECODE.col("dst")
_STREAMS = DECODE.span("codes", "exp_high")  # the six stream addresses (blob-relative in a layout's row)
_BASES = DECODE.span("chunk_base", "sb_base")
_HEAD_PTR, _HEAD_LEN = HEADS.col("ptr"), HEADS.col("len")
GUESS_MISSED = 255  # the guess's error for a blob whose header isn't the guessed layout's (abi.cuh)
GUESS_PENDING = np.uint64(2**64 - 1)  # n_high of a guessed row until the GPU's guess is in
HEAD_LEN_CAPACITY = 1 << 63  # a heads row's length with this bit: the buffer's capacity (abi.cuh)


def _decode_split(fmt, chunks: int, warps: int) -> tuple:
    """kvz_decode's split_at and part_shift for chunks chunks on a grid of warps warps: the last
    round of chunks (one a warp of the grid) dealt in parts, never one of the warps' first chunks
    (decoded whole before the scan is done), and log2 of the parts (Tuning.split_shift, 0: no
    split; fmt None: the dequantizing decode, which never splits)."""
    shift = tuning_for(fmt.name).split_shift if fmt is not None else 0
    if not shift:
        return chunks, 0
    split = min(max(chunks - warps, 0), warps)
    return chunks - split, (shift if split else 0)


def _decode_status_at(k: int) -> int:
    """The decode work's first look-back word for k blobs (abi.cuh's decode_status_at): after
    the ticket, the errors, the deferred and blocks-done words, and a line (16 words, 128 bytes)
    holding only the count of scan blocks whose offsets are written, which the decoder polls."""
    return -(-(3 + k) // 16) * 16 + 16


class _DecodeProgram:
    """The GPU side of decoding blobs of one format and chunk size holding ns values each: its
    CallShape and the per-blob output offsets and chunk bases of the job table.  dequantize:
    (FP8 format, 16-bit format) of blobs of a QuantizeFP8 (per tensor) pipeline, whose values
    come out in the 16-bit format: the program first builds each blob's table from the scale
    column DQ_SCALE points at, and kvz_decode applies it as it stores.  expect: for a decode on
    guessed layouts, each blob's expected header with the escape-dependent fields blanked
    (at most HEAD_SPAN bytes; layout_cache.Layout.key): the program first checks each blob's
    header against it on the GPU (the scan's first k blocks: guess_head) and fills in the escape
    fields of its row."""

    def __init__(self, fmt, chunk: int, ns: tuple, device: int, dequantize: tuple | None = None,
                 expect: tuple | None = None, into: bool = False, heavy: bool = False):
        """into: for kvzip/gpu/into.py, which issues the program itself: no verdict is
        downloaded for the host (the status stays in the work region).  heavy: decode with
        kvz_decode's escape-heavy instance (for blobs of many escapes: heavy())."""
        k = len(ns)
        out_at, chunk_base, sb_base, fixed = 0, 0, 0, []
        self.ns, self.offsets = ns, []  # values of each blob, and the byte offset of its output
        out_fmt = FORMATS[dequantize[1]] if dequantize else fmt  # what the blobs decode to
        for n in ns:
            fixed.append((out_at, chunk_base, sb_base))
            self.offsets.append(out_at)
            out_at += -(-n * out_fmt.itemsize // BLOB_ALIGN) * BLOB_ALIGN
            nchunks = -(-n // chunk)
            chunk_base += nchunks
            sb_base += -(-nchunks // SB_CHUNKS)
        self.fixed = np.array(fixed, np.uint64).reshape(k, 3)
        # The downloads: the scan's ticket, each blob's error, and the scan's deferred checks.
        self.out_bytes, self.dtype, self.errors_nb = out_at, out_fmt.uint_dtype, 8 * (2 + k)
        self.heavy = heavy
        _, _, scan, dec = loader.instances(fmt)
        dec = loader.dequantizing_decode(fmt) if dequantize else loader.heavy_decode(fmt) if heavy else dec
        # Workspace: jobs (| heads: blob address and length) | zeroed work (scan ticket, per-tensor
        # errors, deferred checks, scan blocks done, the line of scan blocks whose offsets are
        # written, look-back, decode chunk queue) | chunk offsets
        # (| expected headers) (| dequantize tables).
        guess = expect is not None
        sizes = [DECODE.nbytes * k] + ([HEADS.nbytes * k] if guess else [])
        jobs, heads, work, offs = R(0), R(1), R(len(sizes)), R(len(sizes) + 1)
        self.work_region = work  # its words: the scan's ticket, each blob's error, ...
        queue_at = _decode_status_at(k) + sb_base  # work ends with kvz_decode's chunk queues
        sizes += [8 * (queue_at + QUEUE_WORDS), 8 * chunk_base]
        ops = [("upload", work), ("zero", work)]
        if guess:
            expected = len(sizes)  # region of the expected headers, written once below
            sizes.append(k * HEAD_SPAN)
        if dequantize:
            ops.append(("launch", quantize_kernels.dequant_tables_kernel(*dequantize, device), (k,), (256,),
                        DEQUANT_TABLES_ARGS(addrs=jobs, word=DQ_SCALE, stride=DECODE_COLUMNS, single=0, tables=R(len(sizes)))))
            sizes.append(512 * k)
        # The scan's verdict (every check but those it deferred), sent by its last block.
        self.early = bool(chunk_base and tuning_for(fmt.name).early_verdict) and not into
        verdict = dict(down=graphs.EARLY_DOWN, flag=graphs.EARLY_FLAG, runs=graphs.EARLY_RUNS) if self.early else \
            dict(down=0, flag=0, runs=0)
        scan_blocks = sb_base + (k if guess else 0)  # on guessed layouts the first k check the headers
        if scan_blocks:
            ops.append(_launch(scan, device, scan_blocks,
                               SCAN_ARGS(jobs=jobs, njobs=k, chunk=chunk, slot=0, work=work, chunk_off=offs, fin=0,
                                         sizes=0, heads=heads if guess else 0, expect=R(expected) if guess else 0,
                                         span=HEAD_SPAN if guess else 0, **verdict)))
        if self.early:
            ops.append(("early", work, self.errors_nb))
        if chunk_base:
            grid = _chunk_grid(dec, device, chunk_base)
            split_at, shift = _decode_split(fmt if not dequantize else None, chunk_base, grid * WARPS)
            units = split_at + ((chunk_base - split_at) << shift)
            ops.append(_launch(dec, device, grid,
                               DECODE_ARGS(jobs=jobs, njobs=k, units=units, chunk=chunk, chunk_off=offs, work=work,
                                           queue_at=queue_at, scan_blocks=scan_blocks, split_at=split_at, part_shift=shift)))
        if not into:
            ops.append(("download", work, self.errors_nb))
        self.shape = graphs.CallShape(tuple(sizes), tuple(ops))
        self.heads_at = self.shape.offsets[1] // 8 if guess else None  # heads' first word in the staging
        self.head_at = (self.heads_at + _HEAD_PTR, self.heads_at + _HEAD_LEN) if guess else None  # run_one's
        self.staged_row = None  # the layout row run_one last staged whole (None after a run)
        self.row_streams = None  # and its stream columns (_STREAMS, blob-relative) as ints
        self.out_offset = int(self.fixed[0, 0])  # run_one's output offset
        self.tables = self.shape.ptr(len(sizes) - 1) + 512 * np.arange(k, dtype=np.uint64) if dequantize else None
        if guess:
            rows = np.zeros((k, HEAD_SPAN), np.uint8)
            for row, key in zip(rows, expect):
                row[:len(key)] = np.frombuffer(key, np.uint8)
            self.shape.buffer[self.shape.offsets[expected]:][:rows.size].set(rows.ravel())

    def run(self, jobs: np.ndarray, stream, labels=None, views=None, origin=None, heads=None):
        """Decode the blobs jobs describe (dst, chunk_base and sb_base, and dq_table, are filled in here).
        Returns views(buffer, offsets): what to hand out for the values of blob i, which lie at
        byte offsets[i] of buffer (results.allocate's buffer for origin's caller); by
        default their raw-bit CuPy arrays.  views runs while the GPU decodes; its results are
        dropped if a blob fails validation.  labels: what to call each blob in an error (its
        position in the caller's batch).  heads ((k, 2) uint64: each blob's address and length)
        goes with a program on guessed layouts, whose run returns (results, misses): the
        positions of the blobs whose header was not the expected one (their results are not
        decoded values)."""
        out = allocate(self.out_bytes, origin)
        jobs[:, _DST] = self.fixed[:, 0] + P(out.ptr)
        jobs[:, _BASES] = self.fixed[:, 1:3]
        if self.tables is not None:
            jobs[:, DQ_TABLE] = self.tables
        self.shape.put(0, jobs)
        self.staged_row = None
        if heads is not None:
            self.shape.put(1, heads)
        self.shape.launch(stream)
        got = views(out, self.offsets) if views is not None else self._raw_views(out)
        # The validation result: the tensor errors after the work counter.
        errors = self._verdict(stream, origin)[1:self.errors_nb // 8 - 1]
        misses = []
        if errors.any():
            bad = np.nonzero(errors)[0]
            misses = bad[errors[bad] == GUESS_MISSED].tolist() if heads is not None else []
            if len(misses) < bad.size:
                i = int(bad[errors[bad] != GUESS_MISSED][0]) if heads is not None else int(bad[0])
                where = f"blob {labels[i]}: " if labels is not None else f"blob {i}: " if errors.shape[0] > 1 else ""
                raise FormatError(where + decode_error_text(int(errors[i])))
        return (got, misses) if heads is not None else got

    def run_one(self, row: np.ndarray, blob_ptr: int, blob_len: int, stream, views=None, origin=None,
                scale_at: int | None = None, while_running=None):
        """run() for one blob on a guessed layout (a program built with one expected header),
        decompress's usual call, with the least host work: row is the layout's job row (addresses
        relative to the blob, esc_pos where the guess puts it) and stays staged from one call to
        the next, so a call writes only the blob's and the output's addresses, the blob's length
        and (scale_at: the scale's offset in the blob) the dequantizing decode's scale address.
        while_running: called once the GPU has the work (host work the decode hides).
        Returns (result as run's views give it, missed: the header was not the expected one)."""
        out = allocate(self.out_bytes, origin)
        if self.staged_row is not row:
            staged = self.shape.staged
            staged[:DECODE_COLUMNS] = row[0]
            staged[_BASES] = self.fixed[0, 1:3]
            if self.tables is not None:
                staged[DQ_TABLE] = self.tables[0]
            self.staged_row, self.row_streams = row, row[0, _STREAMS].tolist()
        words = self.shape.words
        for i, relative in enumerate(self.row_streams, _STREAMS.start):  # item writes: a fraction of a ufunc's cost
            words[i] = relative + blob_ptr
        words[_DST] = self.out_offset + out.ptr
        if scale_at is not None:
            words[DQ_SCALE] = blob_ptr + scale_at
        ptr_at, len_at = self.head_at
        words[ptr_at] = blob_ptr
        words[len_at] = blob_len
        self.shape.launch(stream)
        got = views(out, self.offsets) if views is not None else self._raw_views(out)
        if while_running is not None:
            while_running()
        error = int(self._verdict(stream, origin)[1])  # the tensor's error, after the work counter
        if error and error != GUESS_MISSED:
            raise FormatError(decode_error_text(error))
        return got[0], error == GUESS_MISSED

    def _verdict(self, stream, origin) -> np.ndarray:
        """The launched call's downloaded words (work counter, each blob's error, deferred checks):
        for a CuPy or torch caller's results (origin), from the early download, the decoder left
        running in stream order, where the scan checked every escape; else once the call is done
        (raw results go on to more host work, and other frameworks' arrays know no stream)."""
        if self.early and origin is not None and origin.framework in ("cupy", "torch"):
            words = self.shape.wait_early(stream)
            if not words[self.errors_nb // 8 - 1]:
                self.shape.detach(stream)
                return words
        self.shape.wait(stream)
        return self.shape.down64

    def _raw_views(self, out) -> list:
        import cupy

        at = out.memory if out.memory is not None else out.array.data
        return [cupy.ndarray((n,), self.dtype, at + offset if offset else at) for offset, n in zip(self.offsets, self.ns)]


def decode_jobs(fmt, chunk: int, ns: tuple, jobs: np.ndarray, labels=None, dequantize: tuple | None = None,
                views=None, origin=None, guessed: tuple | None = None, escapes: int = 0):
    """Decode blobs from their job rows (kvz_decode's DecodeJob; dst, chunk_base, sb_base filled in here).
    dequantize: (FP8 format, 16-bit format): blobs of a QuantizeFP8 (per tensor) pipeline, to
    16-bit values, each with the scale column DQ_SCALE points at.  views, origin: as
    _DecodeProgram.run.  guessed: (expected blanked headers, (k, 2) blob addresses and lengths)
    for rows built from guessed layouts whose escape fields the GPU fills in from each header;
    then returns (results, misses) as _DecodeProgram.run.  escapes: the blobs' escapes (or a
    bound on them), which choose the decoder's instance (heavy())."""
    expect, heads = guessed if guessed is not None else (None, None)
    prog, stream = decode_program(fmt, chunk, ns, dequantize, expect, heavy(fmt, sum(ns), escapes, dequantize))
    return prog.run(jobs, stream, labels, views, origin, heads)


def decode_program(fmt, chunk: int, ns: tuple, dequantize, expect, heavy: bool = False) -> tuple:
    """(this thread's _DecodeProgram for the call shape on the current device, the current
    stream): one key for decode_jobs and layout_cache' single blobs, so a layout's single and
    batched decodes share a program."""
    device, stream = _current()
    prog = graphs.cached(("decode", device, fmt.name, chunk, ns, dequantize, expect, heavy),
                              lambda: _DecodeProgram(fmt, chunk, ns, device, dequantize, expect, heavy=heavy))
    return prog, stream


def heavy_escapes(fmt, n: int) -> int:
    """The escapes from which a decode of n values of fmt takes kvz_decode's escape-heavy
    instance (Tuning.heavy_share of the values; benchmarks/NOTES.md, e3)."""
    return math.ceil(tuning_for(fmt.name).heavy_share * n)


def heavy(fmt, n: int, escapes: int, dequantize=None) -> bool:
    """Whether blobs of n values in all with this many escapes decode with the escape-heavy
    instance (the dequantizing decoder has none)."""
    return not dequantize and escapes >= heavy_escapes(fmt, n) and escapes > 0


def decode_batch(frames: list[Frame], chunk: int, codebooks: list, labels=None) -> list:
    """Decode the fused streams of frames of one format and chunk size (already checked by
    FusedSplitPackEscape.check); returns raw-bit arrays.  Per-chunk counts, positions and totals
    are validated by the kernel, which reports the first problem of each blob."""
    rows = []
    for frame, cb in zip(frames, codebooks):
        st = frame.streams
        rows.append(_batch_row(st["codes"].data.ptr, st["rest"].data.ptr, st["esc_count"].data.ptr,
                               st["esc_pos"].data.ptr, st["esc_exp"].data.ptr, st["exp_high"].data.ptr, frame.n,
                               st["esc_pos"].shape[0], st["exp_high"].shape[0], *dlut_words(cb)))
    jobs = np.array(rows, np.uint64).reshape(len(frames), DECODE_COLUMNS)
    escapes = sum(f.streams["esc_pos"].shape[0] for f in frames)
    return decode_jobs(frames[0].format, chunk, tuple(f.n for f in frames), jobs, labels, escapes=escapes)


_batch_row = DECODE.maker("codes", "rest", "esc_count", "esc_pos", "esc_exp", "exp_high", "n", "n_esc", "n_high",
                          "dlo", "dhi")  # decode_batch's rows by name (the others 0)


@lru_cache(maxsize=256)
def _dlut_words_cached(exponents: tuple) -> tuple[int, int]:
    lo = sum(int(e) << (8 * i) for i, e in enumerate(exponents[:8]))
    hi = sum(int(e) << (8 * i) for i, e in enumerate(exponents[8:]))
    return lo, hi


def dlut_words(cb) -> tuple[int, int]:
    """The codebook as two 64-bit words: code c -> byte c (the decode kernels' lookup table)."""
    return _dlut_words_cached(tuple(cb.exponents))

