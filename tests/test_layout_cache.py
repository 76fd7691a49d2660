"""kvzip/gpu/layout_cache.py: a remembered blob layout matches later blobs that differ only in their
escape counts, gives the job row the general path would, and rejects every header it cannot vouch
for (those then take the general path).  Pure header logic, so it runs on the CPU; the GPU tests
cover the decode itself."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

import kvzip
from kvzip import testing as kt
from kvzip import container
from kvzip import stages as S
from kvzip.backends import get_backend
from kvzip.data import load_sample
from kvzip.pipeline import recorded_pipeline
from kvzip.gpu import layout_cache
from kvzip.stages.serialize import open_blob

rng = np.random.default_rng(7)
N = 40_000


def real_bits():
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("prose").values()])
    return rng.permutation(sample[:N])


def with_escapes(rate, version=2):
    """A blob of real KV with escapes at this rate, with a compact header (version 2, as
    kvzip writes it) or its version-1 twin."""
    bits = real_bits()
    hit = rng.random(N) < rate
    bits[hit] = (bits[hit] & 0x807F) | (rng.integers(200, 250, int(hit.sum())) << 7).astype(np.uint16)
    blob = kvzip.compress(bits, dtype="bf16")
    return blob if version == 2 else np.frombuffer(kt.version1(blob), np.uint8)


def head_of(blob):
    return container.read_head(get_backend("cpu"), blob)


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def remembered(request):
    """A remembered layout, its blob's header of version request.param (the blob is yielded)."""
    layout_cache.forget()
    blob = with_escapes(0.001, request.param)
    head = head_of(blob)
    opened = open_blob(get_backend("cpu"), blob, head)
    layout_cache.remember(head, blob.shape[0], opened, recorded_pipeline(opened.meta).stages)
    yield blob
    layout_cache.forget()


def expected_row(blob):
    hdr = container.parse_header(bytes(blob[:4096]), blob.shape[0])
    at = {name: hdr.header_len + off for name, _, off, _ in hdr.streams}
    nb = {name: size for name, _, _, size in hdr.streams}
    return [at[k] for k in ("codes", "rest", "esc_count", "esc_pos", "esc_exp", "exp_high")], nb


