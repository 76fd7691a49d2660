"""compress_into / decompress_into on the CPU, compress_bound, container.claimed_length, and the
argument checks every backend shares (tests/gpu/test_into_gpu.py is the GPU side: no host sync,
CUDA graphs, statuses)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvzip
from kvzip import container
from kvzip import testing as kt
from kvzip.data import load_sample
from kvzip.errors import FormatError


def sample_bf16():
    return next(iter(load_sample("code").values()))


def into(x, **kw):
    dst = np.full(kvzip.compress_bound(x, **{k: v for k, v in kw.items() if k in ("codebook", "dtype")}), 7, np.uint8)
    size = np.zeros(1, np.int64)
    assert kvzip.compress_into(x, dst, size, **kw) is size
    return dst, int(size[0])


def test_compress_into_writes_compress_blob_and_its_size():
    x = sample_bf16()
    dst, n = into(x)
    want = bytes(kvzip.compress(x))
    assert bytes(dst[:n]) == want and n == len(want)
    assert (dst[n:] == 7).all()  # nothing past the blob


def test_decompress_into_takes_a_longer_buffer_and_fills_out():
    x = sample_bf16()
    dst, _ = into(x)
    out = np.zeros_like(x)
    status = np.full(1, -1, np.int64)
    assert kvzip.decompress_into(dst, out, status) is out
    assert status[0] == 0
    kt.assert_bits_equal(out, x)


@pytest.mark.parametrize("variant", kt.KV_VARIANTS)
def test_round_trips_on_kv_variants(variant):
    bits = kt.kv_variant(np.asarray(sample_bf16()).view(np.uint16), variant, layer=2)
    dst, n = into(bits, dtype="bf16")
    assert bytes(dst[:n]) == bytes(kvzip.compress(bits, dtype="bf16"))
    out = np.zeros_like(bits)
    kvzip.decompress_into(dst, out, dtype="bf16")
    np.testing.assert_array_equal(out, bits)


def test_stored_raw_blobs_and_auto_codebooks_decode_into():
    bits = np.random.default_rng(0).integers(0, 1 << 16, 5000, dtype=np.uint16)
    for codebook in (None, "auto"):
        blob = kvzip.compress(bits, dtype="bf16", codebook=codebook)
        out = np.zeros_like(bits)
        kvzip.decompress_into(blob, out, dtype="bf16", codebook=codebook)
        np.testing.assert_array_equal(out, bits)


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(np.asarray(sample_bf16()).view(np.int16).copy()).view(torch.bfloat16)
    dst = torch.zeros(kvzip.compress_bound(x), dtype=torch.uint8)
    size = torch.zeros(1, dtype=torch.int64)
    kvzip.compress_into(x, dst, size)
    assert dst[:int(size)].numpy().tobytes() == bytes(kvzip.compress(x))
    out = torch.empty_like(x)
    kvzip.decompress_into(dst, out)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_bound_holds_every_blob(data):
    fmt = data.draw(kt.formats())
    bits = data.draw(kt.bit_arrays(fmt, max_size=3000))
    codebook = data.draw(st.sampled_from([None, "auto"]))
    bound = kvzip.compress_bound(((bits.size,), fmt), codebook=codebook)
    assert bound == kvzip.compress_bound(bits, dtype=fmt, codebook=codebook)
    blob = kvzip.compress(bits, dtype=fmt, codebook=codebook)
    assert blob.shape[0] <= bound
    assert container.claimed_length(bytes(blob[:4096])) == blob.shape[0]
    dst, n = into(bits, dtype=fmt, codebook=codebook)
    out = np.zeros_like(bits)
    kvzip.decompress_into(dst, out, dtype=fmt, codebook=codebook)
    np.testing.assert_array_equal(out, bits)


def test_claimed_length_of_version_1_and_forged_headers():
    x = sample_bf16()
    v2 = bytes(kvzip.compress(x))
    v1 = kt.version1(v2)
    assert container.claimed_length(v1[:4096]) == len(v1)
    assert container.claimed_length(bytes(kvzip.compress(x, checksum=True))[:4096]) > 0
    with pytest.raises(FormatError):
        container.claimed_length(b"\0" * 64)
    forged = bytearray(v2)
    forged[33] ^= 1  # the escape count, under the CRC
    with pytest.raises(FormatError):
        container.claimed_length(bytes(forged[:64]))
    with pytest.raises(FormatError):
        container.claimed_length(v2[:20])


def test_bad_arguments_raise_and_write_nothing():
    x = sample_bf16()
    need = kvzip.compress_bound(x)
    dst, size = np.full(need, 7, np.uint8), np.zeros(1, np.int64)
    cases = [
        (lambda: kvzip.compress_into(x, dst[:need - 1], size), "holds"),
        (lambda: kvzip.compress_into(x, dst, np.zeros(1, np.int32)), "int64"),
        (lambda: kvzip.compress_into(x, dst, np.zeros(0, np.int64)), "holds 0 bytes"),
        (lambda: kvzip.compress_into(x, dst.reshape(-1, need)[:, ::2], size), "1-D|contiguous"),
        (lambda: kvzip.compress_into(x, dst[::2], size), "contiguous"),
        (lambda: kvzip.compress_into(x, bytes(need), size), "array"),
        (lambda: kvzip.compress_into(x, np.frombuffer(bytes(need), np.uint8), size), "writable"),
        (lambda: kvzip.compress_into(x, dst, None), "size_out is required"),
        (lambda: kvzip.compress_bound(((-1, 3), "bfloat16")), "bad shape"),
        (lambda: kvzip.decompress_into(bytes(kvzip.compress(x)), np.zeros((3, 5), x.dtype)), "shape"),
        (lambda: kvzip.decompress_into(dst, np.zeros_like(x)), "bad magic"),
        (lambda: kvzip.decompress_into(bytes(kvzip.compress(x)), x[::2]), "contiguous"),
    ]
    for call, words in cases:
        with pytest.raises((ValueError, TypeError, FormatError), match=words):
            call()
    assert (dst == 7).all() and size[0] == 0


def test_decompress_into_refuses_a_blob_of_another_tensor():
    x = sample_bf16()
    blob = kvzip.compress(x)
    with pytest.raises(ValueError, match="shape"):
        kvzip.decompress_into(blob, np.zeros(x.size + 1, x.dtype))
    with pytest.raises(ValueError, match="float16"):
        kvzip.decompress_into(blob, np.zeros(x.shape, np.float16))
    with pytest.raises(FormatError):
        kvzip.decompress_into(blob[:100], np.zeros_like(x))


def test_status_text():
    assert kvzip.status_text(0) == "decoded"
    assert "layout" in kvzip.status_text(255)
    assert "escape" in kvzip.status_text(1)


@pytest.mark.parametrize("codebook", [None, "auto"])
def test_the_planned_layout_is_the_blobs_own(codebook):
    """decompress_into's kernels check each blob against the layout planned from the encode plan
    (layout_cache.planned), with no blob seen yet: it must be the layout the decoder reads off a
    real blob's header (its blanked key, the expected header, the fixed streams' offsets); an
    auto one's guesses take each blob's codebook from its header."""
    from kvzip import api, into as into_mod
    from kvzip.gpu import layout_cache
    from kvzip.gpu.abi import DECODE

    x = sample_bf16()
    blob = bytes(kvzip.compress(x, codebook))
    hdr = container.parse_header(blob[:4096], len(blob))
    lane = into_mod._planned(api._default(codebook, False, api.DEFAULT_CHUNK), kvzip.get_format("bf16"), x.shape)[0]
    layout = layout_cache.planned(lane.plan, lane.fmt, x.shape, lane.chunk, lane.codebook)
    key, crc_ok, _, _ = layout_cache._read(blob[:hdr.header_len], len(blob))
    assert crc_ok and layout.key == key and layout.header_len == hdr.header_len
    assert layout.expect == layout_cache._expect(blob[:hdr.header_len], key)
    assert layout.own_codebook == (codebook == "auto")
    at = {name: hdr.header_len + off for name, _, off, _ in hdr.streams}
    assert layout.esc_pos_offset + hdr.header_len == at["esc_pos"]
    for name in ("codes", "rest", "esc_count"):
        assert layout.row[0, DECODE.col(name)] == at[name]
    assert layout.fixed_bytes <= len(blob) <= layout.most_bytes


def test_a_remembered_auto_layout_takes_no_forged_codebook(monkeypatch):
    """A blob of a remembered auto layout whose header codebook repeats an exponent (its CRC
    made right) matches no layout (layout_cache.match and
    match_many leave it to the general path, which raises FormatError): no job row decodes with
    it.  tests/gpu/test_auto_codebook_gpu.py goes through the decoders on the GPU."""
    import struct
    import zlib

    from kvzip import api, into as into_mod
    from kvzip.gpu import layout_cache

    x = sample_bf16()
    blob = bytes(kvzip.compress(x, codebook="auto"))
    lane = into_mod._planned(api._default("auto", False, api.DEFAULT_CHUNK), kvzip.get_format("bf16"), x.shape)[0]
    layout = layout_cache.planned(lane.plan, lane.fmt, x.shape, lane.chunk, lane.codebook)
    monkeypatch.setitem(layout_cache._layouts, layout.key, layout)

    def resealed(change):
        b = bytearray(blob)
        change(b)
        struct.pack_into("<I", b, 40, zlib.crc32(bytes(b[:40]) + bytes(4) + bytes(b[44:64])))
        return bytes(b)

    forged = [resealed(lambda b: b.__setitem__(49, b[48])), resealed(lambda b: b.__setitem__(slice(48, 56), bytes(8)))]
    assert layout_cache.match(blob[:64], len(blob)) is not None
    for bad in forged:
        assert layout_cache.match(bad[:64], len(bad)) is None
        with pytest.raises(FormatError, match="codebook"):
            kvzip.decompress(np.frombuffer(bad, np.uint8))
    block = np.stack([np.frombuffer(b[:64], np.uint8) for b in [blob, *forged]])
    groups, rest = layout_cache.match_many(block, [len(blob)] * 3)
    assert [g[1].tolist() for g in groups] == [[0]] and rest == [1, 2]
    books = np.array([range(16), [*range(15), 31], [*range(15), 32]], np.uint8)  # e5m2's exponents: 0-31
    assert layout_cache._books_valid(books, kvzip.get_format("e5m2")).tolist() == [True, True, False]
