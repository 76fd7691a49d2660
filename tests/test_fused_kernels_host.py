"""kvzip/gpu/kernels/fused.cu (the speed mode's fast path: kvz_auto_codebook, kvz_encode, kvz_scan,
kvz_decode and its escape-heavy instance, kvz_gather_heads and kvz_check_heads) run on the host,
without a GPU: tests/cuda_host/emu.h makes every GPU thread a host thread and every warp
intrinsic a rendezvous of its warp, and tests/cuda_host/fused_programs.py lays out
kvzip/gpu/programs.py's programs (job rows, work words, launches, arguments) for
tests/cuda_host/fused_host.cpp.  Every format's blobs must be the CPU reference's bytes
(kvzip.compress(..., backend="cpu"); where the payload comes out larger than the values, which
both paths then store raw, the CPU stages' blob without that fallback), every padding byte
written, and the decode must give back the input's bits.  The data: KV-like values, random bits,
the shipped real KV sample, 1 % and 3 % escapes, escapes clustered into chunks that fill a slot
and past the plane-coding threshold, the sample scaled past the shipped codebook (plane-coded
chunks beside listed ones, a cut-short last chunk plane-coded), exact zeros, tails that end a chunk early, small
chunks whose tensors span several scan blocks, batches, compact and version-1 headers.  Decodes
on guessed layouts (the scan checking the headers) must miss the blobs that are not the
layout's, and the header read-back must find what its host twin finds.  The quantizing encode
program (QuantizeFP8 per tensor fused in: quantize.cu's kvz_amax and kvz_quant_table, then
kvz_encode and kvz_scan's quantizing instances reading BF16 or FP16 input, E5M2 and E4M3 out)
must write the CPU pipeline's blob too, decoding to its FP8 codes and, through kvz_decode's
dequantizing instance, to its 16-bit values.

Caught by these tests (each checked by breaking it in the kernels): a plane-coded chunk's high
bytes put one group off where the slot's positions end, the scan's copy of them dropping its
last 16-byte word or reading a cut-short chunk's last bytes one off, kvz_encode's plane pass
writing over the slot before its lanes' escape stores are done (no __syncwarp), the listing of
escapes stopped one short of the plane-coding threshold, a padding byte left unwritten, a version-1
header's escape entry off, an escape patched into the wrong group of a decoder step or at the
wrong bits of an E5M2 quad, a stored chunk's first escape left unpatched (the early and
scattered chunks), a look-back prefix that skips its nearest inclusive predecessor, a guessed
header taken without comparing it with the layout's, a header check that lets a blob cut short
through, an escape-heavy step that gives up its round of escapes when the round's last is the next
step's first value, asks again for the round it holds or misreads the position of one asked for
ahead, a staged tail group copied or decoded a value short, an encoder step's escape placed one
off in a group (either way of placing them: ballots, or the counts' shuffle scan), its counts
packed into the wrong word, a group's total missing a lane, a scan block's chunk search one off,
its moves' last group or second round skipped; in the quantizing instances alone: an escape placed
one value off, a tail group's last value dropped, the scan's second round of moves skipped; a
dequantized store through the wrong table entry.  Needs g++ (C++20)."""
from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from cuda_host import fused_programs as fp
from cuda_host import harness

import kvzip
from kvzip import container, fp8_bits, layout, staged
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.backends import get_backend
from kvzip.codebook import Codebook
from kvzip.data import load_sample
from kvzip.formats import FORMATS
from kvzip.gpu import layout_cache, loader, programs
from kvzip.stages.quantize_fp8 import QuantizeFP8

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the host harness")


@pytest.fixture(scope="module")
def exes(tmp_path_factory):
    """fmt -> fused_host built with that format's kernels (each build takes seconds); an FP8
    format's with its quantizing encode and dequantizing decode, and quantize.cu's kernels they
    run after, from either 16-bit source."""
    built = {}

    def exe(fmt):
        if fmt.name not in built:
            names = (*loader.instances(fmt), loader.heavy_decode(fmt), loader.auto_codebook(fmt), *loader.HEAD_KERNELS)
            if fmt.itemsize == 1:  # the quantizing encode's kernels, from either 16-bit source
                names += (*loader.quantizing_encode(fmt), loader.dequantizing_decode(fmt),
                          *(k for src in loader.QUANTIZE_SOURCES
                            for k in (loader.amax_name(src), loader.quant_table_name(src, fmt.name),
                                      loader.dequant_tables_name(fmt.name, src))))
            built[fmt.name] = harness.build_fused(names, tmp_path_factory.mktemp(f"fused_host_{fmt.name}"))
        return built[fmt.name]

    return exe


