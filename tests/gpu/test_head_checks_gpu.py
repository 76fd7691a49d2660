"""kvz_check_heads (the batched decode's header checks on the GPU) against its host twin,
layout_cache.head_checks, on valid headers and on every way a header can fail to hang
together; and decompress_many still refusing forged blobs that pass through it."""
import struct
import zlib

import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import container
from kvzip import testing as kt
from kvzip.data import load_sample
from kvzip.gpu import programs, layout_cache

rng = np.random.default_rng(77)


def real_bf16(n, seed=0):
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    return np.roll(np.resize(sample, n), seed)


def escapes_at(blob: bytes) -> int:
    ns = int.from_bytes(blob[36:40], "little")
    return container.PREFIX.size + 16 * (ns - 3)


def resealed(blob: bytes, change) -> bytes:
    """blob with change(bytearray of it) applied to the header and the header CRC made right again."""
    b = bytearray(blob)
    change(b)
    h = min(int.from_bytes(b[12:16], "little"), len(b))
    b[40:44] = bytes(4)
    struct.pack_into("<I", b, 40, zlib.crc32(bytes(b[:h])))
    return bytes(b)


def put_u64(offset, value):
    return lambda b: struct.pack_into("<Q", b, offset, value)


def put_u32(offset, value):
    return lambda b: struct.pack_into("<I", b, offset, value)


def cases(version: int = 1) -> list[bytes]:
    """Valid blobs (the fourth escape-heavy) with headers of this version, then forgeries of it."""
    same = kt.version1 if version == 1 else bytes
    valid = [same(kvzip.compress(real_bf16(n, n), dtype="bf16").tobytes()) for n in (4096 * 5, 100_003, 64)]
    noisy = real_bf16(1 << 15, 3)
    hit = np.random.default_rng(77).random(noisy.shape[0]) < 0.03
    noisy[hit] = (noisy[hit] & 0x807F) | (np.random.default_rng(78).integers(200, 250, int(hit.sum())) << 7).astype(np.uint16)
    valid.append(same(kvzip.compress(noisy, dtype="bf16").tobytes()))
    b = valid[3]
    if version == 2:
        escapes = struct.unpack_from("<I", b, 32)[0]
        flipped = bytearray(b)
        flipped[33] ^= 2  # the CRC no longer matches
        return valid + [
            bytes(flipped),
            resealed(b, put_u32(32, escapes + 16)),        # escape streams past the blob
            resealed(b, put_u32(32, 0xFFFFFFFF)),
            resealed(b, put_u32(36, 16)),                  # exp_high bytes that are not there
            resealed(b, put_u32(12, 80)),                  # a compact header is 64 bytes
            resealed(b, put_u32(12, 4000)),
            b + bytes(16),                                 # blob longer than its payload
            b[:-8],                                        # a payload not a multiple of 16
            b[:60], b[:10],                                # shorter than the header, the prefix
            kt.version1(b),                                # the other version
            kvzip.compress(real_bf16(5000), dtype="bf16", checksum=True).tobytes(),
            rng.integers(0, 256, 3000, dtype=np.uint8).tobytes(),
        ]
    at = escapes_at(b)
    flipped = bytearray(b)
    flipped[at + 8] ^= 2  # the CRC no longer matches
    return valid + [
        bytes(flipped),
        resealed(b, put_u64(at + 8, struct.unpack_from("<Q", b, at + 8)[0] + 2)),  # esc_pos bytes != 2 x escapes
        resealed(b, put_u64(at + 8, 1 << 63)),                                      # would wrap in int64
        resealed(b, put_u64(at + 16, struct.unpack_from("<Q", b, at + 16)[0] + 16)),  # esc_exp not where layout puts it
        resealed(b, put_u64(16, struct.unpack_from("<Q", b, 16)[0] + 16)),           # payload past the blob
        b + bytes(16),                                                                # blob longer than its payload
        b[:200],                                                                      # blob shorter than its header
        b[:10],                                                                       # shorter than the prefix
        resealed(b, lambda x: struct.pack_into("<I", x, 36, 2)),                      # fewer than 3 streams
        resealed(b, lambda x: struct.pack_into("<I", x, 36, 0xFFFFFFFF)),             # escape table past the header
        resealed(b, lambda x: struct.pack_into("<I", x, 12, 4000)),                   # header longer than the span
        resealed(b, lambda x: struct.pack_into("<I", x, 12, 203)),                    # a header length not a multiple of 4
        kt.version1(kvzip.compress(real_bf16(5000), dtype="bf16", checksum=True).tobytes()),
        rng.integers(0, 256, 3000, dtype=np.uint8).tobytes(),
    ]


