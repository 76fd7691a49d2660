"""Hypothesis strategies and check helpers for testing code that uses kvzip.

Shipped in the package (as zarr-python does) so that projects building on kvzip can property-test
their own pipelines, codebooks and framework glue against the same data kvzip tests itself with::

    from hypothesis import given
    from kvzip import testing as kt

    @given(kt.formats().flatmap(kt.bit_arrays))
    def test_my_transport(bits):
        ...

Hypothesis is a test extra (``pip install kvzip[test]``): this module imports without it, and
each strategy function raises ImportError with that hint when called without it.

Arrays are drawn as **raw bits**: 1-D NumPy arrays of the format's unsigned dtype
(``fmt.uint_dtype``), because that is what every bit pattern (NaN payloads included) survives in.
:func:`as_float` views them as the ml_dtypes / NumPy float dtype and :func:`as_torch` as a torch
tensor of the real float dtype; :func:`views` makes non-contiguous views of either.

Strategies whose arrays can be large (thousands of values) draw a seed and fill the bulk with
NumPy's generator, then let Hypothesis place the interesting values (specials, escapes, runs):
element-by-element generation is far too slow at these sizes, and the seed still shrinks.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .codebook import N_CODES, Codebook
from .formats import FORMATS, FloatFormat, get_format

__all__ = [
    "formats", "bit_arrays", "special_values", "special_heavy_arrays", "kv_like_arrays",
    "escape_heavy_arrays", "kv_like_bits", "shapes", "codebooks", "chunk_sizes", "pipelines", "pipeline_configs",
    "views", "quantize_fp8_available", "as_float", "as_torch", "bits_of", "assert_bits_equal",
    "assert_roundtrip", "CHUNK_SIZES", "blob_parts", "build_blob", "reseal", "with_metadata_text", "nested_json",
    "hostile_blobs", "real_kv_layers", "weight_matrix",
]

CHUNK_SIZES = tuple(1 << k for k in range(3, 17))  # 8 .. 65536, every chunk EscapeStream accepts


def _hyp():
    try:
        from hypothesis import strategies as st
    except ImportError:  # pragma: no cover - exercised only without the test extra
        raise ImportError("kvzip.testing's strategies need Hypothesis: pip install 'kvzip[test]'") from None
    return st


def _fmt(fmt) -> FloatFormat:
    return get_format(fmt)


def _rng_bits(seed: int, fmt: FloatFormat, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << fmt.width, n, dtype=np.uint64).astype(fmt.uint_dtype)


def _compose(fmt: FloatFormat, exponent, rest) -> np.ndarray:
    """Bits from exponent and rest (= sign << M | mantissa) arrays."""
    e = np.asarray(exponent, dtype=np.uint64)
    r = np.asarray(rest, dtype=np.uint64)
    M, E = fmt.mant_bits, fmt.exp_bits
    bits = ((r >> np.uint64(M)) << np.uint64(E + M)) | (e << np.uint64(M)) | (r & np.uint64((1 << M) - 1))
    return bits.astype(fmt.uint_dtype)


# ------------------------------------------------------------------------------------ formats
def formats():
    """One of kvzip's five float formats (a :class:`kvzip.FloatFormat`): bf16, fp16, fp32, e4m3, e5m2."""
    return _hyp().sampled_from(list(FORMATS.values()))


def special_values(fmt) -> np.ndarray:
    """Every bit pattern at a field boundary of ``fmt``, both signs: exponent in {0, 1, 2**E - 2,
    2**E - 1} times mantissa in {0, 1, 2**(M-1), 2**M - 1}.  That is +-0, the smallest and
    largest subnormals, the smallest and largest normals, +-Inf and quiet/signalling NaNs with
    minimal and full payloads (for e4m3fn, whose top exponent holds normals, its NaN 0x7F/0xFF)."""
    fmt = _fmt(fmt)
    E, M = fmt.exp_bits, fmt.mant_bits
    exps = sorted({0, 1, (1 << E) - 2, (1 << E) - 1})
    mants = sorted({0, 1, 1 << (M - 1), (1 << M) - 1})
    out = [(s << (E + M)) | (e << M) | m for s in (0, 1) for e in exps for m in mants]
    return np.array(sorted(set(out)), dtype=np.uint64).astype(fmt.uint_dtype)


