"""ChannelPack: the ratio mode's lossless code, tensor -> streams in one step.

Each value's exponent is coded through its channel's two-level table (kvzip/channel_codebook.py:
the channels, and the tables chosen from the tensor itself, or calibrated offline and given as a
ChannelCodebook): a fixed 3-bit code a value, codes
0..6 the channel's 7 most frequent exponents, code 7 "a 3-bit second-level index follows" for
the next 8; any other exponent is an escape (a uint16 position in its chunk and the exponent
byte, as EscapeStream lists them).  The sign+mantissa bits (the "rest") stay raw, packed as
Top16Pack packs them.  Values are cut into chunks of ``chunk`` values that decode independently;
a chunk whose second-level indices and escapes would take more bytes than its exponents' high
bits is plane-coded instead (as EscapeStream does): its codes hold each exponent's low 3 bits,
exp_high the other E - 3.

Streams (docs/format.md section 15 is their normative description): tables, codes, rest,
esc_count, sec_count, sec_codes, esc_pos, esc_exp, exp_high.  The CPU kernels are in
stages/channel_pack_cpu.py (the reference); on a CUDA backend with CuPy arrays (``on_device``)
the stage runs kvzip/gpu/channel_pack.py's CUDA kernels on the device, which give the same bytes
and the same errors; on the CPU, and under the Numba simulator, it runs the CPU kernels.  The
fused GPU executor does not take this pipeline (kvzip/gpu/executor.py ``takes``): it runs stage
by stage, and where ChannelPack is the last step before Serialize on a GPU and the blob takes the
version-3 header, the kernels write the blob itself (``blob_header``, ``encode_blob``).
"""
from __future__ import annotations

import json
from functools import lru_cache

import numpy as np

from kvzip import container
from kvzip.bitpack import groups
from kvzip.channel_codebook import (CODE_BITS, TABLE_WIDTH, ChannelCodebook, channels_of, check_tables, encode_lut,
                                   rank_tables)
from kvzip.errors import CHANNEL_DECODE_ERRORS, FormatError
from kvzip.frame import Frame

from . import channel_pack_cpu
from .base import CHANNEL_CODED, TENSOR, Stage, on_device, register
from .escape_stream import check_chunk

MAX_CHUNK = 32768  # a chunk's second-level count is a uint16: at most 32768 values
VARIABLE_STREAMS = (("sec_codes", np.uint8), ("esc_pos", np.uint16), ("esc_exp", np.uint8), ("exp_high", np.uint8))