@pytest.mark.parametrize("rate", [0.0, 0.001, 0.01, 0.05])
def test_blobs_that_differ_in_escapes_match_with_their_own_offsets(remembered, rate):
    blob = with_escapes(rate, version_of(remembered))
    hit = layout_cache.match(head_of(blob), blob.shape[0])
    assert hit is not None
    layout, row = hit
    at, nb = expected_row(blob)
    assert list(row[0, :6]) == at
    assert (row[0, 6], row[0, 7], row[0, 8]) == (N, nb["esc_pos"] // 2, nb["exp_high"])
    assert layout.shape == (N,) and layout.chunk == 4096


def resealed(head: bytes, edit) -> bytes:
    """head after edit(bytearray), with a valid CRC again (so only the edited fields are wrong)."""
    b = bytearray(head)
    edit(b)
    struct.pack_into("<I", b, 40, 0)
    struct.pack_into("<I", b, 40, zlib.crc32(b[:int.from_bytes(b[12:16], "little")]))
    return bytes(b)


def version_of(blob) -> int:
    return int(np.asarray(blob)[8])


def v1(blob):
    return np.frombuffer(kt.version1(blob), np.uint8)


def test_headers_it_cannot_vouch_for_are_refused(remembered):
    if version_of(remembered) == 2:
        pytest.skip("the version-1 table's forgeries; the compact header's are the next test's")
    blob = with_escapes(0.01, 1)
    head, n = head_of(blob), blob.shape[0]
    hdr = container.parse_header(head, n)
    at = container.PREFIX.size + 16 * (len(hdr.streams) - 3)  # esc_pos's table entry
    assert layout_cache.match(head, n) is not None
    assert layout_cache.match(head, n + 16) is None  # payload length disagrees with the blob
    crc_broken = bytearray(head)
    crc_broken[at + 8] ^= 2
    assert layout_cache.match(bytes(crc_broken), n) is None
    odd = resealed(head, lambda b: struct.pack_into("<Q", b, at + 8, struct.unpack_from("<Q", b, at + 8)[0] + 1))
    assert layout_cache.match(odd, n) is None  # esc_pos no longer twice esc_exp
    shifted = resealed(head, lambda b: struct.pack_into("<Q", b, at + 16, struct.unpack_from("<Q", b, at + 16)[0] + 16))
    assert layout_cache.match(shifted, n) is None  # esc_exp not where container.layout puts it
    other_shape = v1(kvzip.compress(real_bits().reshape(200, 200), dtype="bf16"))
    assert layout_cache.match(head_of(other_shape), other_shape.shape[0]) is None
    checked = v1(kvzip.compress(real_bits(), dtype="bf16", checksum=True))
    assert layout_cache.match(head_of(checked), checked.shape[0]) is None


def compact_forgeries(head: bytes, n: int) -> list:
    """(head, blob length) pairs no remembered layout may vouch for: a compact header's escape
    fields, CRC or length that do not hang together with its blob."""
    escapes = struct.unpack_from("<I", head, 32)[0]
    crc_broken = bytearray(head)
    crc_broken[33] ^= 2
    return [(head, n + 16), (head, n - 16), (bytes(crc_broken), n),
            (resealed(head, lambda b: struct.pack_into("<I", b, 32, escapes + 16)), n),  # the streams outgrow the blob
            (resealed(head, lambda b: struct.pack_into("<I", b, 36, 16)), n),  # exp_high bytes that are not there
            (resealed(head, lambda b: struct.pack_into("<I", b, 32, 0xFFFFFFFF)), n)]


def test_compact_headers_it_cannot_vouch_for_are_refused(remembered):
    if version_of(remembered) == 1:
        pytest.skip("the compact header's forgeries")
    blob = with_escapes(0.01)
    head, n = head_of(blob), blob.shape[0]
    assert layout_cache.match(head, n) is not None
    for bad, nb in compact_forgeries(head, n):
        assert layout_cache.match(bad, nb) is None
    for other in (kvzip.compress(real_bits().reshape(200, 200), dtype="bf16"),
                  kvzip.compress(real_bits(), dtype="bf16", checksum=True), v1(blob)):
        assert layout_cache.match(head_of(other), other.shape[0]) is None


def remember_blob(blob):
    head = head_of(blob)
    opened = open_blob(get_backend("cpu"), blob, head)
    layout_cache.remember(head, blob.shape[0], opened, recorded_pipeline(opened.meta).stages)


def quantized_pipeline(granularity):
    return kvzip.Pipeline([S.QuantizeFP8("e5m2", granularity), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(),
                           S.Serialize()])


def test_per_tensor_quantized_layouts_are_remembered_with_their_scale():
    layout_cache.forget()
    blob = quantized_pipeline("tensor").encode(real_bits(), dtype="bf16")
    remember_blob(blob)
    (layout,) = layout_cache._layouts.values()
    stage, meta, scales_at = layout.dequantize
    hdr = container.parse_header(head_of(blob), blob.shape[0])
    at = {name: hdr.header_len + off for name, _, off, _ in hdr.streams}
    assert stage.id == "quantize_fp8" and stage.granularity == "tensor" and scales_at == at["scales"]
    assert (layout.fmt.name, layout.dtype_format.name, meta["quantize_fp8"]) == ("e5m2", "bf16", {"source_format": "bf16"})
    assert layout_cache.match(head_of(blob), blob.shape[0])[0] is layout
    layout_cache.forget()


def test_per_channel_quantized_and_checksummed_layouts_are_not_remembered():
    layout_cache.forget()
    remember_blob(quantized_pipeline("channel").encode(real_bits().reshape(-1, 64), dtype="bf16"))
    remember_blob(kvzip.compress(real_bits(), dtype="bf16", checksum=True))
    assert layout_cache._layouts == {}


def test_batch_matching_agrees_with_one_at_a_time(remembered):
    """match_many (decompress_many's path) gives, blob for blob, what match gives, on valid,
    tampered, foreign and short blobs, whatever lies in a row past its blob's end."""
    version = version_of(remembered)
    same = (lambda b: b) if version == 2 else v1
    cases = [(head_of(b), b.shape[0]) for b in (with_escapes(r, version) for r in (0.0, 0.001, 0.01, 0.05))]
    head, n = cases[2]
    if version == 1:
        hdr = container.parse_header(head, n)
        at = container.PREFIX.size + 16 * (len(hdr.streams) - 3)
        crc_broken = bytearray(head)
        crc_broken[at + 8] ^= 2
        cases += [(head, n + 16), (bytes(crc_broken), n),
                  (resealed(head, lambda b: struct.pack_into("<Q", b, at + 8, struct.unpack_from("<Q", b, at + 8)[0] + 1)), n),
                  (resealed(head, lambda b: struct.pack_into("<Q", b, at + 8, 1 << 63)), n)]  # would wrap in int64
    else:
        cases += compact_forgeries(head, n)
    cases += [(head_of(same(kvzip.compress(real_bits().reshape(200, 200), dtype="bf16"))), None),
              (head_of(same(kvzip.compress(real_bits(), dtype="bf16", checksum=True))), None),
              (head, 10)]  # a 10-byte blob whose row still holds an earlier blob's header
    cases = [(h, len(h) if nb is None else nb) for h, nb in cases]
    block = rng.integers(0, 256, (len(cases), 4096), dtype=np.uint8)  # stale bytes past each head
    for row, (h, _) in zip(block, cases):
        row[:len(h)] = np.frombuffer(h, np.uint8)
    groups, rest = layout_cache.match_many(block, [nb for _, nb in cases])
    batch = {int(p): (layout, jobs[j]) for layout, pos, jobs in groups for j, p in enumerate(pos)}
    assert sorted(batch) + rest == sorted(batch) + sorted(rest) and len(batch) + len(rest) == len(cases)
    for i, (h, nb) in enumerate(cases):
        one = layout_cache.match(h[:min(len(h), nb)], nb)
        if one is None:
            assert i in rest, i
        else:
            assert batch[i][0] is one[0] and list(batch[i][1]) == list(one[1][0]), i
    assert len(batch) == 4  # the four valid blobs of the remembered layout


def test_guess_picks_the_recent_layout_with_the_most_fixed_bytes_a_blob_can_have():
    """guess(nbytes): among the recently decoded layouts, the one with the most fixed bytes
    (header and streams before the escapes) at most nbytes, if nbytes is not longer than a blob
    of it can be, and of layouts with about as many fixed bytes the one decoded last;
    guess_many gives the same for a batch; forget() drops them all."""
    layout_cache.forget()
    small = kvzip.compress(real_bits()[:10_000], dtype="bf16")
    large = with_escapes(0.01)
    assert layout_cache.guess(large.shape[0]) is None
    remember_blob(small)
    remember_blob(large)
    by_len = {layout.n: layout for layout in layout_cache._recent.values()}
    lo, hi = by_len[10_000], by_len[N]
    assert lo.fixed_bytes < hi.fixed_bytes <= large.shape[0]
    sizes = [lo.fixed_bytes - 1, lo.fixed_bytes, small.shape[0], hi.fixed_bytes - 1, large.shape[0],
             hi.fixed_bytes + 4 * N + 48, hi.fixed_bytes + 4 * N + 49]
    below_hi = lo if hi.fixed_bytes - 1 <= lo.fixed_bytes + 4 * lo.n + 48 else None  # past lo's longest blob
    want = [None, lo, lo, below_hi, hi, hi, None]
    assert [layout_cache.guess(s) for s in sizes] == want
    assert layout_cache.guess_many(sizes) == want
    # Another header of about lo's fixed bytes (a band: lengths cannot tell them apart): the
    # layout decoded last is the guess, for either's blobs.
    again = kvzip.compress(real_bits()[:10_000].reshape(100, 100), dtype="bf16")
    remember_blob(again)
    other = layout_cache._layouts[layout_cache._read(head_of(again), again.shape[0])[0]]
    assert other is not lo and abs(other.fixed_bytes - lo.fixed_bytes) * layout_cache.NEAR <= lo.fixed_bytes
    assert layout_cache.guess(again.shape[0]) is other and layout_cache.guess(small.shape[0]) is other
    assert layout_cache.guess_many([small.shape[0], large.shape[0]]) == [other, hi]
    remember_blob(small)  # lo's layout decoded (and remembered) again
    lo = layout_cache._layouts[lo.key]
    assert layout_cache.guess(again.shape[0]) is lo and layout_cache.guess_many([small.shape[0]] * 3) == [lo] * 3
    for _ in range(layout_cache.MAX_RECENT):  # only the last MAX_RECENT layouts are kept
        remember_blob(kvzip.compress(real_bits()[:5000 + len(layout_cache._layouts)], dtype="bf16"))
    assert layout_cache.guess(large.shape[0]) is None
    layout_cache.forget()
    assert layout_cache.guess(small.shape[0]) is None and layout_cache.guess_many([small.shape[0]]) == [None]


def test_a_guess_span_holds_exactly_the_lengths_guess_gives_its_layout():
    """_guess_span (what decode_again checks a blob's length against): while the guess table
    stands, guess(n) is the layout for every n in [lo, hi) and not for the lengths just outside;
    in a band of several layouts, only for the one decoded last (shared: decode_again then checks
    that it still is); a new layout's note replaces the table."""
    layout_cache.forget()
    small = kvzip.compress(real_bits()[:10_000], dtype="bf16")
    large = with_escapes(0.01)
    remember_blob(small)
    remember_blob(large)
    for blob in (small, large):
        layout = layout_cache.guess(blob.shape[0])
        table, lo, hi, shared = layout_cache._guess_span(layout, blob.shape[0])
        assert table is layout_cache._table and lo <= blob.shape[0] < hi and not shared
        inside = [lo, hi - 1] + rng.integers(lo, hi, 50).tolist()
        assert all(layout_cache.guess(n) is layout for n in inside)
        assert layout_cache.guess(lo - 1) is not layout and layout_cache.guess(hi) is not layout
    lo_layout = layout_cache.guess(small.shape[0])
    again = kvzip.compress(real_bits()[:10_000].reshape(100, 100), dtype="bf16")
    remember_blob(again)  # another layout of the same band, decoded last
    assert layout_cache._table is not table  # the new layout's note dropped the table
    other = layout_cache.guess(again.shape[0])
    assert other is not lo_layout and layout_cache._latest == other.key
    assert layout_cache._guess_span(lo_layout, small.shape[0])[3]  # shared, and not the latest: no repeat
    table, lo, hi, shared = layout_cache._guess_span(other, again.shape[0])
    assert shared and lo <= again.shape[0] < hi
    assert all(layout_cache.guess(n) is other for n in [lo, hi - 1] + rng.integers(lo, hi, 50).tolist())
    assert layout_cache._guess_span(layout_cache.guess(large.shape[0]), large.shape[0])[3] is False
    layout_cache.forget()


def test_layouts_are_noted_and_guessed_from_several_threads():
    """Decodes on several threads note layouts and guess at once (the serving case): no thread
    sees a layout table mid-change, and every guess is a layout that fits."""
    import threading

    layout_cache.forget()
    blobs = [kvzip.compress(real_bits()[:4000 + 512 * i], dtype="bf16") for i in range(24)]  # > MAX_RECENT layouts
    errors = []

    def work(offset):
        try:
            for r in range(40):
                blob = blobs[(offset + r) % len(blobs)]
                remember_blob(blob)
                sizes = [blob.shape[0]] + [b.shape[0] for b in blobs]
                guesses = [layout_cache.guess(sizes[0])] + layout_cache.guess_many(sizes[1:])
                assert all(g is None or layout_cache._fits(g, n) for g, n in zip(guesses, sizes))
                if r % 13 == 0:
                    layout_cache.forget()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    import sys

    threads = [threading.Thread(target=work, args=(i * 5,)) for i in range(6)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside the table's updates, not only between calls
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    layout_cache.forget()
    assert errors == []


def test_compact_layouts_take_each_blobs_codebook():
    """Codebooks vary between blobs of one compact layout.  The match puts each blob's own in its
    job row (the layout's key holds none), single and batched alike.  An auto layout's guesses
    take the codebook from each header (expect leaves it blank; the guess row's dlo 0 and dhi
    the format's exponent count say so: guess_head); a given codebook's guesses expect the
    latest blob's."""
    layout_cache.forget()
    bits = real_bits()
    a = kvzip.compress(bits, dtype="bf16", codebook="auto")
    b = kvzip.compress(kt.scale_pow2(bits, 2), dtype="bf16", codebook="auto")
    assert bytes(a[48:64]) != bytes(b[48:64]) and len(a) == len(b)
    remember_blob(a)
    (layout,) = layout_cache._layouts.values()
    assert layout.own_codebook and layout.expect[48:64] == bytes(16)
    assert tuple(layout.guess_row[0, 10:12]) == (0, 256)  # DecodeJob's dlo, dhi
    hit = layout_cache.match(head_of(b), b.shape[0])
    assert hit is not None
    got, row = hit
    assert row[0, 10:12].view(np.uint8).tobytes() == bytes(b[48:64])
    assert got is layout and layout_cache.guess(b.shape[0]) is layout
    block = np.zeros((2, 4096), np.uint8)
    for i, blob in enumerate((a, b)):
        block[i, :blob.shape[0]] = np.asarray(blob)[:4096]
    groups, rest = layout_cache.match_many(block, [a.shape[0], b.shape[0]])
    assert rest == [] and len(groups) == 1
    _, pos, jobs = groups[0]
    assert [jobs[j, 10:12].view(np.uint8).tobytes() for j in range(2)] == [bytes(a[48:64]), bytes(b[48:64])]
    layout_cache.forget()
    books = [kvzip.Codebook(list(a[48:64]), "bf16"), kvzip.Codebook(list(b[48:64]), "bf16")]
    c, d = (kvzip.compress(bits, dtype="bf16", codebook=cb) for cb in books)
    remember_blob(c)
    (given,) = layout_cache._layouts.values()
    assert not given.own_codebook and given.expect[48:64] == bytes(c[48:64])
    got, row = layout_cache.match(head_of(d), d.shape[0])
    assert row[0, 10:12].view(np.uint8).tobytes() == bytes(d[48:64]) and got.expect[48:64] == bytes(d[48:64])
    assert tuple(got.guess_row[0, 10:12].view(np.uint8).tobytes()) == tuple(d[48:64])
    layout_cache.forget()
