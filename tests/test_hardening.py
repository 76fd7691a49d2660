"""Untrusted input never hurts (issue 26): what kvzip accepts round-trips bit for bit, what it
refuses gets a TypeError / ValueError naming the problem, a decoded tensor never aliases the
blob, bad blobs raise FormatError from any stack depth, memory stays bounded however many bad
blobs arrive, and no cache changes what is accepted.  Each test pins a point of docs/format.md
or docs/guide.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import kvzip
from kvzip import FormatError, container
from kvzip import stages as S
from kvzip import testing as kt

torch = pytest.importorskip("torch")

FLOATS = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32,
          "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def _kv(n=3000, dtype=np.float16, seed=0):
    return (np.random.default_rng(seed).standard_normal(n) * 0.05).astype(dtype)


# --------------------------------------------------------------------------- accepted inputs
@pytest.mark.parametrize("dtype", [">f2", ">f4", "<f2", "=f4"])
@pytest.mark.parametrize("n", [3, 5000])
def test_any_byte_order_round_trips_by_value(dtype, n):
    x = np.array([1.0, -2.5, 65504.0] * (n // 3), dtype=dtype)
    y = kvzip.decompress(kvzip.compress(x))
    assert y.dtype.isnative and y.dtype.name == x.dtype.name
    assert np.array_equal(y.view(np.uint8).reshape(-1), x.astype(x.dtype.newbyteorder("=")).view(np.uint8).reshape(-1))


def test_big_endian_raw_bits_keep_their_bits():
    bits = np.array([0x3F80, 0xC020, 0x7FC1, 0x0001, 0x8000], dtype=">u2")
    y = kvzip.decompress(kvzip.compress(bits, dtype="bf16"))
    assert y.dtype == ml_dtypes.bfloat16
    assert y.view(np.uint16).tolist() == bits.tolist()
    wide = np.array([0x3F800000, 0xFFC00001], dtype=">u4")
    assert kvzip.decompress(kvzip.compress(wide, dtype="float32")).view(np.uint32).tolist() == wide.tolist()


def test_big_endian_strided_view():
    x = np.arange(64, dtype=">f4").reshape(8, 8)[:, ::3]
    y = kvzip.decompress(kvzip.compress(x))
    assert y.shape == x.shape and np.array_equal(y, x)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
def test_torch_negative_bit_is_resolved(name):
    dt = getattr(torch, name)
    base = torch.tensor([1.0, -2.0, 0.0, -0.0, 0.5], dtype=torch.float32).to(dt)
    neg = torch._neg_view(base)
    assert neg.is_neg()
    y = kvzip.decompress(kvzip.compress(neg))
    expect = kt.bits_of(base)[0] ^ np.array(1 << (8 * base.element_size() - 1)).astype(kt.bits_of(base)[0].dtype)
    assert y.dtype == dt and np.array_equal(kt.bits_of(y)[0], expect)


def test_issue_reproducer_conjugate_imag():
    im = torch.tensor([1 + 2j, 3 - 4j]).conj().imag
    assert im.is_neg()
    assert kvzip.decompress(kvzip.compress(im)).tolist() == [-2.0, 4.0]


# --------------------------------------------------------------------------- refused inputs
def test_conjugate_complex_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="complex64"):
        kvzip.compress(torch.tensor([1 + 2j]).conj())


def test_nested_tensor_is_a_type_error():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match="nested"):
        kvzip.compress(nt)


@pytest.mark.parametrize("mask", [[0, 0, 0], [0, 1, 0]])
def test_masked_array_is_a_type_error(mask):
    m = np.ma.array([1.0, 2.0, 3.0], mask=mask, dtype=np.float16)
    with pytest.raises(TypeError, match="masked"):
        kvzip.compress(m)


def test_float8_e4m3_is_not_e4m3fn():
    """ml_dtypes' float8_e4m3 (IEEE-like, with Inf) is not float8_e4m3fn: refused, by name or array."""
    with pytest.raises(TypeError, match="float8_e4m3"):
        kvzip.compress(np.zeros(4, np.uint8), dtype="float8_e4m3")
    with pytest.raises(TypeError, match="float8_e4m3"):
        kvzip.compress(np.zeros(4, ml_dtypes.float8_e4m3))
    assert kvzip.decompress(kvzip.compress(np.zeros(4, np.uint8), dtype="float8_e4m3fn")).dtype == ml_dtypes.float8_e4m3fn