@register
class ChannelPack(Stage):
    id = "channel_pack"
    input_kind = (TENSOR,)
    output_kind = CHANNEL_CODED
    consumes = ("data",)
    produces = ("tables", "codes", "rest", "esc_count", "sec_count") + tuple(name for name, _ in VARIABLE_STREAMS)

    def __init__(self, chunk: int = 4096, codebook=None):
        """codebook: None (each tensor's own tables, chosen from it) or a ChannelCodebook (or its
        dict) calibrated offline, whose tables code every tensor of its format and channels."""
        self.chunk = check_chunk(chunk, MAX_CHUNK)
        if isinstance(codebook, dict):
            codebook = ChannelCodebook.from_dict(codebook)
        if codebook is not None and not isinstance(codebook, ChannelCodebook):
            raise ValueError(f"channel_pack's codebook is a ChannelCodebook (kvzip.calibrate_channels), its dict or "
                             f"None, got {type(codebook).__name__}")
        self.codebook = codebook

    def get_config(self):
        config = {"id": self.id, "chunk": self.chunk}
        if self.codebook is not None:
            config["codebook"] = self.codebook.to_dict(provenance=False)
        return config

    def recorded_config(self):
        """The blob holds the tables it was coded with, whatever chose them: a decoder needs the
        chunk only (and the compact header can stand for this config)."""
        return {"id": self.id, "chunk": self.chunk}

    def tables_for(self, frame: Frame):
        """The calibrated tables stream for this tensor frame (ValueError where its format or
        channels differ from the codebook's), or None: the tensor's own."""
        if self.codebook is None:
            return None
        self.codebook.check_tensor(frame.format, frame.meta["shape"])
        return self.codebook.tables_stream()

    def encode(self, frame: Frame) -> Frame:
        fmt, backend, n, C = frame.format, frame.backend, frame.n, self.chunk
        data = frame.expect("data", fmt.uint_dtype, n)
        channels = channels_of(frame.meta["shape"])
        given = self.tables_for(frame)
        if on_device(backend):
            from kvzip.gpu import channel_pack as gpu

            return frame.replace(drop=("data",), **gpu.encode(data, n, fmt, channels, C, given))
        src = backend.to_numpy(data)
        tables = given if given is not None else rank_tables(channel_pack_cpu.histogram(src, fmt, channels)).reshape(-1)
        G, nchunks = groups(n), -(-n // C)
        codes, rest = np.empty(CODE_BITS * G, np.uint8), np.empty(fmt.rest_bits * G, np.uint8)
        esc_count, sec_count = np.empty(nchunks, np.uint16), np.empty(nchunks, np.uint16)
        variable = channel_pack_cpu.encode(src, n, fmt, channels, encode_lut(tables, fmt), C, codes, rest,
                                           esc_count, sec_count)
        streams = dict(tables=tables, codes=codes, rest=rest, esc_count=esc_count, sec_count=sec_count,
                       **{name: a for (name, _), a in zip(VARIABLE_STREAMS, variable)})
        if backend.name != "cpu":
            streams = {name: backend.from_numpy(a) for name, a in streams.items()}
        return frame.replace(drop=("data",), **streams)

    def blob_header(self, frame: Frame, checksum: bool) -> bytes | None:
        """On a GPU (``on_device``), for a tensor frame of a [channel_pack, serialize] pipeline: the
        version-3 header of its blob with its counts still 0 (encode_blob sets them); None where
        the kernels cannot write the blob themselves (the CPU, or a blob the header cannot hold:
        Serialize writes that one from ``encode``'s streams)."""
        if not on_device(frame.backend):
            return None
        return _header(json.dumps(frame.meta, sort_keys=True), self.chunk, checksum)

    def encode_blob(self, frame: Frame, head: bytes, checksum: bool) -> tuple[Frame, int]:
        """(the blob frame Serialize(checksum) would make of this stage's streams, its payload's
        length): written by the GPU kernels in place behind ``head`` (blob_header's)."""
        from kvzip.gpu import channel_pack as gpu

        fmt, n = frame.format, frame.n
        data = frame.expect("data", fmt.uint_dtype, n)
        blob, payload = gpu.encode_blob(data, n, fmt, channels_of(frame.meta["shape"]), self.chunk, head, checksum,
                                        self.tables_for(frame))
        return Frame(frame.backend, {"blob": blob}, dict(frame.meta)), payload

    def check(self, frame: Frame, tables: bool = True) -> dict:
        """The streams, on the frame's backend, after checking their dtypes, the lengths n implies
        and, with ``tables``, the tables (copied to the host for it; on a GPU the offsets scan
        checks them instead, and the per-chunk counts are checked by the decode kernels)."""
        fmt, n = frame.format, frame.n
        G = groups(n)
        # The codes stream's length bounds n by the blob's size: checked before anything is sized by n.
        out = {"codes": frame.expect("codes", np.uint8, CODE_BITS * G)}
        channels = channels_of(frame.meta["shape"])
        out["rest"] = frame.expect("rest", np.uint8, fmt.rest_bits * G)
        out["tables"] = frame.expect("tables", np.uint8, channels * TABLE_WIDTH)
        nchunks = -(-n // self.chunk)
        for name in ("esc_count", "sec_count"):
            out[name] = frame.expect(name, np.uint16, nchunks)
        frame.require(*(name for name, _ in VARIABLE_STREAMS))
        for name, dtype in VARIABLE_STREAMS:
            a = frame.streams[name]
            if a.ndim != 1 or a.dtype != dtype:
                raise FormatError(f"stream {name!r} must be 1-D {np.dtype(dtype)}, got {a.dtype} {tuple(a.shape)}")
            out[name] = a
        if out["esc_pos"].shape[0] != out["esc_exp"].shape[0]:
            raise FormatError("esc_pos and esc_exp differ in length")
        if tables:
            check_tables(frame.backend.to_numpy(out["tables"]), fmt)
        return out

    def decode(self, frame: Frame) -> Frame:
        fmt, backend, n = frame.format, frame.backend, frame.n
        device = on_device(backend)
        s = self.check(frame, tables=not device)  # on a GPU the scan checks them (no copy to the host)
        channels = channels_of(frame.meta["shape"])
        if device:
            from kvzip.gpu import channel_pack as gpu

            dst, error = gpu.decode(s, n, fmt, channels, self.chunk)
        else:
            s = {name: backend.to_numpy(a) for name, a in s.items()}
            dst = np.empty(n, fmt.uint_dtype)
            code = channel_pack_cpu.decode(s["codes"], s["rest"], s["tables"], channels, s["esc_count"],
                                           s["sec_count"], s["sec_codes"], s["esc_pos"], s["esc_exp"], s["exp_high"],
                                           n, fmt, self.chunk, dst)
            error = CHANNEL_DECODE_ERRORS[code] if code else None
            if backend.name != "cpu":
                dst = backend.from_numpy(dst)
        if error:
            raise FormatError(error)
        return frame.replace(drop=self.produces, data=dst)


def encode_blobs(stage: ChannelPack, frames: list, heads: list, checksum: bool) -> list[tuple[Frame, int]]:
    """stage.encode_blob of each tensor frame (on a GPU, ``on_device``) under its blob_header,
    with one wait for all of them (kvzip/gpu/channel_pack.py's encode_blobs)."""
    from kvzip.gpu import channel_pack as gpu

    jobs = []
    for frame, head in zip(frames, heads):
        fmt, n = frame.format, frame.n
        jobs.append((frame.expect("data", fmt.uint_dtype, n), n, fmt, channels_of(frame.meta["shape"]), stage.chunk,
                     head, checksum, stage.tables_for(frame)))
    return [(Frame(frame.backend, {"blob": blob}, dict(frame.meta)), payload)
            for frame, (blob, payload) in zip(frames, gpu.encode_blobs(jobs))]


def decode_many(items: list) -> list:
    """ChannelPack.decode of each (stage, opened frame) on a GPU (``on_device``), in order: the
    decoded frame, or the FormatError its blob raises.  Their kernels (which check the tables
    too) run with one wait for all (kvzip/gpu/channel_pack.py)."""
    from kvzip.gpu import channel_pack as gpu

    out, jobs = [None] * len(items), []
    for k, (stage, frame) in enumerate(items):
        try:
            s = stage.check(frame, tables=False)
        except FormatError as e:
            out[k] = e
            continue
        jobs.append((k, (s, frame.n, frame.format, channels_of(frame.meta["shape"]), stage.chunk)))
    for (k, _), (dst, error) in zip(jobs, gpu.decode_many([job for _, job in jobs])):
        stage, frame = items[k]
        out[k] = FormatError(error) if error else frame.replace(drop=stage.produces, data=dst)
    return out


@lru_cache(maxsize=256)
def _header(meta_json: str, chunk: int, checksum: bool) -> bytes | None:
    """ChannelPack.blob_header for a tensor frame's metadata (as canonical JSON) and chunk: the
    compact header with every count 0, or None where it cannot stand for the blob's version-1
    header."""
    from kvzip.formats import FORMATS

    meta = json.loads(meta_json)
    streams = container.ratio_streams(meta["n"], FORMATS[meta["format"]], channels_of(meta["shape"]), chunk)
    return container.compact_header(meta, streams, container.FLAG_CHECKSUM if checksum else 0)