def real_bf16(n: int, seed: int = 0) -> np.ndarray:
    """n values of the shipped real KV sample (BF16 bits), from a seeded place in it."""
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    return np.resize(np.roll(sample, -int(np.random.default_rng(seed).integers(0, sample.size))), n)


def with_exponents(fmt, bits: np.ndarray, at: np.ndarray, exponents) -> np.ndarray:
    """bits with the values at `at` given these exponents."""
    out = bits.astype(np.uint64)
    mask = np.uint64(((1 << fmt.exp_bits) - 1) << fmt.mant_bits)
    out[at] = (out[at] & ~mask) | (np.asarray(exponents, np.uint64) << np.uint64(fmt.mant_bits))
    return out.astype(fmt.uint_dtype)


def values(fmt, n: int, kind: str, chunk: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 1 << (8 * fmt.itemsize), n, dtype=np.uint64).astype(fmt.uint_dtype)
    if kind == "real":
        bits = real_bf16(n, seed)
        wide = bits.astype(np.uint32) << 16  # the same values as float32
        if fmt.name == "fp16":  # rounded to float16
            with np.errstate(over="ignore"):
                return wide.view(np.float32).astype(np.float16).view(np.uint16)
        return wide if fmt.name == "fp32" else bits
    rate = {"escapes-1%": 0.01, "escapes-3%": 0.03}.get(kind, 0.002)
    bits = kt.kv_like_bits(fmt, n, escape_rate=rate, seed=seed).reshape(-1)
    if kind == "zeros":
        bits[rng.random(n) < 0.6] = 0
    if kind == "all-zeros":
        bits[:] = 0
    if kind == "layer-scaled":
        # the shipped sample x2^3 (kvzip.bench's escape sweep row): chunks plane-coded or not,
        # mixed, as their values fall
        rows = real_bf16(-(-n // 64) * 64, seed).reshape(-1, 64)
        bits = kt.kv_variant(rows, "layer-scaled", layer=6).reshape(-1)[:n]
        return bits.astype(np.uint32) << 16 if fmt.name == "fp32" else bits
    if kind == "clustered":
        # Rare exponents (outside the default codebook, each too rare for an auto one) crowded
        # into a few chunks: one holding as many as a chunk lists (its slot nearly full), one
        # past the plane-coding threshold, and runs in the last, partial chunk.
        outside = np.setdiff1d(np.arange(1 << fmt.exp_bits), Codebook.default_for(fmt).exponents)
        nchunks = -(-n // chunk)
        most = fmt.high_exp_bits * (chunk // 8) // 3  # listed; one more and the chunk is plane-coded
        for c, count in ((1, most), (nchunks // 2, chunk // 2), (nchunks - 1, 40)):
            lo, hi = c * chunk, min(n, (c + 1) * chunk)
            at = lo + np.sort(rng.choice(hi - lo, min(count, hi - lo), replace=False))
            bits = with_exponents(fmt, bits, at, rng.choice(outside, at.size))
    return bits


def reference(bits: np.ndarray, fmt, chunk: int, codebook) -> tuple[bytes, bool]:
    """(the CPU's blob of the fused stages, whether it is compress()'s: False where compress
    stores the values raw, its payload being larger)."""
    pipe = fp.pipeline(chunk, codebook)
    frame = staged.tensor_frame(bits.reshape(-1), fmt, bits.shape, get_backend("cpu"))
    frame.meta["pipeline"] = pipe.stage_configs
    blob = bytes(pipe.stages[-1].encode(pipe.body_steps[-1].encode(frame)).streams["blob"])
    compressed = bytes(kvzip.compress(bits, dtype=fmt.name, chunk=chunk, codebook=codebook, backend="cpu"))
    stored = bool(container.parse_header(compressed[:layout.MAX_HEADER], len(compressed)).flags & layout.FLAG_STORED)
    assert stored or compressed == blob
    return blob, not stored


def escapes_of(blob: bytes) -> tuple[int, np.ndarray]:
    """(escapes, each chunk's esc_count) of a fused blob."""
    hdr = container.parse_header(blob[:layout.MAX_HEADER], len(blob))
    s = {name: (off, nbytes) for name, _, off, nbytes in hdr.streams}
    off, nbytes = s["esc_count"]
    return s["esc_pos"][1] // 2, np.frombuffer(blob, np.uint16, nbytes // 2, hdr.header_len + off)


def check_encode_and_decode(exes, tmp_path, fmt, tensors, chunk=4096, codebook="auto"):
    pipe = fp.pipeline(chunk, codebook)
    got = fp.encode(exes(fmt), tmp_path, tensors, fmt, pipe)
    refs = [reference(t, fmt, chunk, codebook) for t in tensors]
    for i, ((want, fits), blob) in enumerate(zip(refs, got.blobs)):
        assert got.fits[i] == fits, i
        assert blob == want, i  # every byte: header, streams, padding (the buffer started as 0xAB)
    nonempty = [b for t, b in zip(tensors, got.blobs) if t.size]
    back = fp.decode(exes(fmt), tmp_path, nonempty, pipe)
    for t, v in zip([t for t in tensors if t.size], back.values):
        assert np.array_equal(v, t.reshape(-1))
    assert not back.errors.any()
    assert np.array_equal(back.early, back.verdict) and back.flag == back.runs == 1  # the early verdict, sent once
    return got.blobs


# (format, values, chunk, kind)
CASES = [
    ("bf16", 4096 * 20 + 77, 4096, "kv"), ("bf16", 4096 * 24, 4096, "real"), ("bf16", 4096 * 6 + 5, 4096, "random"),
    ("bf16", 4096 * 20 + 8, 4096, "escapes-1%"), ("bf16", 4096 * 20 + 3, 4096, "escapes-3%"),
    ("bf16", 4096 * 20 + 1000, 4096, "clustered"), ("bf16", 4096 * 5 + 17, 4096, "zeros"),
    ("bf16", 4096 * 2 + 9, 4096, "all-zeros"), ("bf16", 7, 4096, "kv"), ("bf16", 1024 * 20 + 500, 1024, "clustered"),
    ("bf16", 32 * 256 * 3 + 40, 32, "escapes-1%"),  # four scan blocks chained by the look-back
    ("bf16", 4096 * 64 + 5, 4096, "escapes-3%"),  # a scan block whose escapes leave the slots in two rounds
    ("fp16", 2048 * 20 + 33, 2048, "kv"), ("fp16", 4096 * 12, 4096, "real"), ("fp16", 4096 * 16 + 5, 4096, "clustered"),
    ("e5m2", 4096 * 20 + 64, 4096, "escapes-3%"), ("e5m2", 4096 * 12, 4096, "clustered"),
    ("e5m2", 4096 * 6 + 13, 4096, "kv"), ("e5m2", 64 * 256 * 2 + 32, 64, "escapes-1%"),
    ("e4m3", 4096 * 8 + 3, 4096, "kv"), ("e4m3", 4096 * 3, 4096, "random"),
    ("fp32", 4096 * 12 + 6, 4096, "escapes-1%"), ("fp32", 4096 * 8, 4096, "real"),
    ("fp32", 4096 * 8 + 1, 4096, "clustered"),
]
# (format, values, chunk, kind) encoded with the shipped codebook (codebook=None), which leaves
# them escape-heavy: the shipped sample x2^3 (kvzip.bench's escape sweep row), plane-coded
# chunks beside listed ones in every scan block, the last chunk (cut short) plane-coded
SHIPPED_CASES = [("bf16", 4096 * 20 + 2820, 4096, "layer-scaled"), ("fp32", 4096 * 6 + 640, 4096, "layer-scaled")]


@pytest.mark.parametrize("name,n,chunk,kind", CASES)
def test_kernels_write_the_cpu_blob_and_decode_it(exes, tmp_path, name, n, chunk, kind):
    fmt = FORMATS[name]
    check_encode_and_decode(exes, tmp_path, fmt, [values(fmt, n, kind, chunk, seed=n)], chunk)


@pytest.mark.parametrize("name,n,chunk,kind", SHIPPED_CASES)
def test_kernels_write_the_cpu_blob_under_the_shipped_codebook(exes, tmp_path, name, n, chunk, kind):
    fmt = FORMATS[name]
    check_encode_and_decode(exes, tmp_path, fmt, [values(fmt, n, kind, chunk, seed=n)], chunk, codebook=None)


@pytest.mark.parametrize("name", ["bf16", "e5m2"])
def test_a_batchs_blobs_each_the_cpu_blob(exes, tmp_path, name):
    """Several tensors in one launch of each kernel (an empty one among them: it has no chunks),
    each with its own codebook (auto), shape and tail, the first chunks of each dealt to warps
    of both blocks."""
    fmt = FORMATS[name]
    tensors = [values(fmt, 4096 * 5 + 3, "kv", 4096, seed=1), np.zeros(0, fmt.uint_dtype),
               values(fmt, 4096 * 9, "clustered", 4096, seed=2).reshape(9, 64, 64),
               values(fmt, 4096 * 3 + 100, "escapes-3%", 4096, seed=3)]
    if name == "bf16":
        tensors.append(real_bf16(3 * 64 * 64, seed=4).reshape(3, 64, 64))
    check_encode_and_decode(exes, tmp_path, fmt, tensors)


LONG_SHAPE = (1,) * 7  # a shape of more sides than a compact header holds: a version-1 header


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_the_shipped_codebook(exes, tmp_path, name):
    """codebook=None: the batch's one LUT (programs._device_lut's) instead of kvz_auto_codebook's;
    with it a version-1 header (payload length and escape entries of its stream table written by
    finish_blob) beside compact ones."""
    fmt = FORMATS[name]
    long = values(fmt, 4096 * 3 + 50, "escapes-3%", 4096, seed=4)
    check_encode_and_decode(exes, tmp_path, fmt, [values(fmt, 4096 * 10 + 9, "escapes-1%", 4096, seed=5),
                                                   long.reshape(LONG_SHAPE + long.shape),
                                                   values(fmt, 4096 * 4, "clustered", 4096, seed=6)], codebook=None)


@pytest.mark.parametrize("name", ["bf16", "fp16", "e5m2"])
def test_both_decoder_instances_give_the_values(exes, tmp_path, name):
    """kvz_decode's escape-heavy instance (chunks of many escapes written into each step in shared
    memory) and the common one decode the same blobs, whichever programs.heavy would choose."""
    fmt = FORMATS[name]
    bits = values(fmt, 4096 * 16 + 21, "clustered", 4096, seed=7)
    blob, _ = reference(bits, fmt, 4096, "auto")
    for heavy in (False, True):
        back = fp.decode(exes(fmt), tmp_path, [blob], fp.pipeline(), heavy=heavy)
        assert np.array_equal(back.values[0], bits) and not back.errors.any(), heavy


def staged_edges(fmt, n: int, chunk: int, seed: int) -> np.ndarray:
    """KV-like values whose chunks each hold more escapes than kvz_decode's escape-heavy instance
    leaves to the register path (decode.cu's SCATTER_MIN), placed where a staged step could slip,
    three kinds of chunk in turn (fewer escapes each than would make FP16's plane-coded): the
    chunk's first and last values, a group of 8 escapes and the values on either side of every
    multiple of 256 (the decoders' steps are 256 to 1024 values); a run of 70 (more than two
    rounds of 32) inside a step and one across a step's end; rounds that end on a step's end
    (escapes 993-1024 and 2017-2048: a round's last escape is a step's first value), then more.
    The last chunk, cut short, ends in a partial group of escapes."""
    rng = np.random.default_rng(seed)
    bits = kt.kv_like_bits(fmt, n, seed=seed).reshape(-1)
    outside = np.setdiff1d(np.arange(1 << fmt.exp_bits), Codebook.default_for(fmt).exponents)
    for c in range(-(-n // chunk)):
        lo, length = c * chunk, min(chunk, n - c * chunk)
        if c % 3 == 0:
            at = {0, 1, length - 1, *range(8 * 37, 8 * 38), *(s + d for s in range(256, chunk, 256) for d in (-1, 0))}
            at |= set(rng.choice(length, 10, replace=False).tolist())
        elif c % 3 == 1:
            at = {*range(1100, 1170), *range(2010, 2080), *rng.choice(length, 10, replace=False).tolist()}
        else:
            at = {*range(993, 1025), *range(2017, 2049), *rng.choice(range(2049, length), 40, replace=False).tolist()}
        if c == n // chunk:  # the partial last chunk: its partial last group, and enough to be staged
            at |= {*range(length - length % 8, length), *rng.choice(length, 24, replace=False).tolist()}
        at = np.array(sorted(p for p in at if 0 <= p < length))
        bits = with_exponents(fmt, bits, lo + at, rng.choice(outside, at.size))
    return bits


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32", "e5m2"])
def test_escape_heavy_chunks_at_step_edges(exes, tmp_path, name):
    """The escape-heavy instance's staged chunks (every escape written into the step's values in
    shared memory before each group's one store) against the CPU's blob and values, and the common
    instance on the same blob: escapes at chunk ends, step ends, in full groups, in runs of several
    rounds, rounds ending on a step's end, and (not BF16, whose last chunks are dealt in parts) a
    tail chunk.  E5M2's whole chunks take the quad path, its tail the group path.  Enough chunks
    that some are past the warps' first (decoded early, patched in memory) and before the split
    tail (parts take the register path)."""
    fmt = FORMATS[name]
    chunk, n = 4096, 4096 * 40 + 1005
    warps = fp.DEVICE_BLOCKS * programs.WARPS
    assert programs._decode_split(fmt, -(-n // chunk), warps)[0] > warps
    bits = staged_edges(fmt, n, chunk, seed=11)
    blobs = check_encode_and_decode(exes, tmp_path, fmt, [bits], chunk, codebook=None)  # the escapes placed, no others
    escapes, counts = escapes_of(blobs[0])
    exponents = (bits.astype(np.uint64) >> np.uint64(fmt.mant_bits)) & np.uint64((1 << fmt.exp_bits) - 1)
    assert escapes == np.count_nonzero(~np.isin(exponents, Codebook.default_for(fmt).exponents))
    assert programs.heavy(fmt, n, escapes) and (counts >= loader.tuning.tuning_for(name).scatter_min).all()
    assert (counts != layout.PLANE).all()
    for heavy in (False, True):
        back = fp.decode(exes(fmt), tmp_path, blobs, fp.pipeline(chunk, None), heavy=heavy)
        assert np.array_equal(back.values[0], bits) and not back.errors.any(), heavy


@pytest.mark.parametrize("name,codebook,sides", [("bf16", "auto", ()), ("fp16", None, ()), ("e5m2", "auto", ()),
                                                  ("bf16", None, LONG_SHAPE)])
def test_guessed_layouts_decode_the_blobs_that_are_theirs(exes, tmp_path, name, codebook, sides):
    """A decode on guessed layouts (layout_cache.decode_guessed: the scan's first blocks check each
    header against its layout, guess_head, and fill in its escape fields; with codebook="auto"
    each blob's own codebook read from its header): the blobs of the layout decode, a blob of
    another shape and one whose header's CRC fails are missed (GUESS_MISSED), the rest of the
    batch unharmed."""
    fmt, chunk, n = FORMATS[name], 4096, 4096 * 12
    pipe = fp.pipeline(chunk, codebook)
    tensors = [values(fmt, n, kind, chunk, seed=seed).reshape(sides + (n,))
               for kind, seed in (("escapes-1%", 8), ("clustered", 9))]
    (plan, *_), cb = fp.plans(tensors[:1], fmt, pipe)
    guessed = layout_cache.planned(plan, fmt, tensors[0].shape, chunk, cb)
    blobs = [reference(t, fmt, chunk, codebook)[0] for t in tensors]
    other_shape = reference(tensors[0].reshape(-1, 64), fmt, chunk, codebook)[0]
    crc_broken = bytearray(blobs[0])
    crc_broken[layout.HEADER_CRC.offset] ^= 1
    got = fp.decode_guessed(exes(fmt), tmp_path, [blobs[0], other_shape, bytes(crc_broken), blobs[1]], [guessed] * 4)
    assert got.errors.tolist() == [0, programs.GUESS_MISSED, programs.GUESS_MISSED, 0]
    assert np.array_equal(got.values[0], tensors[0].reshape(-1)) and np.array_equal(got.values[3], tensors[1].reshape(-1))


def test_header_checks_are_the_hosts(exes, tmp_path):
    """The batched decode's header read-back (programs.head_block: kvz_gather_heads, kvz_check_heads)
    gives each blob's first bytes and what layout_cache.head_checks, its host twin, finds of them:
    for compact and version-1 headers, one whose CRC fails, a blob cut short, one shorter than a
    prefix, one stored raw."""
    fmt = FORMATS["bf16"]
    kv = values(fmt, 4096 * 6 + 7, "escapes-1%", 4096, seed=10)
    compact = reference(kv, fmt, 4096, "auto")[0]
    version1 = reference(kv.reshape(LONG_SHAPE + kv.shape), fmt, 4096, None)[0]
    crc_broken = bytearray(version1)
    crc_broken[layout.HEADER_CRC.offset + 1] ^= 4
    stored = bytes(kvzip.compress(values(fmt, 5000, "random", 4096), dtype="bf16", backend="cpu"))
    blobs = [compact, version1, bytes(crc_broken), version1[:len(version1) // 2], compact[:10], stored]
    block, checks = fp.heads(exes(fmt), tmp_path, blobs)
    lengths = np.array([len(b) for b in blobs])
    for row, b in zip(block, blobs):
        assert row[:min(len(b), programs.HEAD_SPAN)].tobytes() == b[:programs.HEAD_SPAN]
    assert np.array_equal(checks, layout_cache.head_checks(block, lengths))
    assert checks[:, 0].tolist() == [1, 1, 0, 0, 0, 1]  # a stored blob's header hangs together (flags are match's)


def test_cases_hold_what_they_are_named_for():
    """The cases reach what the kernels do differently: escapes at the rates named, a slot nearly
    full, plane-coded chunks (kvz_encode's plane pass, the scan's copy of their high bytes, in
    16-byte words or, for small chunks, bytes), one at a tensor's end, one in a scan block that
    also lists escapes, blobs stored raw, a scan block of more escapes than its threads move in
    one round (escapes.cuh's MOVE_BATCH a thread)."""
    seen = set()
    for (name, n, chunk, kind), codebook in [(c, "auto") for c in CASES] + [(c, None) for c in SHIPPED_CASES]:
        fmt = FORMATS[name]
        bits = values(fmt, n, kind, chunk, seed=n)
        blob, fits = reference(bits, fmt, chunk, codebook)
        seen |= set() if fits else {"stored"}
        if fits and fmt.name != "e4m3":
            seen |= escape_paths(blob, n, chunk, kind, fmt.name, name)
    assert seen == {"stored", "slot nearly full", "plane", "plane in bytes", "plane tail", "plane beside listed",
                    "two move rounds"}


def escape_paths(blob, n, chunk, kind, fmt_name, case) -> set:
    """The escape paths a case's blob takes in the kernels: "slot nearly full" (a chunk lists more
    escapes than 3/4 of its slot), "plane" (a plane-coded chunk), "plane in bytes" (one whose high
    bytes are not whole 16-byte words: escapes.cuh's place_plane_high), "plane tail" (the last
    chunk, cut short, plane-coded, its high bytes ending in a partial 16-byte word that lies in the
    slot's exponent part), "plane beside listed" (a scan block with plane-coded chunks and
    listed escapes), "two move rounds" (a scan block of more escapes than its threads move in one
    round, escapes.cuh's MOVE_BATCH a thread); and the escape rate an "escapes-R%" case names,
    checked."""
    escapes, counts = escapes_of(blob)
    if kind.startswith("escapes-"):
        rate = float(kind[len("escapes-"):-1]) / 100
        assert 0.6 * rate < escapes / n < 1.2 * rate, (case, kind, escapes / n)
    plane = counts == layout.PLANE
    listed = counts[~plane]
    blocks = np.arange(0, counts.size, programs.SB_CHUNKS)
    per_block = np.add.reduceat(np.where(plane, 0, counts).astype(np.int64), blocks)
    planes_per_block = np.add.reduceat(plane.astype(np.int64), blocks)
    slot = programs.slot_size(chunk, fmt_name)
    paths = {"slot nearly full"} if (listed > 3 * slot // 4).any() else set()
    if plane.any():
        paths |= {"plane"} | ({"plane in bytes"} if FORMATS[fmt_name].high_exp_bits * chunk // 8 % 16 else set())
        tail = FORMATS[fmt_name].high_exp_bits * -(-(n % chunk) // 8)  # the last chunk's high bytes, if cut short
        paths |= {"plane tail"} if plane[-1] and tail % 16 and tail > 2 * slot else set()
        paths |= {"plane beside listed"} if ((planes_per_block > 0) & (per_block > 0)).any() else set()
    return paths | ({"two move rounds"} if (per_block > move_round_size()).any() else set())


@functools.cache
def move_round_size() -> int:
    """Escapes a scan block moves in one round: escapes.cuh's MOVE_BATCH a thread."""
    source = (Path(programs.__file__).parent / "kernels" / "escapes.cuh").read_text()
    return int(re.search(r"#define MOVE_BATCH (\d+)", source).group(1)) * programs.SB_CHUNKS


# ---------------------------------------------------------------- the quantizing encode
# QuantizeFP8 (one scale a tensor) ahead of the fused step: programs._EncodeProgram's quantize
# program (kvz_amax, kvz_quant_table, then kvz_encode<..., true> and kvz_scan<..., true>; the
# encoder reads the 16-bit input and quantizes each value as it loads, in the dense pass and in
# the plane pass of plane-coded chunks).


def quantize_pipeline(fp8: str, chunk: int = 4096, codebook=None):
    """The pipeline whose GPU lane runs the quantizing program (tests/gpu/test_quantize_gpu.py's)."""
    return kvzip.Pipeline([QuantizeFP8(fp8), S.ExponentSplit(), S.Top16Pack(codebook), S.EscapeStream(chunk),
                           S.Serialize()])


def widened(fp8, source) -> np.ndarray:
    """Each FP8 code's value in the 16-bit source format (exact: both hold every FP8 value)."""
    f32 = np.array([fp8_bits.widen_to_f32(c, fp8.exp_bits, fp8.mant_bits, fp8.name == "e4m3") for c in range(256)],
                   np.uint32)
    if source.name == "bf16":
        return (f32 >> 16).astype(np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        return f32.view(np.float32).astype(np.float16).view(np.uint16)


def quantized_input(fp8, source, n: int, kind: str, chunk: int, seed: int) -> np.ndarray:
    """16-bit input (source's bits) for the quantizing encode.  "real", "random", "kv-scaled":
    the shipped sample, random bits, KV-like source values, each quantized at its own scale.  The
    other kinds are values()'s FP8 data of that kind widened to the source format, one value the
    FP8 format's largest so that the scale is 1 and the codes are that data: its escape rates,
    clustered chunks, zeros."""
    rng = np.random.default_rng(seed)
    if kind == "real":
        bits = real_bf16(n, seed)
        if source.name == "fp16":
            with np.errstate(over="ignore"):
                return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float16).view(np.uint16)
        return bits
    if kind == "random":
        return rng.integers(0, 1 << 16, n, dtype=np.uint64).astype(np.uint16)
    if kind == "kv-scaled":
        return kt.kv_like_bits(source, n, escape_rate=0.01, seed=seed).reshape(-1)
    bits = widened(fp8, source)[values(fp8, n, kind, chunk, seed)]
    if n:
        top = fp8_bits.max_finite_code(fp8.exp_bits, fp8.mant_bits, fp8.name == "e4m3")
        bits[rng.integers(0, n)] = widened(fp8, source)[top]
    return bits


def quantized_reference(bits: np.ndarray, source, pipe) -> tuple[bytes, bool, np.ndarray]:
    """(the CPU's blob of the quantizing pipeline without the stored fallback, whether it is the
    pipeline's blob, the FP8 codes QuantizeFP8 gives on the CPU)."""
    frame = fp.fused_input(bits, source, pipe)
    blob = bytes(pipe.stages[-1].encode(pipe.body_steps[-1].encode(frame)).streams["blob"])
    encoded = bytes(pipe.encode(bits, dtype=source.name))
    stored = bool(container.parse_header(encoded[:layout.MAX_HEADER], len(encoded)).flags & layout.FLAG_STORED)
    assert stored or encoded == blob
    return blob, not stored, np.asarray(frame.streams["data"]).reshape(-1)


def check_quantizing_encode(exes, tmp_path, source, fp8, bits, chunk=4096, codebook=None):
    pipe = quantize_pipeline(fp8.name, chunk, codebook)
    want, fits, codes = quantized_reference(bits, source, pipe)
    got = fp.encode(exes(fp8), tmp_path, [bits], source, pipe)
    assert got.fits[0] == fits
    assert got.blobs[0] == want  # every byte: header, scale, streams, padding
    if bits.size:  # to the FP8 codes, and (kvz_decode's dequantizing instance) to the 16-bit values
        back = fp.decode(exes(fp8), tmp_path, got.blobs, pipe)
        assert np.array_equal(back.values[0], codes) and not back.errors.any()
        back = fp.decode(exes(fp8), tmp_path, got.blobs, pipe, dequantize=True)
        assert np.array_equal(back.values[0], pipe.decode(want).reshape(-1).view(np.uint16)) and not back.errors.any()
    return want


# (source, FP8 format, values, chunk, kind)
QUANTIZE_CASES = [
    ("bf16", "e5m2", 4096 * 12 + 77, 4096, "kv"), ("bf16", "e5m2", 4096 * 12, 4096, "real"),
    ("bf16", "e5m2", 4096 * 4 + 5, 4096, "random"), ("bf16", "e5m2", 4096 * 12 + 8, 4096, "escapes-1%"),
    ("bf16", "e5m2", 4096 * 12 + 3, 4096, "escapes-3%"), ("bf16", "e5m2", 4096 * 12 + 1000, 4096, "clustered"),
    ("bf16", "e5m2", 4096 * 5 + 17, 4096, "zeros"), ("bf16", "e5m2", 7, 4096, "kv"),
    ("bf16", "e5m2", 4096 * 64 + 5, 4096, "escapes-3%"),  # a scan block whose escapes leave the slots in two rounds
    ("bf16", "e5m2", 1024 * 20 + 500, 1024, "clustered"),
    ("bf16", "e4m3", 4096 * 8 + 3, 4096, "kv"), ("bf16", "e4m3", 4096 * 8, 4096, "real"),
    ("bf16", "e4m3", 4096 * 6 + 21, 4096, "kv-scaled"), ("bf16", "e4m3", 4096 * 3 + 900, 4096, "random"),
    ("fp16", "e5m2", 4096 * 10 + 33, 4096, "escapes-1%"), ("fp16", "e5m2", 4096 * 8 + 1, 4096, "clustered"),
    ("fp16", "e4m3", 4096 * 6 + 9, 4096, "real"),
]


@pytest.mark.parametrize("source,name,n,chunk,kind", QUANTIZE_CASES)
def test_quantizing_encode_writes_the_cpu_blob(exes, tmp_path, source, name, n, chunk, kind):
    fp8, src = FORMATS[name], FORMATS[source]
    check_quantizing_encode(exes, tmp_path, src, fp8, quantized_input(fp8, src, n, kind, chunk, seed=n), chunk)


def test_quantizing_cases_hold_what_they_are_named_for():
    """The quantized data reaches what the quantizing kernels do differently: E5M2 escapes at the
    rates named, a slot nearly full, plane-coded chunks (kvz_encode's plane pass, quantizing from
    the input again), one beside listed escapes, a scan block of two move rounds, tails; a blob
    stored raw.  (E4M3's default codebook holds every exponent: no
    escapes.)"""
    seen = set()
    for src, name, n, chunk, kind in QUANTIZE_CASES:
        fp8 = FORMATS[name]
        bits = quantized_input(fp8, FORMATS[src], n, kind, chunk, seed=n)
        blob, fits, _ = quantized_reference(bits, FORMATS[src], quantize_pipeline(name, chunk))
        seen |= set() if fits else {"stored"}
        seen |= {"tail"} if n % chunk else set()
        if fits and name != "e4m3":
            seen |= escape_paths(blob, n, chunk, kind, name, src)
    assert seen == {"stored", "tail", "slot nearly full", "plane", "plane beside listed", "two move rounds"}


def test_a_quantizing_pipeline_with_an_auto_codebook_gets_no_program():
    """The quantizing program has no auto codebook of its own (kvz_auto_codebook would read its
    16-bit input as FP8 codes): plans_for refuses the quantized frames of such a pipeline (their
    headers are not compact), so the GPU path encodes them staged and learns no quantizing lane."""
    pipe = quantize_pipeline("e5m2", codebook="auto")
    frame = fp.fused_input(quantized_input(FORMATS["e5m2"], FORMATS["bf16"], 4096 * 2, "kv", 4096, 0), FORMATS["bf16"],
                           pipe)
    fused = pipe.body_steps[-1]
    assert programs.plans_for([frame], fused.top16, fused.chunk, False) is None