def bit_arrays(fmt, min_size: int = 0, max_size: int = 2048):
    """1-D arrays of ``fmt``'s raw bits (``fmt.uint_dtype``), any bit pattern at all: NaN payloads,
    +-0, +-Inf, subnormals, every exponent.  Sizes in [min_size, max_size], odd sizes included.

    Either every element is drawn by Hypothesis (small arrays, shrinks to minimal examples) or
    the bulk is uniform random bits from a drawn seed with Hypothesis-chosen specials and
    repeated runs written over it."""
    st = _hyp()
    fmt = _fmt(fmt)
    top = (1 << fmt.width) - 1
    specials = special_values(fmt)

    @st.composite
    def draw_array(draw):
        n = draw(st.integers(min_size, max_size))
        if n <= 64 and draw(st.booleans()):
            vals = draw(st.lists(st.one_of(st.integers(0, top), st.sampled_from(specials.tolist())),
                                 min_size=n, max_size=n))
            return np.array(vals, dtype=np.uint64).astype(fmt.uint_dtype)
        bits = _rng_bits(draw(st.integers(0, 2**32 - 1)), fmt, n)
        if n:
            for _ in range(draw(st.integers(0, 8))):
                i = draw(st.integers(0, n - 1))
                run = draw(st.integers(1, max(1, min(n - i, 64))))
                bits[i:i + run] = draw(st.one_of(st.sampled_from(specials.tolist()), st.integers(0, top)))
        return bits

    return draw_array()


def special_heavy_arrays(fmt, min_size: int = 0, max_size: int = 2048):
    """1-D raw-bit arrays drawn (mostly or entirely) from :func:`special_values`: zeros of both
    signs, subnormals, Inf, NaNs with every payload class, the largest and smallest normals."""
    st = _hyp()
    fmt = _fmt(fmt)
    specials = special_values(fmt)

    @st.composite
    def draw_array(draw):
        n = draw(st.integers(min_size, max_size))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        bits = specials[rng.integers(0, specials.size, n)]
        share = draw(st.sampled_from([1.0, 0.9, 0.5]))
        mixed = rng.random(n) >= share
        bits[mixed] = _rng_bits(int(rng.integers(2**32)), fmt, int(mixed.sum()))
        return bits

    return draw_array()


def _geometric_pick(rng, k: int, n: int) -> np.ndarray:
    """Indices 0..k-1, index 0 most likely (the shape of a real exponent histogram)."""
    p = 0.5 ** np.arange(k) + 1e-3
    return rng.choice(k, size=n, p=p / p.sum())


def kv_like_bits(fmt, n: int, codebook=None, escape_rate: float = 0.0, seed: int = 0) -> np.ndarray:
    """Deterministic KV-like raw bits (no Hypothesis needed): ``n`` values whose exponents come
    from ``codebook`` (default: the shipped default for ``fmt``), code 0 most often, with random
    sign and mantissa; a share ``escape_rate`` of them get an exponent outside the codebook."""
    fmt = _fmt(fmt)
    cb = Codebook.default_for(fmt) if codebook is None else codebook
    rng = np.random.default_rng(seed)
    exps = np.asarray(cb.exponents)[_geometric_pick(rng, N_CODES, n)]
    outside = np.setdiff1d(np.arange(1 << fmt.exp_bits), cb.exponents)
    if outside.size and escape_rate:
        hit = rng.random(n) < escape_rate
        exps[hit] = rng.choice(outside, int(hit.sum()))
    rest = rng.integers(0, 1 << fmt.rest_bits, n, dtype=np.uint64)
    return _compose(fmt, exps, rest)


def kv_like_arrays(fmt, codebook=None, min_size: int = 0, max_size: int = 4096, escape_rate=None):
    """1-D raw-bit arrays that look like a real KV cache to the codec (:func:`kv_like_bits`):
    every exponent comes from ``codebook`` (default: the shipped default for ``fmt``), most often
    its first codes, with random sign and mantissa.  ``codebook`` may also be a strategy.

    ``escape_rate``: fraction of values given an exponent outside the codebook; None draws 0
    (escape-free) or a rate up to 0.5 % ("nearly"), the regime the codec is built for.  E4M3's
    16 exponents are all in any codebook, so its arrays never escape."""
    st = _hyp()
    fmt = _fmt(fmt)

    @st.composite
    def draw_array(draw):
        cb = codebook
        if cb is not None and not isinstance(cb, Codebook):
            cb = draw(cb)
        n = draw(st.integers(min_size, max_size))
        rate = escape_rate if escape_rate is not None else draw(st.sampled_from([0.0, 0.0, 0.001, 0.005]))
        return kv_like_bits(fmt, n, cb, rate, draw(st.integers(0, 2**32 - 1)))

    return draw_array()


