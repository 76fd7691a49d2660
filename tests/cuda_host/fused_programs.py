"""The speed mode's GPU programs (kvzip/gpu/programs.py's _EncodeProgram, _DecodeProgram and
_HeadsProgram) laid out for fused_host.cpp: the same job rows, work words, regions and launches
in the same order with the same arguments, in one host buffer (an Arena) instead of a CUDA
graph's workspace.  Only the grids are smaller: DEVICE_BLOCKS stands for the grid cap of a GPU's
multiprocessors, so the persistent kernels' queues, the scan's look-back across blocks and the
decoder's tail parts all still happen on small inputs.

What each program takes from kvzip is what the GPU path takes: the plans and header templates
(programs.plans_for), the slot size, the instances (loader), the decode split, the job rows'
columns (abi), the decode rows of the frame the general decode opens (executor.decode_general),
a guessed layout's row and expected header (layout_cache)."""
from __future__ import annotations

import math
from itertools import accumulate
from pathlib import Path

import numpy as np

from kvzip import api, container, staged
from kvzip.auto_codebook import sample_plan
from kvzip.backends import get_backend
from kvzip.codebook import Codebook
from kvzip.formats import FORMATS
from kvzip.gpu import layout_cache, loader, programs, quantize_kernels, tuning
from kvzip.gpu.abi import (AMAX_ARGS, AUTO_CODEBOOK_ARGS, CHECK_HEADS_ARGS, CHECKS, DECODE, DECODE_ARGS,
                           DEQUANT_TABLES_ARGS, ENCODE, ENCODE_ARGS, FINISH, GATHER_HEADS_ARGS, HEADS,
                           QUANT_TABLE_ARGS, SCAN_ARGS, SIZES, Table)

from . import harness

DEVICE_BLOCKS = 2  # the dense kernels' grid cap (programs._grid_cap) and the multiprocessors (_sm_count)
THREADS = programs.THREADS


class At(int):
    """An arena offset standing for a pointer: fused_host makes the word holding it an address."""


