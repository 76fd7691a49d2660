"""The fused ExponentSplit -> Top16Pack -> EscapeStream path: one pass over the values.

Same bytes as the three stages run one by one (tests assert it, and that this path ran).
The CPU twin runs chunk ranges in threads (stages/fused_cpu.py); the CUDA version is a few kernels on the caller's stream,
with one host synchronisation to learn how many escapes there are.  Both call the helpers in
kvzip/bitlogic.py, so the bit logic exists once.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvzip.bitlogic import PLANE, cuda_helpers
from kvzip import container, layout
from kvzip.bitpack import groups
from kvzip.checksum import sum64
from kvzip.errors import DECODE_ERRORS, FormatError
from kvzip.frame import Frame
from kvzip.jit import numba_cuda

from . import fused_cpu
from .escape_stream import chunk_layout
from kvzip.codebook import codebook_meta, frame_codebook

# numba.cuda, imported by _cuda_kernels on first CUDA use (a CPU install has no numba-cuda).  A
# module global, not a local: the CUDA simulator swaps the kernel module's global ``cuda``.
cuda = None


# ----------------------------------------------------------------------------- CPU twin
def _encode_cpu(src, n, E, M, lut, C, codes, rest, esc_count, esc_pos, esc_exp, exp_high):
    """The CPU encode (stages/fused_cpu.py: chunk ranges in threads); returns (escapes, exp_high bytes)."""
    return fused_cpu.encode(src, n, E, M, lut, C, codes, rest, esc_count, esc_pos, esc_exp, exp_high)


def _decode_cpu(codes, rest, esc_count, esc_pos, esc_exp, exp_high, n, E, M, dlut, C, dst, check=None):
    """The CPU decode into dst; returns 0 or a key of kvzip.errors.DECODE_ERRORS.  check (a
    container.PayloadCheck): verified on the way, from the words the decode reads; where the
    decode failed, by a pass of its own first, so that a corrupted payload's checksum error wins."""
    if check is None:
        return fused_cpu.decode(codes, rest, esc_count, esc_pos, esc_exp, exp_high, n, E, M, dlut, C, dst)[0]
    code, inner = fused_cpu.decode(codes, rest, esc_count, esc_pos, esc_exp, exp_high, n, E, M, dlut, C, dst,
                                   check.words(), check.stream_at("codes"), check.stream_at("rest"))
    if inner is None:
        check.verify()
    else:
        check.finish(inner)
    return code