@pytest.mark.parametrize("version", [1, 2])
def test_gpu_checks_equal_the_host_twin(version):
    blobs = [cupy.asarray(np.frombuffer(c, np.uint8)) for c in cases(version)]
    sizes = [b.shape[0] for b in blobs]
    block, checks = programs.head_block([b.data.ptr for b in blobs], sizes)
    want = layout_cache.head_checks(block, sizes)
    np.testing.assert_array_equal(checks, want)
    if version == 1:
        assert checks[:4, 0].tolist() == [1, 1, 1, 1] and checks[4:-2, 0].tolist() == [0] * (len(blobs) - 6)
    else:
        # A compact header's checks are its CRC, its length and the payload's; escape counts that
        # do not fit the blob are the host's to find (match_many places the streams by the shape).
        assert checks[:, 0].tolist() == [1, 1, 1, 1] + [0, 1, 1, 1, 0, 0, 1, 0, 0, 0, 1] + [1, 0]
    assert checks[-2, 0] == 1  # a checksummed blob's header hangs together too (match_many then rejects its layout)


def test_decompress_many_refuses_forgeries_that_pass_the_gpu_checks():
    """A blob whose header hangs together but whose escape counts lie is caught by the decode
    kernels, named by its place in the batch; one with an unknown layout takes the full checks."""
    xs = [cupy.asarray(real_bf16(1 << 16, s)) for s in range(4)]
    blobs = kvzip.compress_many(xs, dtype="bf16")
    for back, x in zip(kvzip.decompress_many(blobs), xs):  # remembers the layout
        assert bool(cupy.array_equal(back.reshape(-1).view(x.dtype), x))
    host = blobs[2].get().tobytes()
    hdr = container.parse_header(host, len(host))
    count_at = hdr.header_len + next(off for name, _, off, _ in hdr.streams if name == "esc_count")
    bad = [b.copy() for b in blobs]
    bad[2][count_at:count_at + 2] = cupy.asarray([0xA0, 0x0F], np.uint8)  # chunk 0 claims 4000 escapes
    with pytest.raises(kvzip.FormatError, match="blob 2"):
        kvzip.decompress_many(bad)
    # A version-1 header's stream table can lie about a length (a compact one has none to forge).
    blobs = [cupy.asarray(np.frombuffer(kt.version1(b.get()), np.uint8)) for b in blobs]
    kvzip.decompress_many(blobs)  # remembers their layout
    host = blobs[2].get().tobytes()
    hdr = container.parse_header(host, len(host))
    entry = container.PREFIX.size + 16 * [name for name, *_ in hdr.streams].index("esc_count") + 8
    wrong = resealed(host, put_u64(entry, struct.unpack_from("<Q", host, entry)[0] + 2))  # esc_count's length
    bad = [b.copy() for b in blobs]
    bad[3] = cupy.asarray(np.frombuffer(wrong, np.uint8))
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress_many(bad)


def test_long_batch_with_forged_and_unknown_blobs():
    """decompress_many over a long batch: a forged blob mid-batch is named by its place and the
    next call works; a blob of a new layout mid-batch takes the full checks while the others
    stay on their remembered layout."""
    xs = [cupy.asarray(real_bf16(1 << 15, s)) for s in range(21)]
    blobs = kvzip.compress_many(xs, dtype="bf16")
    kvzip.decompress_many(blobs)  # remembers the layout
    host = blobs[13].get().tobytes()
    hdr = container.parse_header(host, len(host))
    count_at = hdr.header_len + next(off for name, _, off, _ in hdr.streams if name == "esc_count")
    bad = list(blobs)
    bad[13] = blobs[13].copy()
    bad[13][count_at:count_at + 2] = cupy.asarray([0xA0, 0x0F], np.uint8)
    with pytest.raises(kvzip.FormatError, match="blob 13"):
        kvzip.decompress_many(bad)
    odd = cupy.asarray(real_bf16(3 * 4099, 9)).reshape(3, -1)
    mixed = blobs[:10] + [kvzip.compress(odd, dtype="bf16")] + blobs[10:]
    for _ in range(2):  # a new layout, then a remembered one
        backs = kvzip.decompress_many(mixed)
        for back, x in zip(backs[:10] + backs[11:], xs):
            assert bool(cupy.array_equal(back.reshape(-1).view(x.dtype), x))
        assert backs[10].shape == odd.shape and bool(cupy.array_equal(backs[10].view(odd.dtype), odd))