def escape_heavy_arrays(fmt, codebook=None, min_size: int = 1, max_size: int = 4096):
    """1-D raw-bit arrays full of escapes, arranged in runs: KV-like stretches (exponents from
    ``codebook``, default the shipped one) alternate with stretches (up to a third of the array
    each) where a drawn share, up to 100 %, of values take exponents outside the codebook.  At any chunk size this gives chunks
    with no escapes, chunks that list their escapes and chunks dense enough to be plane-coded,
    and with the runs of high rates, whole blobs that fall back to stored-raw."""
    st = _hyp()
    fmt = _fmt(fmt)

    @st.composite
    def draw_array(draw):
        cb = codebook
        if cb is None:
            cb = Codebook.default_for(fmt)
        elif not isinstance(cb, Codebook):
            cb = draw(cb)
        n = draw(st.integers(min_size, max_size))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        exps = np.asarray(cb.exponents)[_geometric_pick(rng, N_CODES, n)]
        outside = np.setdiff1d(np.arange(1 << fmt.exp_bits), cb.exponents)
        pos = 0
        while pos < n and outside.size:
            run = draw(st.integers(1, max(1, n // 3)))
            rate = draw(st.sampled_from([0.0, 0.0, 0.005, 0.05, 0.3, 1.0]))
            seg = slice(pos, min(n, pos + run))
            hit = rng.random(seg.stop - seg.start) < rate
            sub = exps[seg]
            sub[hit] = rng.choice(outside, int(hit.sum()))
            exps[seg] = sub
            pos = seg.stop
        rest = rng.integers(0, 1 << fmt.rest_bits, n, dtype=np.uint64)
        return _compose(fmt, exps, rest)

    return draw_array()


# ------------------------------------------------------------------------------------ shapes
def shapes(max_dims: int = 5, max_side: int = 40, max_size: int = 4096, min_dims: int = 0):
    """Tensor shapes of ``min_dims`` to ``max_dims`` dimensions (0-d scalars included), sides
    0..``max_side`` (so empty tensors: any side 0), at most ``max_size`` elements."""
    st = _hyp()

    @st.composite
    def draw_shape(draw):
        ndim = draw(st.integers(min_dims, max_dims))
        shape, size = [], 1
        for _ in range(ndim):
            # Keep the element count within max_size; once a side is 0 the tensor is empty anyway.
            room = max_side if size == 0 else min(max_side, max_size // size)
            side = draw(st.integers(0, room))
            shape.append(side)
            size *= side
        return tuple(shape)

    return draw_shape()


def views(array):
    """Views of ``array`` (NumPy or torch) that are usually *not* C-contiguous: a random axis
    permutation, reversed axes (negative strides in NumPy; torch.flip copies instead), and
    strided slices.  Strategy of ``(view, description)``; the view shares memory where the
    framework allows."""
    st = _hyp()
    is_torch = type(array).__module__.startswith("torch")

    @st.composite
    def draw_view(draw):
        v, what = array, []
        nd = v.ndim
        if nd >= 2 and draw(st.booleans()):
            perm = draw(st.permutations(list(range(nd))))
            v = v.permute(*perm) if is_torch else v.transpose(perm)
            what.append(f"transpose{tuple(perm)}")
        if nd >= 1:
            index = []
            for d in range(nd):
                step = draw(st.sampled_from([1, 1, 2, 3]))
                start = draw(st.integers(0, max(0, min(2, v.shape[d] - 1))))
                if not is_torch and draw(st.integers(0, 4)) == 0:
                    index.append(slice(None, None, -step))
                    what.append(f"ax{d}[::-{step}]")
                else:
                    index.append(slice(start, None, step))
                    if (start, step) != (0, 1):
                        what.append(f"ax{d}[{start}::{step}]")
            v = v[tuple(index)]
        return v, " ".join(what) or "identity"

    return draw_view()


# ------------------------------------------------------------------------------------ codebooks
def codebooks(fmt, named: bool = False):
    """Random valid codebooks for ``fmt``: 16 distinct exponents in [0, 2**E), in random order
    (for e4m3 that is a permutation of all 16).  ``named``: also draw a short name."""
    st = _hyp()
    fmt = _fmt(fmt)
    exps = st.permutations(list(range(16))) if fmt.exp_bits == 4 else st.lists(
        st.integers(0, (1 << fmt.exp_bits) - 1), min_size=N_CODES, max_size=N_CODES, unique=True)
    names = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12) if named else st.none()
    return st.builds(lambda e, name: Codebook(e, fmt, name=name), exps, names)


def chunk_sizes():
    """An EscapeStream chunk size: a power of two from 8 to 65536 (small ones drawn more often,
    since they make more chunks out of small test arrays)."""
    st = _hyp()
    return st.one_of(st.sampled_from(CHUNK_SIZES[:5]), st.sampled_from(CHUNK_SIZES))


# ------------------------------------------------------------------------------------ pipelines
def quantize_fp8_available():
    """The QuantizeFP8 stage class, or None when this kvzip has none."""
    from . import stages

    cls = getattr(stages, "QuantizeFP8", None)
    if cls is None:
        try:
            from .stages.quantize_fp8 import QuantizeFP8 as cls  # registers the stage id
        except ImportError:
            return None
    return cls


def pipelines(fmt=None, *, lossy: bool = True, fuse=None):
    """Valid :class:`kvzip.Pipeline` objects (constructed, so the chain is checked):

    * ``[Serialize]`` (values stored as they are);
    * ``[ExponentSplit, Serialize]``;
    * ``[ExponentSplit, Top16Pack(cb), EscapeStream(chunk), Serialize(checksum)]`` (SplitZip),
      with ``cb`` None (shipped default), a shipped name, or a random codebook of ``fmt``;
    * ``[ChannelPack(chunk), Serialize(checksum)]`` (the ratio mode);
    * ``[ChannelRans(chunk), Serialize(checksum)]`` (the storage mode);
    * with ``lossy`` and QuantizeFP8 available: ``[QuantizeFP8(e5m2|e4m3, tensor|channel), ...]``
      in front of any of the above (for bf16/fp16/fp32 input; the codebook then is of the FP8 format).

    ``fmt``: the input format (None: codebooks are None or shipped names, valid for any format).
    ``fuse``: True/False, or None to draw it."""
    st = _hyp()
    from . import stages as S
    from .pipeline import Pipeline

    Q = quantize_fp8_available() if lossy else None
    fmt = None if fmt is None else _fmt(fmt)

    @st.composite
    def draw_pipeline(draw):
        front, data_fmt = [], fmt
        if Q is not None and (fmt is None or fmt.name in ("bf16", "fp16", "fp32")) and draw(st.booleans()):
            qfmt = draw(st.sampled_from(["e5m2", "e4m3"]))
            front = [Q(qfmt, draw(st.sampled_from(["tensor", "channel"])))]
            data_fmt = FORMATS[qfmt]
        ser = S.Serialize(draw(st.booleans()))
        kind = draw(st.sampled_from(["splitzip", "splitzip", "splitzip", "stored", "split", "ratio", "storage"]))
        if kind == "stored":
            body = []
        elif kind == "split":
            body = [S.ExponentSplit()]
        elif kind == "ratio":
            body = [S.ChannelPack(draw(chunk_sizes().filter(lambda c: c <= S.channel_pack.MAX_CHUNK)))]
        elif kind == "storage":
            body = [S.ChannelRans(draw(chunk_sizes().filter(lambda c: c >= S.channel_rans.MIN_CHUNK)))]
        else:
            choices = [st.none()]
            if data_fmt is not None:
                choices += [st.just(f"{data_fmt.name}-kv"), codebooks(data_fmt, named=True)]
            cb = draw(st.one_of(*choices))
            body = [S.ExponentSplit(), S.Top16Pack(cb), S.EscapeStream(draw(chunk_sizes()))]
        f = draw(st.booleans()) if fuse is None else fuse
        return Pipeline(front + body + [ser], fuse=f)

    return draw_pipeline()


def pipeline_configs(fmt=None, *, lossy: bool = True):
    """``Pipeline.to_config()`` dicts of :func:`pipelines` (JSON-able, valid for ``from_config``)."""
    return pipelines(fmt, lossy=lossy, fuse=True).map(lambda p: p.to_config())


# ------------------------------------------------------------------------------------ helpers
def as_float(bits, fmt) -> np.ndarray:
    """Raw bits as a NumPy array of the float dtype (ml_dtypes for bf16 / fp8), no copy."""
    from .arrays import numpy_dtype

    fmt = _fmt(fmt)
    return np.asarray(bits).view(fmt.uint_dtype).view(numpy_dtype(fmt.name))


def as_torch(bits, fmt):
    """Raw bits as a CPU torch tensor of the float dtype (shares memory with ``bits``)."""
    import torch

    fmt = _fmt(fmt)
    signed = {1: np.uint8, 2: np.int16, 4: np.int32}[fmt.itemsize]
    a = np.ascontiguousarray(bits).view(fmt.uint_dtype).view(signed)
    return torch.from_numpy(a).view(getattr(torch, fmt.dtype_name))


def real_kv_layers(n_layers: int, tokens: int, device: str = "cpu", values=None, kv_heads: int = 8,
                   head_dim: int = 128) -> list:
    """(k, v) torch bfloat16 tensors per layer, each [kv_heads, tokens, head_dim] (Llama-3's KV
    shape by default), tiled from real BF16 KV bits: ``values`` (1-D uint16), by default the
    shipped SmolLM2 prose sample.  Each tensor starts at its own offset of the values."""
    import torch

    if values is None:
        from .data import load_sample

        values = np.concatenate([v.view(np.uint16).reshape(-1) for v in load_sample("prose").values()])
    n = kv_heads * tokens * head_dim
    src = torch.from_numpy(values.astype(np.int16)).to(device)
    tiled = src.repeat(-(-(n + src.numel()) // src.numel()))
    layers = []
    for i in range(n_layers):
        offsets = [(i * 2 + j) * 7919 % src.numel() for j in range(2)]
        layers.append(tuple(tiled[o:o + n].view(torch.bfloat16).reshape(kv_heads, tokens, head_dim).clone()
                            for o in offsets))
    return layers


# Adversarial-but-real variants of real BF16 KV: bit-exact operations, so each is a tensor a
# model could hold.  Scaling by powers of two moves exponents without touching mantissas.
KV_VARIANTS = ("as-is", "layer-scaled", "chan-scaled", "zeros-5%", "wide")


def scale_pow2(bits: np.ndarray, shift) -> np.ndarray:
    """BF16 bits times 2**shift (an int or an array broadcast over bits), exactly: ValueError
    where a value would leave BF16's range or lose bits (a subnormal result, an overflow)."""
    f = (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        g = np.ldexp(f, np.asarray(shift, np.int32)).astype(np.float32)
    out = g.view(np.uint32)
    if (out & 0xFFFF).any() or (np.isfinite(g) != np.isfinite(f)).any() or ((f != 0) & (g == 0)).any():
        raise ValueError("scaling by a power of two left BF16's exact range")
    return (out >> 16).astype(np.uint16)


def kv_variant(bits: np.ndarray, name: str, layer: int = 0, seed: int = 0) -> np.ndarray:
    """A variant of BF16 KV bits of shape [..., channels] (KV_VARIANTS):
    "layer-scaled" times 2**(layer % 7 - 3) (layers of different scale); "chan-scaled" times
    2**(channel % 8 - 4) (per-channel scales); "zeros-5%" 5 % of the values +0; "wide" times
    2**(channel % 32 - 16) (a wide exponent range); "as-is" the bits themselves."""
    channels = np.arange(bits.shape[-1])
    if name == "as-is":
        return bits
    if name == "layer-scaled":
        return scale_pow2(bits, layer % 7 - 3)
    if name == "chan-scaled":
        return scale_pow2(bits, np.broadcast_to(channels % 8 - 4, bits.shape))
    if name == "wide":
        return scale_pow2(bits, np.broadcast_to(channels % 32 - 16, bits.shape))
    if name == "zeros-5%":
        out = np.array(bits, np.uint16)
        out.reshape(-1)[np.random.default_rng(seed).random(out.size) < 0.05] = 0
        return out
    raise ValueError(f"unknown KV variant {name!r}; known: {KV_VARIANTS}")


def bits_of(x) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """(C-order raw bits as a 1-D unsigned NumPy array, dtype name, shape) of a NumPy array or a
    CPU torch tensor of any kvzip format."""
    if type(x).__module__.startswith("torch"):
        import torch

        name = str(x.dtype).removeprefix("torch.")
        fmt = get_format(name)
        signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[fmt.itemsize]
        a = x.detach().cpu().contiguous().view(signed).numpy().view(fmt.uint_dtype)
        return a.reshape(-1), name, tuple(x.shape)
    a = np.asarray(x)
    fmt = get_format(a.dtype.name)
    return np.ascontiguousarray(a).view(fmt.uint_dtype).reshape(-1), a.dtype.name, tuple(a.shape)


def assert_bits_equal(actual, expected, msg: str = "") -> None:
    """Same framework, dtype, shape and every bit (NaN payloads and the sign of zero included)."""
    fa, fe = type(actual).__module__.split(".")[0], type(expected).__module__.split(".")[0]
    assert fa == fe, f"{msg} framework {fa} != {fe}"
    ba, na, sa = bits_of(actual)
    be, ne, se = bits_of(expected)
    assert na == ne, f"{msg} dtype {na} != {ne}"
    assert sa == se, f"{msg} shape {sa} != {se}"
    if not np.array_equal(ba, be):
        bad = np.flatnonzero(ba != be)
        raise AssertionError(f"{msg} {bad.size} values differ; first at flat index {bad[0]}: "
                             f"0x{int(ba[bad[0]]):x} != 0x{int(be[bad[0]]):x}")


def assert_roundtrip(x, pipeline=None, **compress_kwargs: Any):
    """Compress ``x`` (with ``pipeline`` or ``kvzip.compress(**compress_kwargs)``), decompress the
    blob and assert the result is bit-identical to ``x`` in framework, dtype and shape.
    Returns the blob."""
    from . import api

    blob = pipeline.encode(x, **compress_kwargs) if pipeline is not None else api.compress(x, **compress_kwargs)
    assert_bits_equal(api.decompress(blob), x, "round trip:")
    return blob


# ------------------------------------------------------------------------------------ hostile blobs
# Blob surgery for tests of untrusted input: take a real blob apart, change it, and put it back
# together with a valid header CRC (and payload checksum), so that only the decoder's own checks
# stand between the forgery and the kernels.

def blob_parts(blob) -> tuple[dict, int, list]:
    """(meta, flags, [(stream name, dtype name, payload bytes)]) of a valid blob."""
    from . import container

    blob = bytes(blob)
    hdr = container.parse_header(blob, len(blob))
    streams = [(name, dt, blob[hdr.header_len + off: hdr.header_len + off + nb]) for name, dt, off, nb in hdr.streams]
    return hdr.meta, hdr.flags, streams


def build_blob(meta: dict, streams: list, flags: int = 0, checksum: int | None = None) -> bytes:
    """A blob of meta and streams [(name, dtype name, bytes)] laid out as a writer lays it out,
    with a valid header CRC and, when flags has the checksum bit, the payload's sum64 (or
    ``checksum`` as given)."""
    from . import container
    from .checksum import sum64

    offsets, plen = container.layout([len(b) for _, _, b in streams])
    payload = bytearray(plen)
    for off, (_, _, b) in zip(offsets, streams):
        payload[off:off + len(b)] = b
    if checksum is None:
        checksum = sum64(np, np.frombuffer(bytes(payload), np.uint8)) if flags & container.FLAG_CHECKSUM else 0
    head = container.build_header(meta, [(n, d, len(b)) for n, d, b in streams], flags, checksum)
    return head + bytes(payload)


def version1(blob) -> bytes:
    """The blob with a version-1 header (JSON metadata, stream table) in place of its compact
    one: the same metadata, streams and payload, as a writer of version 1 wrote them.  Readers
    take both versions; tests of the version-1 reader and of old blobs use this."""
    from . import container

    b = bytes(np.asarray(blob))
    hdr = container.parse_header(b, len(b))
    streams = [(name, dt, nb) for name, dt, _, nb in hdr.streams]
    return container.build_header(hdr.meta, streams, hdr.flags, hdr.checksum) + b[hdr.header_len:]


def reseal(blob) -> bytes:
    """The blob with its header CRC recomputed (after header bytes were edited in place)."""
    import struct
    import zlib

    raw = bytearray(blob)
    if len(raw) < 48:
        return bytes(raw)
    H = min(struct.unpack_from("<I", raw, 12)[0], len(raw))
    struct.pack_into("<I", raw, 40, 0)
    struct.pack_into("<I", raw, 40, zlib.crc32(bytes(raw[:H])))
    return bytes(raw)


def with_metadata_text(blob, text: bytes) -> bytes:
    """The blob with its metadata JSON replaced by ``text`` verbatim (even text build_header
    would refuse to write: deep, duplicate keys, not JSON), the header resized and resealed.
    A compact (version-2 or -3) blob is first given its version-1 header (version1)."""
    import struct

    from . import container
    from .layout import VERSION, version_of

    blob = bytes(blob)
    if version_of(blob) != VERSION:
        blob = version1(blob)
    (_, _, _, H, P, checksum, J, S, _) = container.PREFIX.unpack_from(blob)
    table = blob[48:48 + 16 * S]
    new_h = -(-(48 + len(table) + len(text)) // 16) * 16
    prefix = bytearray(blob[:48])
    struct.pack_into("<I", prefix, 12, new_h)
    struct.pack_into("<I", prefix, 32, len(text))
    head = bytes(prefix) + table + text
    return reseal(head + bytes(new_h - len(head)) + blob[H:])


def nested_json(depth: int, leaf=0) -> str:
    """JSON text of ``depth`` nested one-element lists around ``leaf`` (built without recursion)."""
    import json

    return "[" * depth + json.dumps(leaf) + "]" * depth


def hostile_blobs(base_blobs):
    """Forgeries of the given real blobs: what an attacker or a damaged link can hand a decoder.

    Each example is one real blob with one to three of: bit flips (anywhere, or in the header
    with the CRC resealed), truncation or extension, a forged prefix field (resealed), a metadata
    value replaced by another JSON value (a wrong type, a huge or negative integer, a float
    for an integer, a boolean, deep nesting), a metadata key dropped or duplicated in the text,
    a stream resized or its bytes overwritten, and deep JSON anywhere in the metadata; each
    structural change rebuilt with valid CRCs and payload checksum, so that the decoder's own
    validation is what stands in the way."""
    st = _hyp()
    import json

    base_blobs = [bytes(b) for b in base_blobs]
    if not base_blobs:
        raise ValueError("hostile_blobs needs at least one real blob")
    values = st.one_of(
        st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, 1, 2**62, 2**63, -1]),
        st.floats(allow_nan=True), st.text(max_size=20), st.sampled_from(["bf16", "e4m3fn", "float8_e4m3", "x"]),
        st.lists(st.integers(-3, 2**64), max_size=20),
        st.integers(1, 1200).map(lambda d: {"__deep__": d}),
    )

    def bit_flips(blob, draw):
        raw = bytearray(blob)
        if not raw:
            return blob
        header_only = draw(st.booleans())
        limit = min(len(raw), int.from_bytes(raw[12:16], "little") or len(raw)) if header_only and len(raw) >= 48 else len(raw)
        for _ in range(draw(st.integers(1, 8))):
            k = draw(st.integers(0, max(0, limit - 1)))
            raw[k] ^= 1 << draw(st.integers(0, 7))
        return reseal(raw) if header_only else bytes(raw)

    def resize(blob, draw):
        if draw(st.booleans()):
            return blob[:draw(st.integers(0, len(blob)))]
        return blob + bytes(draw(st.integers(1, 64)))

    def prefix_field(blob, draw):
        import struct

        raw = bytearray(blob)
        if len(raw) < 48:
            return blob
        at, fmt = draw(st.sampled_from([(8, "<H"), (10, "<H"), (12, "<I"), (16, "<Q"), (24, "<Q"), (32, "<I"),
                                        (36, "<I"), (44, "<I")]))
        bits = struct.calcsize(fmt) * 8
        struct.pack_into(fmt, raw, at, draw(st.one_of(st.integers(0, 2**bits - 1), st.sampled_from([0, 1, 16, 48]))))
        return reseal(raw)

    def meta_value(blob, draw):
        meta, flags, streams = _parts_or_none(blob)
        if meta is None:
            return blob
        path = _paths(meta)
        where = draw(st.sampled_from(path))
        value = draw(values)
        text = _replace_at(meta, where, value)
        doc = json.dumps({"meta": "@META@", "streams": [[n, d] for n, d, _ in streams]}, sort_keys=True,
                         separators=(",", ":"))
        rebuilt = build_blob(meta, streams, flags)
        return with_metadata_text(rebuilt, doc.replace('"@META@"', text).encode())

    def duplicate_key(blob, draw):
        meta, flags, streams = _parts_or_none(blob)
        if meta is None or not meta:
            return blob
        key = draw(st.sampled_from(sorted(meta)))
        doc = json.dumps({"meta": meta, "streams": [[n, d] for n, d, _ in streams]}, sort_keys=True)
        extra = json.dumps(key) + ": " + json.dumps(draw(values.filter(lambda v: not isinstance(v, dict))))
        text = doc.replace('"meta": {', '"meta": {' + extra + ", ", 1)
        return with_metadata_text(build_blob(meta, streams, flags), text.encode())

    def stream_edit(blob, draw):
        meta, flags, streams = _parts_or_none(blob)
        if meta is None or not streams:
            return blob
        k = draw(st.integers(0, len(streams) - 1))
        name, dt, data = streams[k]
        data = bytearray(data)
        if draw(st.booleans()) and data:
            for _ in range(draw(st.integers(1, 8))):
                data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        else:
            width = {"uint8": 1, "uint16": 2, "uint32": 4, "float32": 4}[dt]
            delta = draw(st.integers(-4, 4)) * width
            data = data[:max(0, len(data) + delta)] if delta < 0 else data + bytes(delta)
        streams = list(streams)
        streams[k] = (name, dt, bytes(data))
        return build_blob(meta, streams, flags)

    mutations = [bit_flips, resize, prefix_field, meta_value, meta_value, duplicate_key, stream_edit, stream_edit]

    @st.composite
    def draw_hostile(draw):
        blob = draw(st.sampled_from(base_blobs))
        for _ in range(draw(st.integers(1, 3))):
            blob = draw(st.sampled_from(mutations))(blob, draw)
        return blob

    return draw_hostile()


def _parts_or_none(blob):
    from .errors import FormatError

    try:
        return blob_parts(blob)
    except FormatError:
        return None, None, None


def _paths(meta) -> list:
    """Every place in meta (a JSON tree) as a tuple of keys and indices, and a new key at its top."""
    out, todo = [("@new",)], [((), meta)]
    while todo:
        at, node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            out.append(at + (k,))
            todo.append((at + (k,), v))
    return out


def _replace_at(meta, where: tuple, value) -> str:
    """meta's JSON text with the value at ``where`` replaced by ``value``; {"__deep__": d} stands for
    d nested lists (written as text: json.dumps would recurse)."""
    import copy
    import json

    marker = "@@VALUE@@"
    tree = copy.deepcopy(meta)
    node = tree
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = marker
    text = json.dumps(tree, sort_keys=True, separators=(",", ":"))
    if isinstance(value, dict) and "__deep__" in value:
        inner = nested_json(value["__deep__"])
    else:
        inner = json.dumps(value)
    return text.replace(json.dumps(marker), inner, 1)


def weight_matrix(m: int, k: int, kind: str = "trained", seed: int = 0):
    """A BF16 m x k torch matrix for the weights formats (kvzip.weights): "bits", every bit
    pattern (escapes everywhere, NaNs, subnormals); "trained", row-scaled Gaussians with one
    escape; "clean", at most 15 nonzero exponents and zeros (no escape); "bands", clean but for
    escapes in the 16-row bands 1 and 3 only, spread over the columns."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if kind == "bits":
        return torch.randint(0, 65536, (m, k), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    if kind in ("clean", "bands"):
        exps = 112 + torch.randint(0, 15, (m, k), generator=g, dtype=torch.int32)
        bits = torch.randint(0, 2, (m, k), generator=g, dtype=torch.int32) << 15 | exps << 7 \
            | torch.randint(0, 128, (m, k), generator=g, dtype=torch.int32)
        bits[torch.rand(m, k, generator=g) < 0.1] = 0
        if kind == "bands":
            for band in (1, 3):
                rows = torch.arange(16 * band, min(16 * band + 16, m))
                cols = torch.randint(0, k, (3 * (k // 64 + 1),), generator=g)
                bits[rows[torch.randint(0, len(rows), cols.shape, generator=g)], cols] = 200 << 7 | 5  # an escape
        return bits.to(torch.int16).view(torch.bfloat16)
    if kind != "trained":
        raise ValueError(f"unknown weight matrix kind {kind!r}")
    w = torch.randn(m, k, generator=g) * 0.02 * torch.exp(torch.randn(m, 1, generator=g))
    w[m // 2, k // 3] = 1e30  # an escape in a trained-like matrix
    return w.to(torch.bfloat16)