# ----------------------------------------------------------------------------- CUDA
@lru_cache(maxsize=None)
def _cuda_kernels():
    global cuda
    cuda = numba_cuda()

    h = cuda_helpers()
    encode_group, encode_group_plane, decode_group = h.encode_group, h.encode_group_plane, h.decode_group
    value_exponent, popcount8, patch_exponent = h.value_exponent, h.popcount8, h.patch_exponent

    @cuda.jit
    def encode_groups(src, n, E, M, lut, codes, rest, masks):
        g = cuda.grid(1)
        if g < masks.shape[0]:
            masks[g] = encode_group(src, n, g, E, M, lut, codes, rest)

    @cuda.jit
    def count_escapes(masks, n, E, C, esc_count):
        c = cuda.grid(1)
        if c < esc_count.shape[0]:
            gpc = C // 8
            g0 = c * gpc
            g1 = min(g0 + gpc, masks.shape[0])
            count = 0
            for g in range(g0, g1):
                count += popcount8(int(masks[g]))
            esc_count[c] = PLANE if count > ((E - 4) * (g1 - g0)) // 3 else count

    @cuda.jit
    def scatter_escapes(src, n, E, M, C, masks, esc_count, esc_off, plane_off, codes, esc_pos, esc_exp, exp_high):
        c = cuda.grid(1)
        if c < esc_count.shape[0]:
            gpc = C // 8
            g0 = c * gpc
            g1 = min(g0 + gpc, masks.shape[0])
            if esc_count[c] == PLANE:
                hoff = plane_off[c]
                for g in range(g0, g1):
                    encode_group_plane(src, n, g, E, M, codes, exp_high, hoff)
                    hoff += E - 4
            else:
                k = esc_off[c]
                for g in range(g0, g1):
                    mask = int(masks[g])
                    for j in range(8):
                        if (mask >> j) & 1:
                            i = g * 8 + j
                            esc_pos[k] = i - c * C
                            esc_exp[k] = value_exponent(int(src[i]), E, M)
                            k += 1

    @cuda.jit
    def decode_groups(codes, rest, esc_count, plane_off, exp_high, n, E, M, dlut, C, dst, err):
        g = cuda.grid(1)
        if g < (n + 7) // 8:
            gpc = C // 8
            c = g // gpc
            if esc_count[c] == PLANE:
                hoff = plane_off[c] + (E - 4) * (g - c * gpc)
                if hoff + (E - 4) > exp_high.shape[0]:
                    err[0] = 5
                    return
                decode_group(codes, rest, n, g, E, M, dlut, True, exp_high, hoff, dst)
            else:
                decode_group(codes, rest, n, g, E, M, dlut, False, exp_high, 0, dst)

    @cuda.jit
    def patch_escapes(esc_count, esc_off, plane_off, esc_pos, esc_exp, n_high, n, E, M, C, dst, err):
        c = cuda.grid(1)
        nchunks = esc_count.shape[0]
        if c < nchunks:
            gpc = C // 8
            ngroups = min(gpc, (n + 7) // 8 - c * gpc)
            cnt = int(esc_count[c])
            if c == nchunks - 1:  # the totals must match the stream lengths exactly
                last = 0 if cnt == PLANE else cnt
                if esc_off[c] + last != esc_pos.shape[0]:
                    err[0] = 2
                plane_end = plane_off[c] + ((E - 4) * ngroups if cnt == PLANE else 0)
                if plane_end != n_high:
                    err[0] = 5
            if cnt == PLANE:
                return
            if cnt > ((E - 4) * ngroups) // 3:
                err[0] = 1
                return
            if esc_off[c] + cnt > esc_pos.shape[0]:
                err[0] = 2
                return
            length = min(C, n - c * C)
            prev = -1
            for k in range(esc_off[c], esc_off[c] + cnt):
                pos = int(esc_pos[k])
                e = int(esc_exp[k])
                if pos >= length or pos <= prev:
                    err[0] = 3
                    return
                elif e >= (1 << E):
                    err[0] = 4
                else:
                    patch_exponent(dst, c * C + pos, e, E, M)
                prev = pos

    return encode_groups, count_escapes, scatter_escapes, decode_groups, patch_escapes


THREADS = 256


def _blocks(n):
    return (n + THREADS - 1) // THREADS


def _chunk_offsets(xp, esc_count, chunk_groups, HB):
    """Exclusive prefix sums: where each chunk's escapes and exp_high bytes start."""
    counts = esc_count.astype(xp.int64)
    plane = counts == PLANE
    listed = xp.where(plane, 0, counts)
    plane_bytes = xp.where(plane, HB * chunk_groups, 0)
    esc_off = xp.cumsum(listed) - listed
    plane_off = xp.cumsum(plane_bytes) - plane_bytes
    return esc_off, plane_off, listed, plane_bytes


# ----------------------------------------------------------------------------- the fused stage
class FusedSplitPackEscape:
    """ExponentSplit + Top16Pack + EscapeStream as one step (built by the Pipeline)."""

    def __init__(self, top16, escape):
        self.top16 = top16
        self.chunk = escape.chunk

    def encode(self, frame: Frame) -> Frame:
        fmt, backend, n, C = frame.format, frame.backend, frame.n, self.chunk
        xp = backend.xp
        src = frame.expect("data", fmt.uint_dtype, n)
        cb = self.top16.codebook_of(frame)
        G = groups(n)
        HB = fmt.high_exp_bits
        nchunks, chunk_groups, _ = chunk_layout(n, C)
        codes = backend.empty(4 * G, np.uint8)
        rest = backend.empty(fmt.rest_bits * G, np.uint8)
        esc_count = backend.empty(nchunks, np.uint16)
        lut = backend.from_numpy(cb.encode_lut())
        if backend.name == "cpu":
            cap = HB * G // 3
            esc_pos, esc_exp, exp_high = np.empty(cap, np.uint16), np.empty(cap, np.uint8), np.empty(HB * G, np.uint8)
            ne, nh = _encode_cpu(src, n, fmt.exp_bits, fmt.mant_bits, lut, C, codes, rest, esc_count, esc_pos, esc_exp, exp_high)
            esc_pos, esc_exp, exp_high = esc_pos[:ne].copy(), esc_exp[:ne].copy(), exp_high[:nh].copy()
        else:
            k_enc, k_count, k_scatter, _, _ = _cuda_kernels()
            masks = backend.empty(G, np.uint8)
            E, M = fmt.exp_bits, fmt.mant_bits
            backend.launch(k_enc, _blocks(G), THREADS, src, n, E, M, lut, codes, rest, masks)
            backend.launch(k_count, _blocks(nchunks), THREADS, masks, n, E, C, esc_count)
            esc_off, plane_off, listed, plane_bytes = _chunk_offsets(xp, esc_count, backend.from_numpy(chunk_groups), HB)
            # The one host synchronisation: how long the escape streams are.
            ne, nh = (int(v) for v in backend.to_numpy(xp.stack([listed.sum(), plane_bytes.sum()]))) if nchunks else (0, 0)
            esc_pos, esc_exp, exp_high = backend.empty(ne, np.uint16), backend.empty(ne, np.uint8), backend.empty(nh, np.uint8)
            backend.launch(k_scatter, _blocks(nchunks), THREADS, src, n, E, M, C, masks, esc_count, esc_off, plane_off,
                           codes, esc_pos, esc_exp, exp_high)
        out = frame.replace(drop=("data",), codes=codes, rest=rest, esc_count=esc_count, esc_pos=esc_pos,
                            esc_exp=esc_exp, exp_high=exp_high)
        out.meta["codebook"] = codebook_meta(cb)
        return out

    def encode_blob(self, frame: Frame, checksum: bool):
        """encode + Serialize on the CPU, the streams written in place: the blob of frame, or None
        where its payload would be larger than the values' (the caller then stores them raw).

        The header's length does not depend on the escape counts (stream lengths sit in its
        fixed-size table, not in its JSON), so it is known first; codes, rest and esc_count go
        straight to their places in the blob, the short escape streams after them once counted.
        That saves copying every stream into a new blob (~15 % of a BF16 encode,
        benchmarks/NOTES.md).  Same bytes as Serialize.encode: canonical stream order, zero
        padding, the sum over the payload."""
        fmt, n, C = frame.format, frame.n, self.chunk
        src = frame.expect("data", fmt.uint_dtype, n)
        cb = self.top16.codebook_of(frame)
        G, HB, R = groups(n), fmt.high_exp_bits, fmt.rest_bits
        nchunks = -(-n // C)
        meta = dict(frame.meta)
        meta["codebook"] = codebook_meta(cb)
        names, dtypes = zip(*layout.FUSED_STREAMS)  # codes, rest, esc_count, then the escape streams
        flags = layout.FLAG_CHECKSUM if checksum else 0
        cap = HB * G // 3
        fixed = [4 * G, R * G, 2 * nchunks]
        # The header's length does not follow the escape counts: sized with none.  A compact one
        # (the preset pipeline's) is that header with its counts set once they are known.
        head = container.header_for(meta, [(k, t, nb) for k, t, nb in zip(names, dtypes, fixed + [0, 0, 0])], flags)
        header_len = len(head)
        compact = layout.version_of(head) == layout.COMPACT_VERSION
        most = layout.place(fixed + [layout.ESC_POS_BYTES * cap, cap, HB * G])[1]
        # Pages past the blob's end are never written, so never take memory.
        buf = np.empty(header_len + most, np.uint8)
        at = layout.place(fixed + [0])[0]
        codes, rest = buf[header_len + at[0]:][:4 * G], buf[header_len + at[1]:][:R * G]
        esc_count = buf[header_len + at[2]:][:2 * nchunks].view(np.uint16)
        esc_pos, esc_exp, exp_high = np.empty(cap, np.uint16), np.empty(cap, np.uint8), np.empty(HB * G, np.uint8)
        ne, nh = _encode_cpu(src, n, fmt.exp_bits, fmt.mant_bits, cb.encode_lut(), C, codes, rest, esc_count,
                             esc_pos, esc_exp, exp_high)
        streams = (codes, rest, esc_count, esc_pos[:ne], esc_exp[:ne], exp_high[:nh])
        offsets, payload_len = layout.place([a.nbytes for a in streams])
        if payload_len > layout.place([n * fmt.itemsize])[1]:
            return None
        blob = buf[:header_len + payload_len]
        end = 0
        for off, a in zip(offsets, streams):
            blob[header_len + end:header_len + off] = 0  # padding
            if off >= at[3]:  # the escape streams (the first three are in place)
                blob[header_len + off:header_len + off + a.nbytes] = a.view(np.uint8)
            end = off + a.nbytes
        blob[header_len + end:] = 0
        total = sum64(np, blob[header_len:]) if checksum else 0
        if compact:
            head = container.with_counts(head, ne, nh, checksum=total)
        else:
            head = container.header_for(meta, [(k, t, a.nbytes) for k, t, a in zip(names, dtypes, streams)], flags, total)
        blob[:header_len] = np.frombuffer(head, np.uint8)
        return Frame(frame.backend, {"blob": blob}, meta)

    def check(self, frame: Frame):
        """Validate the fused streams' dtypes and the lengths the header implies; returns the codebook.
        (Per-chunk counts, positions and totals are checked by the decode kernels themselves.)"""
        fmt, n = frame.format, frame.n
        cb = frame_codebook(frame)
        G = groups(n)
        # The codes stream's length bounds n by the blob size: check it before sizing anything by n.
        frame.expect("codes", np.uint8, 4 * G)
        frame.expect("rest", np.uint8, fmt.rest_bits * G)
        frame.expect("esc_count", np.uint16, -(-n // self.chunk))
        frame.require("esc_pos", "esc_exp", "exp_high")
        for name, dtype in (("esc_pos", np.uint16), ("esc_exp", np.uint8), ("exp_high", np.uint8)):
            a = frame.streams[name]
            if a.ndim != 1 or a.dtype != dtype:
                raise FormatError(f"stream {name!r} must be 1-D {np.dtype(dtype)}, got {a.dtype} {tuple(a.shape)}")
        if frame.streams["esc_pos"].shape[0] != frame.streams["esc_exp"].shape[0]:
            raise FormatError("esc_pos and esc_exp differ in length")
        return cb

    def finish_decode(self, frame: Frame, dst) -> Frame:
        out = frame.replace(drop=("codes", "rest", "esc_count", "esc_pos", "esc_exp", "exp_high"), data=dst)
        out.meta.pop("codebook", None)
        return out

    def decode(self, frame: Frame, check=None) -> Frame:
        """check: a CPU frame's payload checksum, still to verify (container.PayloadCheck)."""
        fmt, backend, n, C = frame.format, frame.backend, frame.n, self.chunk
        if check is not None and backend.name != "cpu":
            check.verify()  # only the CPU kernels sum as they decode
            check = None
        cb = self.check(frame)
        xp = backend.xp
        G = groups(n)
        nchunks, chunk_groups, _ = chunk_layout(n, C)
        codes, rest, esc_count = frame.streams["codes"], frame.streams["rest"], frame.streams["esc_count"]
        streams = {k: frame.streams[k] for k in ("esc_pos", "esc_exp", "exp_high")}
        E, M = fmt.exp_bits, fmt.mant_bits
        dlut = backend.from_numpy(cb.decode_lut())
        dst = backend.empty(n, fmt.uint_dtype)
        if backend.name == "cpu":
            code = _decode_cpu(codes, rest, esc_count, streams["esc_pos"], streams["esc_exp"], streams["exp_high"],
                               n, E, M, dlut, C, dst, check)
        else:
            _, _, _, k_dec, k_patch = _cuda_kernels()
            esc_off, plane_off, _, _ = _chunk_offsets(xp, esc_count, backend.from_numpy(chunk_groups), fmt.high_exp_bits)
            err = backend.zeros(1, np.int32)
            backend.launch(k_dec, _blocks(G), THREADS, codes, rest, esc_count, plane_off, streams["exp_high"], n, E, M,
                           dlut, C, dst, err)
            backend.launch(k_patch, _blocks(nchunks), THREADS, esc_count, esc_off, plane_off, streams["esc_pos"],
                           streams["esc_exp"], streams["exp_high"].shape[0], n, E, M, C, dst, err)
            code = int(backend.to_numpy(err)[0])
        if code:
            raise FormatError(DECODE_ERRORS[code])
        return self.finish_decode(frame, dst)