@pytest.mark.parametrize("version", [1, 2])
def test_guessed_layout_decodes_exactly_where_the_host_match_would(version):
    """guess_head (decode without a header read-back) takes a blob's guessed layout exactly
    when layout_cache.match, the host's checks, would give that layout for its header; on every
    other case (forgeries, other layouts, checksums, junk) it reports a miss, decodes nothing of
    that blob and raises nothing, and the blobs it takes decode to their values.  Blobs shorter
    than the layout's fixed bytes are never guessed."""
    layout_cache.forget()
    host_cases = cases(version)
    blobs = [cupy.asarray(np.frombuffer(c, np.uint8)) for c in host_cases]
    kvzip.decompress(blobs[3])  # remembers the layout of the escape-heavy blob
    layout = layout_cache.guess(blobs[3].shape[0])
    assert layout is not None and layout.key == layout_cache._read(host_cases[3], len(host_cases[3]))[0]
    eligible = [b for b in blobs if b.shape[0] >= layout.fixed_bytes]
    assert all(layout_cache.guess(b.shape[0]) is None for b in blobs if b.shape[0] < layout.fixed_bytes)
    want_hits = []
    for b in eligible:
        host = b.get().tobytes()
        hit = layout_cache.match(host[:min(len(host), programs.HEAD_SPAN)], len(host))
        want_hits.append(hit is not None and hit[0] is layout)
    assert sum(want_hits) == 1 and len(eligible) >= 10
    for batch in ([[b] for b in eligible], [eligible]):  # one blob a call, then all in one program
        misses, start = [], 0
        for part in batch:
            got, missed = layout_cache.decode_guessed([layout] * len(part), part)
            if len(part) == 1:  # decompress's single-blob path must take and refuse the same blobs
                one = layout_cache.decode_one_guessed(layout, part[0])
                assert (one is None) == bool(missed)
                if one is not None:
                    np.testing.assert_array_equal(one.get(), got[0].get())
            misses += [start + i for i in missed]
            start += len(part)
            for value, b, m in zip(got, part, range(len(part))):
                assert (value is None) == (m in missed)
                if value is not None:
                    want = kvzip.decompress(b.get())
                    np.testing.assert_array_equal(value.get().view(np.uint16), want.view(np.uint16).ravel())
        assert [i not in misses for i in range(len(eligible))] == want_hits


def test_wrong_guesses_fall_back_to_the_checked_decode():
    """Blobs of two layouts of one length alternate, so each single decode's guess is the other
    layout's; a header broken after its layout was remembered; a batch mixing both layouts and
    an unknown one: every result is exact, and a broken header is still refused."""
    layout_cache.forget()
    x = cupy.asarray(real_bf16(3 * 4096 * 4, 5))
    a, b = kvzip.compress(x, dtype="bf16"), kvzip.compress(x.reshape(3, -1), dtype="bf16")
    odd = kvzip.compress(cupy.asarray(real_bf16(7000, 2)), dtype="bf16")
    misses = []
    real_guessed, real_one = layout_cache.decode_guessed, layout_cache.decode_one_guessed

    def spy(*args, **kwargs):
        got, missed = real_guessed(*args, **kwargs)
        misses.append(len(missed))
        return got, missed

    def spy_one(*args, **kwargs):
        got = real_one(*args, **kwargs)
        misses.append(int(got is None))
        return got

    layout_cache.decode_guessed, layout_cache.decode_one_guessed = spy, spy_one
    try:
        for blob in (a, b, a, b, a):
            back = kvzip.decompress(blob)
            assert bool(cupy.array_equal(back.reshape(-1).view(cupy.uint16), x))
        for _ in range(2):
            backs = kvzip.decompress_many([a, b, odd, b, a])
            for back, want in zip(backs, [x, x, None, x, x]):
                if want is not None:
                    assert bool(cupy.array_equal(back.reshape(-1).view(cupy.uint16), want))
        broken = a.copy()
        broken[44] ^= 1  # the header CRC
        with pytest.raises(kvzip.FormatError):
            kvzip.decompress(broken)
        with pytest.raises(kvzip.FormatError):
            kvzip.decompress_many([a, broken])
    finally:
        layout_cache.decode_guessed, layout_cache.decode_one_guessed = real_guessed, real_one
    assert len(misses) >= 4 and sum(misses) >= 1  # guesses were made, and some were wrong