def test_cuda_backend_without_cupy_names_cupy():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="CuPy"):
        kvzip.compress(np.zeros(4, np.float16), backend="cuda")


# --------------------------------------------------------------------------- no aliasing
def _assert_private(y, blob_array):
    before = np.array(y, copy=True)
    assert not np.shares_memory(np.asarray(y), blob_array)
    blob_array ^= 0x55  # the caller reuses its buffer
    assert np.array_equal(np.asarray(y).view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("kind", ["stored", "split", "splitzip", "e4m3 stored"])
def test_decoded_array_never_aliases_the_blob(kind):
    x = {"stored": np.arange(8, dtype=np.float16), "e4m3 stored": _kv(256, ml_dtypes.float8_e4m3fn)}.get(kind, _kv())
    pipe = {"split": kvzip.Pipeline([S.ExponentSplit(), S.Serialize()])}.get(kind)
    blob = (pipe.encode(x) if pipe is not None else kvzip.compress(x)).copy()
    if kind.endswith("stored"):
        assert kvzip.info(blob)["stored_raw"]
    y = kvzip.decompress(blob)
    _assert_private(y, blob)


def test_decoded_batch_never_aliases_the_blobs():
    xs = [np.arange(8, dtype=np.float16), _kv(), _kv(100, ml_dtypes.float8_e4m3fn)]
    blobs = [b.copy() for b in kvzip.compress_many(xs)]
    ys = kvzip.decompress_many(blobs)
    for y, b in zip(ys, blobs):
        _assert_private(y, b)


def test_decoded_tensor_never_aliases_a_writable_buffer():
    """bytearray and torch blobs: the buffer the caller keeps stays its own."""
    raw = bytearray(kvzip.compress(np.arange(8, dtype=np.float16)).tobytes())
    y = kvzip.decompress(raw)
    raw[-16] ^= 0x55
    assert y.tolist() == list(range(8))
    t = kvzip.compress(torch.arange(8, dtype=torch.bfloat16))
    y = kvzip.decompress(t)
    t.zero_()
    assert y.tolist() == list(range(8))


# --------------------------------------------------------------------------- FormatError from any depth
def _at_depth(frames: int, fn):
    if frames <= 0:
        return fn()
    return _at_depth(frames - 1, fn)


def _forge(x, edit) -> bytes:
    """A real blob of x whose metadata JSON text edit(meta) returns, resealed."""
    blob = kvzip.compress(x).tobytes()
    meta, flags, streams = kt.blob_parts(blob)
    doc = json.dumps({"meta": "@M@", "streams": [[n, d] for n, d, _ in streams]}, sort_keys=True)
    return kt.with_metadata_text(blob, doc.replace('"@M@"', edit(meta)).encode())


def _meta_text(meta, path, inner: str) -> str:
    meta = json.loads(json.dumps(meta))
    node = meta
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = "@V@"
    return json.dumps(meta, sort_keys=True).replace('"@V@"', inner)


DEEP_CASES = {
    "codebook provenance 600 deep": (("codebook", "provenance"), lambda: "{\"a\": " * 600 + "1" + "}" * 600),
    "pipeline 500 deep": (("pipeline",), lambda: kt.nested_json(500, [])),
    "format 950 deep": (("format",), lambda: kt.nested_json(950)),
    "coverage 950 deep": (("codebook", "coverage"), lambda: kt.nested_json(950)),
    "stage id 950 deep": (("pipeline", 0, "id"), lambda: kt.nested_json(950)),
    "dtype 5000 deep": (("dtype",), lambda: kt.nested_json(5000)),
    "top16 config provenance 600 deep": (("pipeline", 1, "codebook"),
                                         lambda: '{"format": "bf16", "exponents": ' + json.dumps(list(range(112, 128)))
                                         + ', "provenance": ' + "{\"a\": " * 600 + "1" + "}" * 600 + "}"),
}


@pytest.mark.parametrize("case", sorted(DEEP_CASES))
@pytest.mark.parametrize("entry", ["decompress", "decompress_many", "info"])
def test_deep_json_raises_format_error_from_100_frames_deep(case, entry):
    path, inner = DEEP_CASES[case]
    blob = _forge(_kv(3000, ml_dtypes.bfloat16), lambda m: _meta_text(m, path, inner()))
    call = {"decompress": kvzip.decompress, "info": kvzip.info,
            "decompress_many": lambda b: kvzip.decompress_many([b])}[entry]
    with pytest.raises(FormatError, match="nests"):
        _at_depth(100, lambda: call(blob))


@pytest.mark.parametrize("shape", [[2**63, 0], [2**62, 2, 0], [0, 2**64], [2**61, 4, 0]])
def test_empty_shape_too_large_for_numpy_is_a_format_error(shape):
    blob = _forge(np.zeros(0, np.float32), lambda m: json.dumps({**m, "shape": shape}))
    with pytest.raises(FormatError, match="spans"):
        _at_depth(100, lambda: kvzip.decompress(blob))


def test_largest_empty_shape_numpy_takes_decodes():
    blob = _forge(np.zeros(0, ml_dtypes.float8_e5m2), lambda m: json.dumps({**m, "shape": [2**63 - 1, 0]}))
    assert kvzip.decompress(blob).shape == (2**63 - 1, 0)
    as_torch = torch.from_numpy(np.frombuffer(blob, np.uint8).copy())
    assert tuple(kvzip.decompress(as_torch).shape) == (2**63 - 1, 0)


def test_json_depth_limit_is_exact_and_ignored_keys_within_it_decode():
    """docs/format.md 2.x: depth up to MAX_JSON_DEPTH parses (a reader ignores unknown meta keys);
    one more is refused before parsing."""
    x = _kv(3000, ml_dtypes.bfloat16)
    limit = container.MAX_JSON_DEPTH
    ok = _forge(x, lambda m: _meta_text(m, ("extra",), kt.nested_json(limit - 2)))
    kt.assert_bits_equal(kvzip.decompress(ok), x)
    bad = _forge(x, lambda m: _meta_text(m, ("extra",), kt.nested_json(limit - 1)))
    with pytest.raises(FormatError, match=f"nests {limit + 1} deep"):
        kvzip.decompress(bad)


@pytest.mark.parametrize("text,depth", [(b"{}", 1), (b'[[], {"a": [1]}]', 3), (b'"[[[["', 0), (b'["\\"[[", [[]]]', 3),
                                        (b"", 0), (b"1", 0)])
def test_json_depth_counts_structure_outside_strings(text, depth):
    assert container.json_depth(text) == depth


# --------------------------------------------------------------------------- JSON and pipeline rules
@pytest.mark.parametrize("where", ["top", "meta", "codebook"])
def test_duplicate_json_keys_are_rejected(where):
    x = _kv(3000, ml_dtypes.bfloat16)
    blob = kvzip.compress(x).tobytes()
    meta, flags, streams = kt.blob_parts(blob)
    doc = json.dumps({"meta": meta, "streams": [[n, d] for n, d, _ in streams]}, sort_keys=True)
    text = {"top": doc[:-1] + ', "meta": {}}',
            "meta": doc.replace('"meta": {', '"meta": {"n": 3000, ', 1),
            "codebook": doc.replace('"codebook": {', '"codebook": {"name": "a", ', 1)}[where]
    with pytest.raises(FormatError, match="duplicate key"):
        kvzip.decompress(kt.with_metadata_text(blob, text.encode()))


def test_pipeline_must_be_a_list():
    blob = _forge(_kv(), lambda m: json.dumps({**m, "pipeline": {"stages": m["pipeline"]}}))
    for call in (kvzip.decompress, kvzip.info):
        with pytest.raises(FormatError, match="list of stage configs"):
            call(blob)


@pytest.mark.parametrize("alias", ["float8_e5m2", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_quantize_fp8_decodes_format_aliases(alias, granularity):
    Q = kt.quantize_fp8_available()
    if Q is None:
        pytest.skip("no QuantizeFP8")
    x = _kv(4096, ml_dtypes.bfloat16).reshape(64, 64)
    pipe = kvzip.Pipeline([Q("e5m2", granularity), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()])
    blob = pipe.encode(x)
    want = kvzip.decompress(blob)
    meta, flags, streams = kt.blob_parts(blob)
    forged = kt.build_blob({**meta, "format": alias}, streams, flags)
    kt.assert_bits_equal(kvzip.decompress(forged), want)


def test_quantize_fp8_decodes_e4m3fn_alias():
    Q = kt.quantize_fp8_available()
    if Q is None:
        pytest.skip("no QuantizeFP8")
    x = _kv(512, np.float16)
    blob = kvzip.Pipeline([Q("e4m3"), S.Serialize()]).encode(x)
    meta, flags, streams = kt.blob_parts(blob)
    for alias in ("e4m3fn", "float8_e4m3fn"):
        kt.assert_bits_equal(kvzip.decompress(kt.build_blob({**meta, "format": alias}, streams, flags)),
                             kvzip.decompress(blob))
    with pytest.raises(FormatError):
        kvzip.decompress(kt.build_blob({**meta, "format": "float8_e4m3"}, streams, flags))


# --------------------------------------------------------------------------- no history
@pytest.mark.parametrize("spell", [float, str])
def test_codebook_types_are_checked_after_a_valid_call(spell):
    """docs/format.md 7.3: exponents are JSON integers; 14.0 == 14 must not pass a cache."""
    x = _kv(3000, ml_dtypes.bfloat16)
    blob = kvzip.compress(x).tobytes()
    kvzip.decompress(blob)  # the valid codebook is now cached
    meta, flags, streams = kt.blob_parts(blob)
    exps = list(meta["codebook"]["exponents"])
    exps[3] = spell(exps[3])
    forged = kt.build_blob({**meta, "codebook": {**meta["codebook"], "exponents": exps}}, streams, flags)
    with pytest.raises(FormatError, match="codebook"):
        kvzip.decompress(forged)


def test_false_for_exponent_zero_is_rejected_after_a_valid_call():
    cb = kvzip.Codebook(list(range(16)), "fp16")
    x = np.zeros(4096, np.float16)
    blob = kvzip.compress(x, codebook=cb).tobytes()
    kvzip.decompress(blob)
    meta, flags, streams = kt.blob_parts(blob)
    assert meta["codebook"]["exponents"][0] == 0
    forged = kt.build_blob({**meta, "codebook": {**meta["codebook"], "exponents": [False] + list(range(1, 16))}},
                           streams, flags)
    with pytest.raises(FormatError, match="codebook"):
        kvzip.decompress(forged)


def test_compress_arguments_are_checked_after_a_valid_call():
    x = _kv()
    kvzip.compress(x)  # the default pipeline is now cached
    with pytest.raises(TypeError, match="checksum"):
        kvzip.compress(x, checksum=0)
    with pytest.raises(ValueError, match="chunk"):
        kvzip.compress(x, chunk=4096.0)
    with pytest.raises(ValueError, match="chunk"):
        kvzip.compress(x, chunk=True)


def test_pipeline_config_types_are_checked_after_a_valid_call():
    blob = kvzip.compress(_kv()).tobytes()
    kvzip.decompress(blob)
    meta, flags, streams = kt.blob_parts(blob)
    for stage, key, value in (("escape_stream", "chunk", 4096.0), ("serialize", "checksum", 0)):
        pipeline = [dict(s, **{key: value}) if s["id"] == stage else s for s in meta["pipeline"]]
        with pytest.raises(FormatError):
            kvzip.decompress(kt.build_blob({**meta, "pipeline": pipeline}, streams, flags))


# --------------------------------------------------------------------------- info() = decompress
def test_info_rejects_what_only_decoding_finds():
    """An escape position out of order is found by the decode kernels, not the header checks:
    info() must reject it too."""
    x = _kv(4096, np.float16)
    x[::97] = 60000.0  # escapes of the shipped codebook
    blob = kvzip.compress(x, None, chunk=4096).tobytes()
    meta, flags, streams = kt.blob_parts(blob)
    pos = next(np.frombuffer(b, np.uint16).copy() for n, _, b in streams if n == "esc_pos")
    assert pos.size >= 2
    pos[[0, 1]] = pos[[1, 0]]
    forged = kt.build_blob(meta, [(n, d, pos.tobytes() if n == "esc_pos" else b) for n, d, b in streams], flags)
    with pytest.raises(FormatError):
        kvzip.decompress(forged)
    with pytest.raises(FormatError):
        kvzip.info(forged)


# --------------------------------------------------------------------------- bounded memory
RSS_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import kvzip
    from kvzip import testing as kt

    def rss_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    x = (np.random.default_rng(0).standard_normal(4096) * 0.05).astype(np.float16)
    base = kvzip.compress(x).tobytes()
    meta, flags, streams = kt.blob_parts(base)
    pad = "x" * int(sys.argv[2])
    breaks = [  # each rejected after its header has parsed (the cases a header cache could keep)
        lambda m: {**m, "n": m["n"] + 1},
        lambda m: {**m, "pipeline": m["pipeline"][:1] + m["pipeline"][2:]},
        lambda m: {**m, "codebook": {**m["codebook"], "exponents": m["codebook"]["exponents"][:15]}},
        lambda m: {**m, "shape": [m["n"], 1, -1]},
    ]
    def forged(i):
        m = breaks[i % len(breaks)](meta)
        return kt.build_blob({**m, "pad": pad + str(i)}, streams, flags)

    for i in range(50):  # warm up: code paths compiled, caches of the valid blob filled
        kvzip.decompress(base)
        try:
            kvzip.decompress(forged(i))
        except kvzip.FormatError:
            pass
    start = rss_mib()
    for i in range(int(sys.argv[1])):
        blob = forged(i)
        try:
            (kvzip.decompress, kvzip.info, lambda b: kvzip.decompress_many([b]))[i % 3](blob)
        except kvzip.FormatError:
            continue
        sys.exit(f"blob {i} was accepted")
    print("GROWTH_MIB", rss_mib() - start)
""")


def test_rejected_blobs_with_large_headers_use_bounded_memory():
    """10,000 distinct rejected blobs with 64 KiB headers (the old header cache kept 1,025 of
    them: ~150 MiB): peak RSS grows by less than 64 MiB."""
    p = subprocess.run([sys.executable, "-c", RSS_SCRIPT, "10000", str(64 << 10)], capture_output=True, text=True,
                       timeout=900, env={k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    growth = float(p.stdout.split("GROWTH_MIB")[1])
    assert growth < 64, f"peak RSS grew by {growth:.1f} MiB"


def test_header_cache_holds_only_decoded_headers_and_is_capped_in_bytes():
    container._parsed.clear()
    container._parsed_bytes = 0
    x = _kv()
    blob = kvzip.compress(x).tobytes()
    meta, flags, streams = kt.blob_parts(blob)
    bad = kt.build_blob({**meta, "n": meta["n"] + 1}, streams, flags)
    with pytest.raises(FormatError):
        kvzip.decompress(bad)
    assert not any(key[0] == bad[:len(key[0])] for key in container._parsed)
    kvzip.decompress(blob)
    assert any(blob.startswith(key[0]) for key in container._parsed)
    for i in range(container.CACHE_BYTES // 8000 + 10):  # valid blobs with ~8 KB headers
        kvzip.decompress(kt.build_blob({**meta, "pad": "y" * 8000 + str(i)}, streams, flags))
    assert container._parsed_bytes <= container.CACHE_BYTES
    assert sum(len(k[0]) for k in container._parsed) == container._parsed_bytes
    kvzip.decompress(kt.build_blob({**meta, "pad": "z" * (container.CACHE_HEADER_MAX + 1)}, streams, flags))
    assert all(len(k[0]) <= container.CACHE_HEADER_MAX for k in container._parsed)


# --------------------------------------------------------------------------- command line
@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}", b"\xff" * 64])
def test_calibrate_on_a_malformed_safetensors_file_is_one_error_line(tmp_path, capsys, content):
    pytest.importorskip("safetensors")
    from kvzip.cli import main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    assert main(["calibrate", str(bad), "-o", str(tmp_path / "cb.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvzip calibrate: error:") and "bad.safetensors" in err and "Traceback" not in err
    from kvzip.calibrate import calibrate

    with pytest.raises(ValueError, match="not a readable .safetensors file"):
        calibrate([bad], format="bf16")


def test_demo_on_cuda_without_cupy_is_one_error_line(capsys):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed")
    except ImportError:
        pass
    from kvzip.cli import main

    assert main(["demo", "--backend", "cuda", "--repeat", "1"]) == 1
    assert "needs CuPy" in capsys.readouterr().err


def test_codebook_with_too_deep_provenance_is_a_value_error():
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ValueError, match="provenance"):
        kvzip.Codebook(list(range(16)), "bf16", provenance=deep)