class Arena:
    """A program's memory: regions one after another, each 256-byte aligned as a workspace's are,
    from offset 256 (0 stays the null pointer), and the words of its job tables that hold
    pointers (At values)."""

    def __init__(self):
        self.regions: list[tuple[int, bytes]] = []
        self.size = 256
        self.pointer_words: list[int] = []

    def add(self, data) -> At:
        """A region holding data (bytes, an array, or a byte count: zeroed)."""
        raw = bytes(data) if isinstance(data, int) else np.ascontiguousarray(data).tobytes()
        at = At(self.size)
        self.regions.append((at, raw))
        self.size += -(-max(len(raw), 1) // 256) * 256
        return at

    def table(self, table: Table, rows: list[dict]) -> At:
        """A job table of rows by field name (abi.Table.rows), its At fields noted as pointers."""
        at = self.add(table.rows(rows))
        for r, row in enumerate(rows):
            for name, value in row.items():
                if isinstance(value, At) and value:
                    self.pointer_words.append(at // 8 + r * table.columns + table.col(name))
        return at

    def bytes(self) -> np.ndarray:
        out = np.zeros(self.size, np.uint8)
        for at, raw in self.regions:
            out[at:at + len(raw)] = np.frombuffer(raw, np.uint8)
        return out


class Launches:
    """The kernel launches of a program, each as fused_host takes it."""

    def __init__(self):
        self.names: list[str] = []
        self.ops: list[tuple] = []

    def add(self, name: str, grid, args: tuple) -> None:
        if name not in self.names:
            self.names.append(name)
        gx, gy = grid if isinstance(grid, tuple) else (grid, 1)
        self.ops.append((self.names.index(name), gx, gy, THREADS, *(int(a) for a in args)))


def pipeline(chunk: int = api.DEFAULT_CHUNK, codebook="auto"):
    """compress()'s speed-mode pipeline (what kvzip.compress(..., chunk=chunk, codebook=codebook) runs)."""
    return api._default(codebook, False, chunk)


def fused_input(bits: np.ndarray, fmt, pipe):
    """The fused step's input frame of a tensor of raw bits of fmt, as ShapeEncoder.encode_frame
    makes it: the stages ahead of the fused step (QuantizeFP8) run on the CPU."""
    frame = staged.tensor_frame(bits.reshape(-1), fmt, bits.shape, get_backend("cpu"))
    frame.meta["pipeline"] = pipe.stage_configs
    for step in pipe.body_steps[:-1]:
        frame = step.encode(frame)
    return frame


def plans(tensors: list[np.ndarray], fmt, pipe) -> tuple:
    """(plans, codebook or None for auto) as the GPU executor makes them (ShapeEncoder.encode_frame)
    for these tensors of raw bits of fmt (a quantizing pipeline's: of its 16-bit source format)."""
    frames = [fused_input(bits, fmt, pipe) for bits in tensors]
    fused = pipe.body_steps[-1]
    planned = programs.plans_for(frames, fused.top16, fused.chunk, False)
    assert planned is not None, "an auto codebook the GPU cannot write (a version-1 header)"
    return planned


def encode_lut(fmt, cb) -> np.ndarray:
    """The encode LUT the GPU path uploads for a batch's codebook (programs._device_lut)."""
    lut = Codebook(cb.exponents, fmt.name).encode_lut()
    lut[lut == 255] = 0x80  # the kernels' ESC_FLAG
    return lut


class Encoded:
    """What an encode program gave: each blob's bytes (its length the SIZES row the scan wrote),
    and whether it fits (False: its payload is larger than the values', and the GPU path stores
    them raw instead)."""

    def __init__(self, blobs, fits):
        self.blobs, self.fits = blobs, fits


def quantizing(pipe) -> str | None:
    """The FP8 format a pipeline's QuantizeFP8 (per tensor, ahead of the fused step) quantizes to,
    or None: a pipeline whose fused step takes the input as it is."""
    front = pipe.body_steps[:-1]
    return front[0].format if front else None


def encode(exe: Path, tmp_path: Path, tensors: list[np.ndarray], fmt, pipe) -> Encoded:
    """_EncodeProgram's run on these tensors (raw bits of fmt, any shape), the output buffer
    filled with 0xAB bytes first (on a GPU it is uninitialised: every byte of a blob must be
    written).  A pipeline with QuantizeFP8 (per tensor) in front: the quantizing program
    (_EncodeProgram's quantize, one tensor of 16-bit bits of fmt): kvz_amax and kvz_quant_table,
    then kvz_encode and kvz_scan's quantizing instances, which write the FP8 format's blob."""
    (plans_, cb), chunk, k = plans(tensors, fmt, pipe), pipe.body_steps[-1].chunk, len(tensors)
    quantize, source = (fmt.name, fmt) if quantizing(pipe) else (None, None)
    if quantize:
        assert k == 1, "a quantizing encode program takes one tensor"
        fmt = FORMATS[quantizing(pipe)]
    arena, launches = Arena(), Launches()
    templates = {}
    for p in plans_:
        templates.setdefault(p.header, sum(len(h) for h in templates))
    starts = list(accumulate((p.blob_bytes for p in plans_), initial=0))
    chunk_base = list(accumulate((p.nchunks for p in plans_), initial=0))
    sb_base = list(accumulate((-(-p.nchunks // programs.SB_CHUNKS) for p in plans_), initial=0))
    total_chunks, total_sb, slot = chunk_base[-1], sb_base[-1], programs.slot_size(chunk, fmt.name)
    work_nb = 8 * (1 + k + total_sb + programs.QUEUE_WORDS + k)
    auto = cb is None
    hist_at = work_nb
    if auto:
        work_nb += 4 * k * ((1 << fmt.exp_bits) + 1)
    enc, scan, _, _ = loader.instances(fmt)
    if quantize:
        enc, scan = loader.quantizing_encode(fmt)
    # The program's regions (templates, zeroed work, sizes, escape slots, (quantize) amax and
    # table, (auto) LUT rows and codebooks, job tables), the inputs, the output buffer and the
    # published totals (pinned host memory on a GPU).
    srcs = [arena.add(t) for t in tensors]
    out = arena.add(np.full(max(starts[-1], 1), 0xAB, np.uint8))
    tmpl = arena.add(np.frombuffer(b"".join(templates), np.uint8))
    work = arena.add(work_nb)
    sizes = arena.add(SIZES.nbytes * k)
    slot_pos, slot_exp = arena.add(2 * total_chunks * slot), arena.add(total_chunks * slot)
    ready = arena.add(8 * k)
    if quantize:
        amax, qtable = arena.add(16), arena.add(quantize_kernels.TABLE_BYTES)
    if auto:
        luts, books = arena.add(k * programs.AUTO_LUT_BYTES), arena.add(k * 16)
    else:
        lut = arena.add(encode_lut(fmt, cb))
    enc_rows, fin_rows = [], []
    for i, p in enumerate(plans_):
        pay = out + starts[i] + len(p.header)
        enc_rows.append(dict(src=srcs[i], n=p.n, codes=At(pay + p.off["codes"]), rest=At(pay + p.off["rest"]),
                             esc_count=At(pay + p.off["esc_count"]), esc_pos=At(pay + p.off["esc_pos"]),
                             slot_pos=At(slot_pos + 2 * slot * chunk_base[i]),
                             slot_exp=At(slot_exp + slot * chunk_base[i]),
                             chunk_base=chunk_base[i], sb_base=sb_base[i],
                             q_table=qtable if quantize else 0,
                             q_scale=At(pay + p.off["scales"]) if quantize else 0,
                             lut=At(luts + programs.AUTO_LUT_BYTES * i) if auto else lut))
        fin_rows.append(dict(blob=At(out + starts[i]), tmpl=At(tmpl + templates[p.header]), header_len=len(p.header),
                             table_at=p.table_at, var_base=p.off["esc_pos"], pad=p.pads, write_header=1,
                             compact=int(p.compact), codebook=At(books + 16 * i) if auto else 0))
    jobs, fin = arena.table(ENCODE, enc_rows), arena.table(FINISH, fin_rows)
    if quantize:  # QuantizeFP8's scale and table (the table kernel writes the blob's scales stream)
        p = plans_[0]
        names = loader.amax_name(source.name), loader.quant_table_name(source.name, fmt.name)
        launches.add(names[0], max(1, min(-(-(p.n // 8) // quantize_kernels.THREADS), DEVICE_BLOCKS * 8)),
                     AMAX_ARGS(src=0, src_at=jobs, n=p.n, out=amax))
        launches.add(names[1], quantize_kernels.TABLE_BYTES // quantize_kernels.THREADS,
                     QUANT_TABLE_ARGS(amax=amax, scale=0, addrs=jobs, scale_word=ENCODE.col("q_scale"),
                                      scale_span=p.nxt["scales"] - p.off["scales"], table=qtable))
    if auto:
        runs = max(sample_plan(p.n).blocks for p in plans_)
        grid = (max(1, min(-(-runs // programs.AUTO_UNROLL), DEVICE_BLOCKS * programs.AUTO_BLOCKS_PER_SM // k)), k)
        launches.add(loader.auto_codebook(fmt), grid,
                     AUTO_CODEBOOK_ARGS(jobs=jobs, work=work, hist_at=hist_at // 8, luts=luts, books=books))
    if total_chunks:
        launches.add(enc, min(math.ceil(total_chunks / programs.WARPS), DEVICE_BLOCKS),
                     ENCODE_ARGS(jobs=jobs, njobs=k, total_chunks=total_chunks, chunk=chunk, slot=slot, work=work,
                                 queue_at=1 + k + total_sb, ready=ready))
    launches.add(scan, k + total_sb,  # k blocks finish the blobs (headers)
                 SCAN_ARGS(jobs=jobs, njobs=k, chunk=chunk, slot=slot, work=work, chunk_off=0, fin=fin, sizes=sizes,
                           heads=0, expect=0, span=0, down=0, flag=0, runs=0))
    after = harness.run_fused(exe, tmp_path, arena.bytes(), arena.pointer_words, launches.names, launches.ops)
    rows = after[sizes:sizes + SIZES.nbytes * k].view(np.uint64).reshape(k, SIZES.columns).astype(np.int64)
    published = after[ready:ready + 8 * k].view(np.uint64)
    buffer = after[out:out + starts[-1]]
    blobs, fits = [], []
    for i, p in enumerate(plans_):
        payload = int(rows[i, SIZES.col("payload_len")])
        # Every tensor with chunks has its totals published (ready: flagged), which give the
        # length the scan wrote.
        totals = int(published[i])
        if p.nchunks:
            assert totals >> 63 and programs.payload_bytes(p.off["esc_pos"], totals, fmt.high_exp_bits) == payload
        blobs.append(bytes(buffer[starts[i]:starts[i] + len(p.header) + payload]))
        fits.append(payload <= p.raw_payload)
    return Encoded(blobs, fits)


def opened(blob: bytes, pipe):
    """(the frame, its codebook, the chunk size) of a blob as executor.decode_general opens it on
    the CPU, and where each of the frame's streams starts in the blob."""
    u8 = np.frombuffer(blob, np.uint8)
    hdr = container.parse_header(container.read_head(get_backend("cpu"), u8), u8.shape[0])
    frame = staged.frame_from_header(get_backend("cpu"), u8, hdr)
    fused = pipe.recorded(frame.meta).body_steps[-1]
    starts = {name: a.ctypes.data - u8.ctypes.data for name, a in frame.streams.items()}
    return frame, fused.check(frame), fused.chunk, starts


STREAMS = ("codes", "rest", "esc_count", "esc_pos", "esc_exp", "exp_high")


class Decoded:
    """What a decode program gave: each blob's values; the work's verdict words after the
    decoder (the scan's ticket, each blob's error, the deferred checks); and the scan's early
    verdict: those words as its last block sent them, the flag and the run count."""

    def __init__(self, values, verdict, early, flag, runs):
        self.values, self.verdict, self.early, self.flag, self.runs = values, verdict, early, flag, runs

    @property
    def errors(self) -> np.ndarray:
        return self.verdict[1:-1]


def decode(exe: Path, tmp_path: Path, blobs: list[bytes], pipe, heavy: bool | None = None,
           dequantize: bool = False) -> Decoded:
    """_DecodeProgram's run on blobs of one format and chunk size as the general decode makes it
    (decode_batch's rows).  heavy: the escape-heavy decoder instance or not (None: as
    programs.heavy chooses).  dequantize: blobs of a QuantizeFP8 (per tensor) pipeline decoded
    to their 16-bit values (_DecodeProgram's dequantize: kvz_dequant_tables from each blob's
    scale, then kvz_decode's dequantizing instance); else to the FP8 codes."""
    opened_blobs = [opened(b, pipe) for b in blobs]
    frames = [o[0] for o in opened_blobs]
    rows = []
    for frame, cb, _, starts in opened_blobs:
        dlo, dhi = programs.dlut_words(cb)
        rows.append(dict(**{name: starts[name] for name in STREAMS}, n=frame.n,
                         n_esc=frame.streams["esc_pos"].shape[0], n_high=frame.streams["exp_high"].shape[0],
                         dlo=dlo, dhi=dhi, **({"dq_scale": starts["scales"]} if dequantize else {})))
    fmt, chunk = frames[0].format, opened_blobs[0][2]
    if dequantize:
        return _decode(exe, tmp_path, fmt, chunk, blobs, rows, False,
                       dequantize=(fmt.name, frames[0].meta["quantize_fp8"]["source_format"]))
    if heavy is None:
        heavy = programs.heavy(fmt, sum(f.n for f in frames), sum(f.streams["esc_pos"].shape[0] for f in frames))
    return _decode(exe, tmp_path, fmt, chunk, blobs, rows, heavy)


def decode_guessed(exe: Path, tmp_path: Path, blobs: list[bytes], layouts: list, heavy: bool | None = None) -> Decoded:
    """_DecodeProgram's run on blobs guessed to be of these layouts (layout_cache.Layout, of one
    format and chunk size), as layout_cache.decode_guessed makes it: each row its layout's
    guess_row, the scan's first blocks checking each header against its layout's expect
    (guess_head) and filling in the escape fields.  A blob whose header is not its layout's
    gets the error GUESS_MISSED."""
    rows = [dict(zip(DECODE.words, layout.guess_row[0].tolist())) for layout in layouts]
    if heavy is None:
        escapes = sum(layout_cache._escapes_at_most(layout, len(b)) for layout, b in zip(layouts, blobs))
        heavy = programs.heavy(layouts[0].fmt, sum(layout.n for layout in layouts), escapes)
    return _decode(exe, tmp_path, layouts[0].fmt, layouts[0].chunk, blobs, rows, heavy,
                   expect=[layout.expect for layout in layouts])


def _decode(exe, tmp_path, fmt, chunk, blobs, rows, heavy, expect=None, dequantize=None) -> Decoded:
    """The decode program on blobs whose job rows (by field name) hold stream offsets from the
    blob's start, as the host adds each blob's address to them; expect: guessed layouts'
    blanked headers (programs._DecodeProgram's expect); dequantize: (FP8 format, 16-bit format),
    the rows' dq_scale the scale's offset in the blob."""
    k, ns = len(blobs), tuple(int(r["n"]) for r in rows)
    _, _, scan, dec = loader.instances(fmt)
    dec = loader.dequantizing_decode(fmt) if dequantize else loader.heavy_decode(fmt) if heavy else dec
    out_fmt = FORMATS[dequantize[1]] if dequantize else fmt  # what the blobs decode to
    arena, launches = Arena(), Launches()
    at_blob = [arena.add(np.frombuffer(b, np.uint8)) for b in blobs]
    out_at, chunk_base, sb_base, fixed = 0, 0, 0, []
    for n in ns:
        fixed.append((out_at, chunk_base, sb_base))
        out_at += -(-n * out_fmt.itemsize // programs.BLOB_ALIGN) * programs.BLOB_ALIGN
        nchunks = -(-n // chunk)
        chunk_base += nchunks
        sb_base += -(-nchunks // programs.SB_CHUNKS)
    dst = arena.add(np.full(max(out_at, 1), 0xAB, np.uint8))  # uninitialised on a GPU
    queue_at = programs._decode_status_at(k) + sb_base  # work ends with kvz_decode's chunk queues
    work = arena.add(8 * (queue_at + programs.QUEUE_WORDS))
    offs = arena.add(8 * chunk_base)
    errors_nb = 8 * (2 + k)
    # The scan's early verdict (graphs' mapped words), sent by its last block where the tuning asks.
    early = bool(chunk_base and tuning.tuning_for(fmt.name).early_verdict)
    down, flag, runs = arena.add(errors_nb), arena.add(4), arena.add(4)
    guess = expect is not None
    heads = expected = 0
    if guess:
        heads = arena.table(HEADS, [dict(ptr=blob, len=len(b)) for blob, b in zip(at_blob, blobs)])
        expected_rows = np.zeros((k, programs.HEAD_SPAN), np.uint8)
        for row, key in zip(expected_rows, expect):
            row[:len(key)] = np.frombuffer(key, np.uint8)
        expected = arena.add(expected_rows)
    tables = arena.add(512 * k) if dequantize else 0  # each blob's 256 16-bit values (kvz_dequant_tables)
    dq = [dict(dq_table=At(tables + 512 * i), dq_scale=At(blob + row["dq_scale"])) if dequantize else {}
          for i, (row, blob) in enumerate(zip(rows, at_blob))]
    jobs = arena.table(DECODE, [{**row, **{name: At(blob + row[name]) for name in STREAMS}, "dst": At(dst + out),
                                 "chunk_base": cbase, "sb_base": sbase, **d}
                                for row, blob, (out, cbase, sbase), d in zip(rows, at_blob, fixed, dq)])
    if dequantize:
        launches.add(loader.dequant_tables_name(*dequantize), k,
                     DEQUANT_TABLES_ARGS(addrs=jobs, word=DECODE.col("dq_scale"), stride=DECODE.columns, single=0,
                                         tables=tables))
    scan_blocks = sb_base + (k if guess else 0)  # on guessed layouts the first k check the headers
    if scan_blocks:
        launches.add(scan, scan_blocks,
                     SCAN_ARGS(jobs=jobs, njobs=k, chunk=chunk, slot=0, work=work, chunk_off=offs, fin=0, sizes=0,
                               heads=heads, expect=expected, span=programs.HEAD_SPAN if guess else 0,
                               down=down if early else 0, flag=flag if early else 0, runs=runs if early else 0))
    if chunk_base:
        grid = min(math.ceil(chunk_base / programs.WARPS), DEVICE_BLOCKS)
        split_at, shift = programs._decode_split(fmt if not dequantize else None, chunk_base, grid * programs.WARPS)
        units = split_at + ((chunk_base - split_at) << shift)
        launches.add(dec, grid, DECODE_ARGS(jobs=jobs, njobs=k, units=units, chunk=chunk, chunk_off=offs, work=work,
                                            queue_at=queue_at, scan_blocks=scan_blocks, split_at=split_at,
                                            part_shift=shift))
    after = harness.run_fused(exe, tmp_path, arena.bytes(), arena.pointer_words, launches.names, launches.ops)
    values = [after[dst + out:dst + out + n * out_fmt.itemsize].view(out_fmt.uint_dtype)
              for (out, _, _), n in zip(fixed, ns)]
    return Decoded(values, after[work:work + errors_nb].view(np.uint64), after[down:down + errors_nb].view(np.uint64),
                   int(after[flag:flag + 4].view(np.uint32)[0]), int(after[runs:runs + 4].view(np.uint32)[0]))


def heads(exe: Path, tmp_path: Path, blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """programs.head_block's program (_HeadsProgram: kvz_gather_heads, kvz_check_heads) on blobs:
    (their first HEAD_SPAN bytes, a row each, the bytes past a blob's end as the region held them
    before; what kvz_check_heads found of each header, CHECKS rows)."""
    k, span = len(blobs), programs.HEAD_SPAN
    arena, launches = Arena(), Launches()
    at_blob = [arena.add(np.frombuffer(b, np.uint8)) for b in blobs]
    jobs = arena.table(HEADS, [dict(ptr=blob, len=len(b)) for blob, b in zip(at_blob, blobs)])
    block, checks = arena.add(np.full(k * span, 0xAB, np.uint8)), arena.add(CHECKS.nbytes * k)
    launches.add("kvz_gather_heads", (4, k), GATHER_HEADS_ARGS(jobs=jobs, span=span, dst=block))
    launches.add("kvz_check_heads", k, CHECK_HEADS_ARGS(heads=jobs, span=span, checks=checks))
    after = harness.run_fused(exe, tmp_path, arena.bytes(), arena.pointer_words, launches.names, launches.ops)
    return (after[block:block + k * span].reshape(k, span),
            after[checks:checks + CHECKS.nbytes * k].view(np.uint64).reshape(k, CHECKS.columns))
