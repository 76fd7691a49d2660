"""Regenerate kvzip's golden fixtures: small inputs and the blobs kvzip makes of them.

    python tests/golden/make_golden.py

tests/test_golden.py asserts that decoding each committed blob gives the committed values and
that encoding each committed input today gives the committed blob byte for byte.  Regenerate
only for an intended change of the bitstream (and bump container.VERSION when old blobs no longer
decode): a diff in these files is a format change.

Files per case ``NAME``: ``NAME.input.npy`` (raw bits of the input, the format's unsigned dtype,
in its shape), ``NAME.kvz`` (the blob) and, for a lossy pipeline, ``NAME.output.npy`` (raw bits
the blob decodes to).  ``manifest.json`` lists each case's format, shape and pipeline config
(codebooks spelled out, so a recalibrated shipped codebook does not change them, except in
``bf16_default_codebook``, whose config says ``codebook: null``: it pins the shipped default).
Where today's blob has a compact (version-2 or, for the ratio mode, version-3) header, ``NAME.v1.kvz`` holds the same blob with
its version-1 header (kvzip.testing.version1), the bytes kvzip wrote before version 2: they were
committed then, and a regeneration that changes them is a format change too.

Deterministic: inputs come from the KV sample shipped in kvzip.data and fixed seeds, so a rerun
on an unchanged kvzip rewrites identical files.
"""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

import kvzip
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.data import load_sample
from kvzip.formats import FORMATS

HERE = Path(__file__).resolve().parent


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    fmt = kvzip.get_format(x.dtype.name)
    return np.ascontiguousarray(x).view(fmt.uint_dtype)


def splitzip(codebook, chunk, checksum=False, front=()):
    return kvzip.Pipeline(list(front) + [S.ExponentSplit(), S.Top16Pack(codebook), S.EscapeStream(chunk),
                                         S.Serialize(checksum)])


def cases():
    prose, code, html = load_sample("prose"), load_sample("code"), load_sample("html")
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    cb = kvzip.Codebook.load

    # bf16: real KV (a slice with escapes), the shipped codebook spelled out.
    yield "bf16_kv", bits(prose["prose/layer03.v"][:, :16, :]), splitzip(cb("bf16-kv"), 1024)
    # bf16 with the payload checksum.
    yield "bf16_checksum", bits(code["code/layer07.k"][:, :8, :]), splitzip(cb("bf16-kv"), 4096, checksum=True)
    # bf16 with plane-coded chunks: real KV with one chunk of random bits.
    x = bits(html["html/layer11.v"][:, :16, :]).copy()
    x.reshape(-1)[512:768] = np.random.default_rng(1).integers(0, 1 << 16, 256, dtype=np.uint64).astype(np.uint16)
    yield "bf16_plane", x, splitzip(cb("bf16-kv"), 256)
    # bf16 with codebook None: the shipped default resolved at encode time.
    yield "bf16_default_codebook", bits(prose["prose/layer20.k"][:, :8, :]), splitzip(None, 4096)
    # fp16 / fp32: the same KV values as an engine keeping them in that dtype.
    yield "fp16_kv", bits(f32(code["code/layer02.v"][:, :8, :]).astype(np.float16)).reshape(6, 256), \
        splitzip(cb("fp16-kv"), 256)
    yield "fp32_kv", bits(f32(html["html/layer05.k"]).reshape(-1)[:777]).reshape(3, 7, 37), splitzip(cb("fp32-kv"), 64)
    # e5m2: per-tensor FP8 quantization of KV (scale = amax / 57344), some escapes.
    v = f32(prose["prose/layer08.k"][:, :12, :])
    e5 = (v / (np.abs(v).max() / 57344.0)).astype(ml_dtypes.float8_e5m2)
    yield "e5m2_kv", bits(e5), splitzip(cb("e5m2-kv"), 512)
    # e4m3: never smaller than raw (4-bit code + 4-bit rest), so stored raw.
    v = f32(code["code/layer09.k"][:, :8, :])
    e4 = (v / (np.abs(v).max() / 448.0)).astype(ml_dtypes.float8_e4m3fn)
    yield "e4m3_stored", bits(e4), splitzip(cb("e4m3-kv"), 4096)
    # Edge shapes.
    yield "fp16_empty", np.zeros((0, 5), np.uint16), splitzip(cb("fp16-kv"), 4096)
    yield "bf16_scalar", np.array(0x3FC0, np.uint16), splitzip(cb("bf16-kv"), 4096)
    # The ratio mode (ChannelPack): real KV with escapes, second-level codes and one plane-coded
    # chunk of random bits; FP8 as QuantizeFP8 gives it (one scale a tensor).
    x = bits(prose["prose/layer03.k"][:, :32, :]).copy()
    x.reshape(-1)[2048:3072] = np.random.default_rng(2).integers(0, 1 << 16, 1024, dtype=np.uint64).astype(np.uint16)
    yield "bf16_ratio", x, kvzip.Pipeline([S.ChannelPack(1024), S.Serialize()])
    # The storage mode (ChannelRans) on the same values: escapes from the random chunk, six chunks.
    yield "bf16_storage", x, kvzip.Pipeline([S.ChannelRans(1024), S.Serialize()])
    v = f32(html["html/layer08.v"][:, :32, :])
    yield "e5m2_ratio", bits((v / (np.abs(v).max() / 57344.0)).astype(ml_dtypes.float8_e5m2)), \
        kvzip.Pipeline([S.ChannelPack(4096), S.Serialize(True)])
    yield "e5m2_storage", bits((v / (np.abs(v).max() / 57344.0)).astype(ml_dtypes.float8_e5m2)), \
        kvzip.Pipeline([S.ChannelRans(4096), S.Serialize(True)])
    v = f32(code["code/layer09.v"])
    yield "e4m3_ratio", bits((v / (np.abs(v).max() / 448.0)).astype(ml_dtypes.float8_e4m3fn)), \
        kvzip.Pipeline([S.ChannelPack(2048), S.Serialize()])
    # Lossy: QuantizeFP8 (per channel) in front of the lossless stages.
    Q = getattr(S, "QuantizeFP8", None)
    if Q is not None:
        yield "quantize_e5m2_channel", bits(prose["prose/layer14.k"][:, :8, :]), \
            splitzip(None, 512, front=[Q("e5m2", "channel")])



def main():
    manifest = {"about": "kvzip golden fixtures; see make_golden.py", "cases": {}}
    for old in HERE.glob("*.npy"):
        old.unlink()
    for old in HERE.glob("*.kvz"):
        old.unlink()
    for name, x, pipe in cases():
        fmt = fmt_of(name, x)
        blob = np.asarray(pipe.encode(x, dtype=fmt.name))
        out = kvzip.decompress(blob)
        out_bits = np.asarray(out).view(fmt.uint_dtype)
        entry = {"format": fmt.name, "shape": list(x.shape), "pipeline": pipe.to_config(),
                 "input": f"{name}.input.npy", "blob": f"{name}.kvz", "lossless": pipe.lossless,
                 "info": {k: v for k, v in kvzip.info(blob).items() if k in ("ratio", "escapes", "raw_chunks",
                                                                                "stored_raw", "checksum")}}
        np.save(HERE / entry["input"], x, allow_pickle=False)
        (HERE / entry["blob"]).write_bytes(blob.tobytes())
        if int.from_bytes(blob[8:10].tobytes(), "little") != 1:  # its version-1 form, as kvzip wrote it before
            entry["blob_v1"] = f"{name}.v1.kvz"
            (HERE / entry["blob_v1"]).write_bytes(kt.version1(blob))
        if pipe.lossless:
            assert np.array_equal(out_bits, x), name
        else:
            entry["output"] = f"{name}.output.npy"
            np.save(HERE / entry["output"], out_bits, allow_pickle=False)
        manifest["cases"][name] = entry
        print(f"{name:24s} {fmt.name:5s} {str(x.shape):14s} {x.nbytes:6d} B -> {blob.size:6d} B  {entry['info']}")
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def fmt_of(name: str, x: np.ndarray):
    """The format of a case: the name's prefix (inputs are raw bits, their dtype says only the width)."""
    prefix = name.split("_")[0]
    if prefix == "quantize":
        prefix = "bf16"
    fmt = FORMATS[prefix]
    assert fmt.uint_dtype == x.dtype, (name, x.dtype)
    return fmt


if __name__ == "__main__":
    main()
