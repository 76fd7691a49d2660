"""Blob layouts the general decode path has fully checked, so later blobs of the same layout go
straight to the fast path's kernels.

Decoding a blob on the GPU first checks its header (container.parse_header), the recorded
pipeline, the stream dtypes and lengths and the metadata: Python work on every call.  Blobs a
serving loop decodes share almost all of their header: the same shape, pipeline, codebook and
stream table, except the three escape streams' sizes (and so the payload length and the header
CRC), which follow each tensor's escape count (kvzip/layout.py's VARYING and escape entries).  After a blob decodes on the fast path, its header
with those fields blanked is remembered as a *layout*.  A later blob whose header blanks to the
same bytes only needs the varying fields checked: the CRC, the payload length, and escape
streams laid out exactly as layout.escape_layout places them (for a decompress_many batch,
programs's kvz_check_heads checks them on the GPU as the headers are read back; head_checks
here is its host twin).  Pipelines with QuantizeFP8 (one scale per tensor) in front are
remembered too: their codes decode the same way, then the stage turns them back into the
caller's values with the blob's scale.  Anything else (a checksum, stored raw,
other pipelines, a layout that differs) takes the general path, as before.  The kernels still
check every value-dependent fact (escape counts, positions, totals) on each call.

Reading a header back costs a host synchronisation before the decode can launch.  So a blob is
first decoded on a *guessed* layout (guess: of the recently decoded layouts, the one whose fixed
bytes best fit the blob's length), with no read-back: programs's guess_head, the first blocks of
the decode program's scan, makes match()'s checks on the GPU against the guessed layout's blanked
header and fills in the escape fields of the job row from the header.  A wrong guess (or a
header that does not hang together) flags the blob, the decode kernels skip it, and the host
decodes it the way above (match, else the general path).

A single blob decoded on a guessed layout leaves its set-up (GuessedDecode: the program, the
views that hand out the caller's tensor) with the thread, and decompress first offers the next
blob to it (decode_again): one of the same framework and device whose length guess() would give
the same layout goes straight to the program, with none of the import, guess or lookups redone.
"""
from __future__ import annotations

import bisect
import dataclasses
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvzip import container, layout as blob_layout
from kvzip.backends import get_backend
from kvzip.frame import Frame

from . import graphs, programs, quantize_kernels
from .abi import CHECKS, DECODE, HEADS

MAX_LAYOUTS = 4096
MAX_RECENT = 16  # layouts guess() tries, most recently decoded first
_FUSED_ONLY = ("exponent_split", "top16_pack", "escape_stream", "serialize")
_QUANTIZED = ("quantize_fp8",) + _FUSED_ONLY  # QuantizeFP8 with one scale per tensor in front
_ESCAPES = blob_layout.ESCAPES  # the last three stream table entries: esc_pos, esc_exp, exp_high (offset, bytes)
_PREFIX = blob_layout.PREFIX_SIZE
_HEADER_LEN, _STREAM_COUNT = blob_layout.HEADER_LEN, blob_layout.STREAM_COUNT
_PAYLOAD_LEN = blob_layout.PAYLOAD_LEN.span  # the varying prefix fields (blob_layout.VARYING)
_CRC = blob_layout.HEADER_CRC.span
_ESCAPES_BYTES = _ESCAPES.size
_PAYLOAD_ZERO, _ESCAPES_ZERO = bytes(blob_layout.PAYLOAD_LEN.size), bytes(_ESCAPES_BYTES)
# A compact (version-2) header's varying fields: escapes, exp_high bytes and the CRC, back to back.
_COMPACT_VARYING = slice(blob_layout.COMPACT_FIELD["escapes"].offset, blob_layout.HEADER_CRC.end)
assert _COMPACT_VARYING.stop - _COMPACT_VARYING.start == sum(f.size for f in blob_layout.COMPACT_VARYING)
_COMPACT_COUNTS = struct.Struct("<II")  # escapes, exp_high bytes
_COMPACT_SIZE = blob_layout.COMPACT_SIZE
_CODEBOOK = blob_layout.COMPACT_FIELD["codebook"].span  # a compact header's 16 codebook bytes: dlo, dhi
_DLUT = DECODE.span("dlo", "dhi")


_SOURCE = blob_layout.COMPACT_FIELD["codebook_source"].offset
_AUTO_SOURCE = blob_layout.CODEBOOK_SOURCES.index("auto")


def _own_codebook(key: bytes) -> bool:
    """Whether the blobs of a layout (its key) each carry their own codebook: a compact header's,
    chosen for its tensor (codebook="auto")."""
    return len(key) == _COMPACT_SIZE and blob_layout.version_of(key) == blob_layout.COMPACT_VERSION \
        and key[_SOURCE] == _AUTO_SOURCE


def _expect(head: bytes, key: bytes) -> bytes:
    """Layout.expect of a header whose key is key: a compact header's codebook put back, unless
    each blob has its own (the guess then takes it from the header: guess_head)."""
    if len(key) != _COMPACT_SIZE or blob_layout.version_of(head) != blob_layout.COMPACT_VERSION or _own_codebook(key):
        return key
    b = bytearray(key)
    b[_CODEBOOK] = head[_CODEBOOK]
    return bytes(b)
# Job row columns (kvzip/gpu/abi.py's DecodeJob): the six stream addresses, the escape streams',
# their lengths; and the columns of what kvz_check_heads finds of a header (CHECKS).
_STREAMS = DECODE.span("codes", "exp_high")
_N_ESC = DECODE.col("n_esc")
_ESC_POS, _ESCAPE_STREAMS, _ESCAPE_LENGTHS = DECODE.col("esc_pos"), DECODE.span("esc_pos", "exp_high"), \
    DECODE.span("n_esc", "n_high")
_N_HIGH = DECODE.col("n_high")
_OK, _AT_ESC_POS, _AT = CHECKS.col("ok"), CHECKS.col("esc_pos"), CHECKS.span("esc_pos", "exp_high")
_COUNTS, _SIZE = CHECKS.span("n_esc", "n_high"), CHECKS.span("header_len", "stream_count")
_H, _NS = CHECKS.col("header_len"), CHECKS.col("stream_count")
_FACTS = CHECKS.span("ok", "n_high")
_HEAD_PTR, _HEAD_LEN = HEADS.col("ptr"), HEADS.col("len")


@dataclass(frozen=True)
class Layout:
    fmt: object            # the stored format (the kernels')
    dtype_format: object   # the caller's dtype, which decoding gives back
    shape: tuple
    n: int
    chunk: int
    header_len: int
    esc_pos_offset: int    # payload offset of esc_pos (fixed: every stream before it has a fixed size)
    row: np.ndarray        # the job row: codes, rest, esc_count addresses relative to the blob, n, codebook
    key: bytes             # the header with the escape-dependent fields blanked (what _layouts maps);
                           # a compact one's codebook too: the job row takes each blob's (match)
    expect: bytes          # what a guessed blob's header must be, blanked (guess_head): key, with a
                           # compact header's codebook kept, as the row's dlo/dhi are this one's
                           # (not where each blob has its own: own_codebook)
    dequantize: tuple | None = None  # (QuantizeFP8 stage, its frame meta, scales offset in the blob)

    @property
    def fixed_bytes(self) -> int:
        """Bytes up to esc_pos: every blob of this layout has at least these."""
        return self.header_len + self.esc_pos_offset

    @property
    def most_bytes(self) -> int:
        """The longest a blob of this layout can be.  Escape streams: at most 2 + 1 bytes an
        escape and a byte of high exponents a value, padded."""
        return self.fixed_bytes + 4 * self.n + blob_layout.ESCAPE_SLACK

    @cached_property
    def own_codebook(self) -> bool:
        """Each blob of this layout carries its own codebook (codebook="auto")."""
        return _own_codebook(self.key)

    @cached_property
    def guess_row(self) -> np.ndarray:
        """The job row for a blob guessed to be of this layout: esc_pos where the guess puts it
        (the GPU's guess checks that and fills in the other escape fields; n_high stays
        GUESS_PENDING until it has).  Where each blob has its own codebook, dlo 0 and dhi the
        format's exponent count: the guess takes the codebook from the header (guess_head)."""
        row = self.row.copy()
        row[:, _ESC_POS] = self.fixed_bytes
        row[:, _N_HIGH] = programs.GUESS_PENDING
        if self.own_codebook:
            row[:, _DLUT] = (0, 1 << self.fmt.exp_bits)
        return row


_layouts: dict = {}
_recent: OrderedDict = OrderedDict()  # key -> Layout of the latest layouts decoded, most recent last


def _read(head: bytes, nbytes: int):
    """(blanked header, CRC matches, payload length, the escape entries' six fields) of head, the
    first bytes of a blob of nbytes, or None if it is too short to hold what its prefix claims.
    The blanked header is the header with the fields that follow the escape count zeroed:
    payload length, CRC, escape entries (a compact header: escapes, exp_high bytes, CRC).  A
    compact header's entries are (0, 0, escapes, 0, exp_high bytes, 0)'s counts only (their
    offsets follow from the layout: _compact_entries) and its payload length the blob's rest."""
    if len(head) < _PREFIX:
        return None
    if blob_layout.version_of(head) == blob_layout.COMPACT_VERSION:
        if _HEADER_LEN.read(head) != _COMPACT_SIZE or len(head) < _COMPACT_SIZE:
            return None
        b = bytearray(head[:_COMPACT_SIZE])
        stored, crc = blob_layout.crc_blanked(b)
        escapes, high = _COMPACT_COUNTS.unpack_from(b, _COMPACT_VARYING.start)
        b[_COMPACT_VARYING] = bytes(_COMPACT_VARYING.stop - _COMPACT_VARYING.start)
        b[_CODEBOOK] = bytes(16)
        return bytes(b), crc == stored, nbytes - _COMPACT_SIZE, (0, 0, 0, escapes, 0, high)
    header_len = int.from_bytes(head[_HEADER_LEN.span], "little")
    nstreams = int.from_bytes(head[_STREAM_COUNT.span], "little")
    at = blob_layout.escape_entries_at(nstreams, header_len)
    if header_len > len(head) or at is None:
        return None
    b = bytearray(head[:header_len])
    stored, crc = blob_layout.crc_blanked(b)  # the CRC covers the header with its own field zeroed
    escapes = _ESCAPES.unpack_from(b, at)
    payload = int.from_bytes(b[_PAYLOAD_LEN], "little")
    b[_PAYLOAD_LEN] = _PAYLOAD_ZERO
    b[at:at + _ESCAPES_BYTES] = _ESCAPES_ZERO
    return bytes(b), crc == stored, payload, escapes


def remember(head: bytes, nbytes: int, opened: Frame, stages: list) -> None:
    """Remember the layout of a blob of nbytes the general path has just decoded on the fast path
    (opened: its frame as serialize.open_blob gave it; stages: its recorded pipeline's)."""
    if _HEADER_LEN.read(head) > container.CACHE_HEADER_MAX:
        return  # bounds the layouts' bytes as container's cache is bounded (MAX_LAYOUTS of them)
    hdr = container.parse_header(head, nbytes)  # cached: the general path parsed it
    read = _read(head, nbytes)
    ids = tuple(s.id for s in stages)
    if hdr.flags or read is None or ids not in (_FUSED_ONLY, _QUANTIZED):
        return
    if tuple(s[0] for s in hdr.streams[-3:]) != blob_layout.ESCAPE_STREAMS:
        return
    from kvzip.codebook import frame_codebook

    at = {name: hdr.header_len + off for name, _, off, _ in hdr.streams}  # 16-byte multiples, like the header
    dequantize = None
    if ids == _QUANTIZED:
        if stages[0].granularity != "tensor" or "scales" not in at:
            return
        meta = {k: opened.meta[k] for k in ("dtype", "shape", "n", "format", "quantize_fp8")}
        dequantize = (stages[0], meta, at["scales"])
    row = _fixed_row(at, opened.n, frame_codebook(opened))
    if len(_layouts) >= MAX_LAYOUTS:
        forget()
    layout = _layouts[read[0]] = Layout(opened.format, opened.dtype_format, tuple(opened.meta["shape"]), opened.n,
                                        stages[-2].chunk, hdr.header_len, hdr.streams[-3][2], row, read[0],
                                        _expect(head, read[0]), dequantize)
    _note(layout)


def planned(plan, fmt, shape: tuple, chunk: int, codebook) -> Layout:
    """The layout of every blob an encode plan (programs._Plan of a fused-only pipeline, without
    a checksum) writes with this codebook: its header template is a blob's header with no
    escapes.  What decompress_into expects of a blob, with no blob decoded yet."""
    h = len(plan.header)
    key = _read(plan.header, h + plan.off["esc_pos"])[0]
    row = _fixed_row({name: h + at for name, at in plan.off.items()}, plan.n, codebook)
    return Layout(fmt, fmt, tuple(shape), plan.n, chunk, h, plan.off["esc_pos"], row, key, _expect(plan.header, key))


def _fixed_row(at: dict, n: int, codebook) -> np.ndarray:
    """A layout's job row: the fixed streams' blob offsets (at: stream name -> offset from the
    blob's start), n, and the codebook's decode words; the escape fields are each blob's."""
    dlo, dhi = programs.dlut_words(codebook) if codebook is not None else (0, 0)  # None: auto's, each blob's own
    return DECODE.row(codes=at["codes"], rest=at["rest"], esc_count=at["esc_count"], n=n, dlo=dlo, dhi=dhi)


_lock = threading.Lock()  # _recent, _stamps and _table change together (decodes on several threads)


def forget() -> None:
    """Drop every remembered layout (the next blobs take the general path)."""
    global _table
    with _lock:
        _layouts.clear()
        _recent.clear()
        _stamps.clear()
        _table = None


_stamps: dict = {}  # key -> when its layout was last decoded (a counter), for ties between guesses
_clock = iter(range(1 << 62))
_latest = None     # the key of the layout decoded last (the highest stamp)


def _note(layout: Layout) -> None:
    """Record that a blob of layout was just decoded (what guess() goes by)."""
    global _table, _latest
    with _lock:
        _stamps[layout.key] = next(_clock)
        _latest = layout.key
        known = _recent.get(layout.key)
        if known is not None:
            _recent.move_to_end(layout.key)
            if known is layout:
                return
        _recent[layout.key] = layout  # new, or remembered anew by the general path
        if len(_recent) > MAX_RECENT:
            _stamps.pop(_recent.popitem(last=False)[0], None)
        _table = None


_table = None  # (band starts ascending, each band's layouts) from _recent
NEAR = 64      # layouts whose fixed bytes are within 1/NEAR of each other share a band


def _guess_table() -> tuple:
    """_recent's layouts (those the GPU's guess can check) in bands of near-equal fixed bytes: a
    blob's length cannot tell the layouts of a band apart."""
    global _table
    table = _table
    if table is not None:
        return table
    with _lock:
        starts, bands = [], []
        for layout in sorted((x for x in _recent.values() if x.header_len <= programs.HEAD_SPAN),
                             key=lambda x: x.fixed_bytes):
            if bands and layout.fixed_bytes <= bands[-1][-1].fixed_bytes * (NEAR + 1) // NEAR:
                bands[-1].append(layout)
            else:
                starts.append(layout.fixed_bytes)
                bands.append([layout])
        _table = table = (starts, bands)
    return table


def _fits(layout: Layout, nbytes: int) -> bool:
    return layout.fixed_bytes <= nbytes <= layout.most_bytes


def guess(nbytes: int) -> Layout | None:
    """The layout a blob of nbytes most likely has, without reading its header: of the last
    MAX_RECENT layouts decoded, one with the most fixed bytes (header and the streams before the
    escapes) that a blob of nbytes can have; where several have about as many, the one decoded
    last.  Only a guess: decode_guessed checks it against the header on the GPU.  The blob is
    at least the layout's fixed_bytes long, so every stream the GPU reads before that check
    lies inside it."""
    starts, bands = _guess_table()
    i = bisect.bisect_right(starts, nbytes) - 1
    if i < 0:
        return None
    band = bands[i]
    if len(band) == 1:
        return band[0] if _fits(band[0], nbytes) else None
    fitting = [x for x in band if _fits(x, nbytes)]
    return max(fitting, key=lambda x: _stamps.get(x.key, -1)) if fitting else None


def guess_many(nbytes) -> list:
    """guess() for each of a batch's blob lengths."""
    starts, bands = _guess_table()
    if not bands:
        return [None] * len(nbytes)
    lo, hi = min(nbytes), max(nbytes)
    i = bisect.bisect_right(starts, lo) - 1
    if i >= 0 and len(bands[i]) == 1 and _fits(bands[i][0], lo) and _fits(bands[i][0], hi) and \
            (i + 1 == len(starts) or hi < starts[i + 1]):
        return [bands[i][0]] * len(nbytes)  # the usual batch: every blob of one layout's
    return [guess(n) for n in nbytes]


def match(head: bytes, nbytes: int) -> tuple[Layout, np.ndarray] | None:
    """(layout, job row relative to the blob) for a blob of nbytes starting with head whose layout
    was remembered and whose varying fields check out; None sends it down the general path."""
    read = _read(head, nbytes)
    layout = _layouts.get(read[0]) if read is not None else None
    if layout is None:
        return None
    _, crc_ok, payload, entries = read
    h = layout.header_len
    compact = h == _COMPACT_SIZE and blob_layout.version_of(head) == blob_layout.COMPACT_VERSION
    if compact:
        entries = blob_layout.escape_entries(layout.esc_pos_offset, entries[3], entries[5])[0]
    pos_at, pos_nb, exp_at, exp_nb, high_at, high_nb = entries
    if not crc_ok or not blob_layout.payload_fits(h, payload, nbytes):
        return None
    if pos_at != layout.esc_pos_offset or not blob_layout.escapes_laid_out(payload, entries):
        return None  # laid out otherwise than layout.escape_layout would: the general path decides
    if compact:  # later guesses expect the blob's codebook (the layout's key holds none)
        if not _books_valid(np.frombuffer(head[_CODEBOOK], np.uint8)[None], layout.fmt)[0]:
            return None
        layout = _expecting(layout, head[_CODEBOOK])
    row = layout.row.copy()
    if compact:  # and its job row takes it, whatever the layout's guesses expect
        row[0, _DLUT] = np.frombuffer(bytes(head[_CODEBOOK]), "<u8")
    row[0, _ESCAPE_STREAMS] = (h + pos_at, h + exp_at, h + high_at)
    row[0, _ESCAPE_LENGTHS] = (exp_nb, high_nb)  # escapes; high-exponent bytes
    _note(layout)
    return layout, row


def _expecting(layout: Layout, codebook: bytes) -> Layout:
    """layout, or where its guesses expect another compact codebook, the layout with this one in
    its place (expect and the job row's dlo/dhi), remembered instead: a guess checks the codebook
    (the early chunks of a guessed decode run before the header is read), so blobs of a layout
    whose codebook changed go back to guessed decodes from the second one on.  A layout whose
    blobs each have their own codebook (auto) guesses with none: layout itself."""
    codebook = bytes(codebook)
    if layout.own_codebook or layout.expect[_CODEBOOK] == codebook:
        return layout
    expect = bytearray(layout.expect)
    expect[_CODEBOOK] = codebook
    row = layout.row.copy()
    row[:, _DLUT] = np.frombuffer(codebook, "<u8")
    new = dataclasses.replace(layout, expect=bytes(expect), row=row)
    with _lock:
        if _layouts.get(layout.key) is layout:
            _layouts[layout.key] = new
    return new


def head_checks(block: np.ndarray, nbytes) -> np.ndarray:
    """What programs's kvz_check_heads finds of a batch's headers, computed on the host (the
    kernel's reference): block holds the blobs' first bytes, a row each, nbytes their lengths.
    A row of 8 words per blob: 1 if its header hangs together, then esc_pos's, esc_exp's and
    exp_high's payload offsets, the escapes, the high-exponent bytes (all 0 unless it does);
    the header length and stream count the prefix claims (0 for a blob shorter than it).
    Hangs together: the header fits the row and the blob, its CRC matches, the escape streams
    follow one another as layout.escape_layout places them and close the payload, which ends at
    the blob's end.  What match() checks, less the comparison with a remembered layout.
    A compact header: it is COMPACT_SIZE bytes and fits, its CRC matches, the payload is an
    ALIGN multiple; the offsets are 0 (they follow from the shape: match_many places them)
    and so is the stream count."""
    k, span = block.shape
    out = np.zeros((k, CHECKS.columns), np.uint64)
    for t in range(k):
        n = int(nbytes[t])
        if n < _PREFIX:
            continue
        row = block[t]
        h, ns = int(row[_HEADER_LEN.span].view("<u4")[0]), int(row[_STREAM_COUNT.span].view("<u4")[0])
        if blob_layout.version_of(row) == blob_layout.COMPACT_VERSION:
            out[t, _H] = h
            read = _read(row[:min(span, n)].tobytes(), n) if h <= min(span, n) else None
            if read is not None and read[1] and not (n - h) % blob_layout.ALIGN:
                out[t, _FACTS] = (1, 0, 0, 0, read[3][3], read[3][5])
            continue
        out[t, _SIZE] = (h, ns)
        read = _read(row[:min(h, span, n)].tobytes(), n)  # None when the header does not fit (or its table)
        if read is None:
            continue
        _, crc_ok, payload, e = read
        # Below 2^48, as the kernel requires before summing fields in 64 bits.
        if crc_ok and max(*e, payload) < 1 << 48 and blob_layout.escapes_laid_out(payload, e) and \
                blob_layout.payload_fits(h, payload, n):
            out[t, _FACTS] = (1, e[0], e[2], e[4], e[3], e[5])  # ok, the three offsets, escapes, high bytes
    return out


def match_many(block: np.ndarray, nbytes, checks: np.ndarray | None = None) -> tuple[list, list]:
    """match() for a batch at once: block holds the blobs' first bytes, a row each
    (programs.head_block), nbytes their lengths, checks what head_checks gives for them (from
    the GPU; computed here if None).  Returns (groups, rest): groups is a list of (layout,
    positions, jobs) with the batch positions of the blobs of one remembered layout and their
    job rows (relative to each blob), rest the positions left for the general path.  A row
    passes when its header hangs together (checks) and, with the fields that follow the escape
    count blanked, is a remembered layout's, with esc_pos where that layout has it."""
    k = block.shape[0]
    if checks is None:
        checks = head_checks(block, nbytes)
    taken = np.zeros(k, bool)
    groups = []
    sel = np.nonzero(checks[:, _OK] == 1)[0]
    if sel.size:
        sizes = checks[sel, _H] << np.uint64(32) | checks[sel, _NS]  # header length, stream count
        one = bool((sizes == sizes[0]).all())  # the usual batch: one layout
        for size in ([int(sizes[0])] if one else np.unique(sizes).tolist()):
            h, ns = size >> 32, size & 0xFFFFFFFF
            pos = sel if one else sel[sizes == size]
            rows = block[:, :h].copy() if pos.size == k else block[pos, :h]  # a copy either way: blanked below
            compact = ns == 0  # kvz_check_heads gives a compact header no stream count, a version-1 one >= 3
            groups += _match_rows(rows, pos, checks[pos], h, None if compact else blob_layout.escapes_at(ns), taken,
                                  np.asarray(nbytes, np.int64)[pos])
    return groups, np.nonzero(~taken)[0].tolist()


def _match_rows(b: np.ndarray, pos, checks, h: int, at: int | None, taken, nbytes) -> list:
    """match_many for rows b (consistent headers of length h, escape entries at byte at; None:
    compact headers) of blobs of nbytes."""
    books = None
    if at is None:
        book_bytes = b[:, _CODEBOOK].copy()
        books = book_bytes.view("<u8")  # each blob's codebook: its dlo, dhi
        b[:, _COMPACT_VARYING] = 0  # escapes, exp_high bytes, CRC
        b[:, _CODEBOOK] = 0
    else:
        b[:, _PAYLOAD_LEN] = 0   # payload length
        b[:, _CRC] = 0           # CRC
        b[:, at:at + _ESCAPES_BYTES] = 0  # escape entries
    if (b == b[0]).all():
        by_key = {b[0].tobytes(): slice(None)}
    else:
        by_key = {}
        for j, row in enumerate(b):
            by_key.setdefault(row.tobytes(), []).append(j)
    out = []
    for key, js in by_key.items():
        layout = _layouts.get(key)
        if layout is None:
            continue
        js = np.arange(b.shape[0])[js]
        c = checks[js]
        if at is None:  # compact: place the escape streams after the layout's esc_pos; they must close the payload
            c = _compact_entries(c, layout.esc_pos_offset)
            ok = _aligned(c[:, _AT][:, 2] + c[:, _N_HIGH_CHECK]) == (nbytes[js] - h).astype(np.uint64)
        else:
            ok = c[:, _AT_ESC_POS] == layout.esc_pos_offset
        if books is not None:
            ok &= _books_valid(book_bytes[js], layout.fmt)
        if not ok.all():
            js, c = js[ok], c[ok]
        if not js.size:
            continue
        if books is not None:  # later guesses expect the last blob's codebook
            layout = _expecting(layout, books[js[-1]].tobytes())
        jobs = np.repeat(layout.row, js.size, axis=0)
        if books is not None:
            jobs[:, _DLUT] = books[js]
        jobs[:, _ESCAPE_STREAMS] = h + c[:, _AT]   # esc_pos, esc_exp, exp_high
        jobs[:, _ESCAPE_LENGTHS] = c[:, _COUNTS]   # escapes (esc_exp bytes); high-exponent bytes
        taken[pos[js]] = True
        _note(layout)
        out.append((layout, pos[js], jobs))
    return out


_N_HIGH_CHECK = CHECKS.col("n_high")


def _books_valid(books: np.ndarray, fmt) -> np.ndarray:
    """Per row of books (a compact header's 16 codebook bytes: code i's exponent), whether it
    is a codebook of fmt: 16 distinct exponents that fmt has.  The header CRC covers a forged
    codebook as well as a real one, so a job row takes a header's only after this check (the
    guess makes the same one on the GPU: guess_head); the general path raises FormatError."""
    s = np.sort(books, axis=1)
    return (s[:, -1] < (1 << fmt.exp_bits)) & (s[:, 1:] != s[:, :-1]).all(axis=1)


def _aligned(x: np.ndarray) -> np.ndarray:
    """x rounded up to ALIGN multiples (uint64)."""
    up = np.uint64(blob_layout.ALIGN - 1)
    return (x + up) & ~up


def _compact_entries(checks: np.ndarray, var_base: int) -> np.ndarray:
    """Compact headers' checks rows with the escape streams' offsets filled in, as
    layout.escape_layout places them after esc_pos at var_base (their counts are the header's)."""
    c = checks.copy()
    ne = c[:, CHECKS.col("n_esc")]
    c[:, CHECKS.col("esc_pos")] = var_base
    c[:, CHECKS.col("esc_exp")] = exp_at = _aligned(np.uint64(var_base) + np.uint64(blob_layout.ESC_POS_BYTES) * ne)
    c[:, CHECKS.col("exp_high")] = _aligned(exp_at + ne)
    return c


def decode(matches: list, blobs: list, origin=None) -> list:
    """Decode blobs (16-byte aligned, all of one format and chunk size) from match()'s results;
    returns their raw-bit arrays, or with origin (kvzip.arrays.Origin) the caller's tensors."""
    rows = np.concatenate([row for _, row in matches]) if len(matches) > 1 else matches[0][1]
    return decode_rows([m[0] for m in matches], rows, blobs, origin=origin)


def decode_guessed(layouts: list, blobs: list, labels=None, origin=None, addresses=None) -> tuple[list, list]:
    """Decode blobs (16-byte aligned, of one format and chunk size) on layouts guess() gave, with
    no header read-back: the GPU checks each header against its guess (programs's
    guess_head) and fills in the escape fields as it goes.  Returns (results as
    decode_rows', misses): the positions of the blobs whose guess was wrong, whose results are
    None (decode them the checked way).  addresses: (device addresses, lengths) of the blobs, if
    the caller has them."""
    first, k = layouts[0], len(layouts)
    same = all(layout is first for layout in layouts)
    jobs = np.repeat(first.guess_row, k, axis=0) if same else np.concatenate([layout.guess_row for layout in layouts])
    heads = np.empty((k, HEADS.columns), np.uint64)
    ptrs, lengths = addresses if addresses is not None else ([b.data.ptr for b in blobs], [b.shape[0] for b in blobs])
    heads[:, _HEAD_PTR] = ptrs
    heads[:, _HEAD_LEN] = lengths
    return decode_rows(layouts, jobs, blobs, labels, origin, heads)


class GuessedDecode:
    """A single blob's decode on a guessed layout, set up for one caller: the program, the views
    that hand results out as the caller's tensors, where the blob's scale lies.  The last one that
    succeeded on a thread is kept (graphs.remember) and run again by decode_again for a blob
    like that one, so decompress's usual call repeats none of the set-up."""

    __slots__ = ("layout", "origin", "views", "scale_at", "program", "span")

    def __init__(self, layout: Layout, origin, pair: tuple | None, program):
        self.layout, self.origin, self.program = layout, origin, program
        self.views = _views((layout,), pair, origin)
        self.scale_at = layout.dequantize[2] if pair is not None else None
        self.span = None  # (guess table, lo, hi, shared): _guess_span's

    def run(self, ptr: int, nbytes: int, stream):
        """Decode the blob of nbytes at ptr on stream (programs._DecodeProgram.run_one):
        the result (origin's tensor where views gives one, else raw bits), or None if the
        blob's header was not the layout's."""
        # The layout is noted as the GPU decodes: on a miss the full path then notes the right one.
        got, missed = self.program.run_one(self.layout.guess_row, ptr, nbytes, stream, self.views,
                                           self.origin if self.views is not None else None, self.scale_at,
                                           self.note)
        return None if missed else got

    def note(self) -> None:
        _note(self.layout)


def decode_one_guessed(layout: Layout, blob, origin=None):
    """decode_guessed for one blob, with the least host work (GuessedDecode: the program keeps
    the layout's row staged).  Returns the result, or None if the guess was wrong."""
    pair = _fused_dequantize((layout,), (blob,))
    nbytes = blob.shape[0]
    heavy = programs.heavy(layout.fmt, layout.n, _escapes_at_most(layout, nbytes), pair)
    program, stream = programs.decode_program(layout.fmt, layout.chunk, (layout.n,), pair, (layout.expect,), heavy)
    call = GuessedDecode(layout, origin, pair, program)
    got = call.run(blob.data.ptr, nbytes, stream)
    if got is None:
        return None
    if call.views is not None and graphs.KEEP:  # results come out as the caller's: decode_again can repeat it
        span = _guess_span(layout, nbytes)
        if span is not None and pair is None:  # only for blobs whose length picks the same decoder instance
            table, lo, hi, shared = span
            # the shortest blob of the layout with heavy_escapes escapes at most (_escapes_at_most)
            heavy_from = layout.fixed_bytes + _BYTES_PER_ESCAPE * programs.heavy_escapes(layout.fmt, layout.n)
            span = (table, max(lo, heavy_from), hi, shared) if heavy else (table, lo, min(hi, heavy_from), shared)
        if span is not None:
            call.span = span
            graphs.remember("decode", call)
    return _handed_out([got], [blob], (layout,), pair, call.views, origin)[0]


def last_decode():
    """This thread's last decode on a guessed layout (its GuessedDecode), if it may run again."""
    return graphs.recall("decode") if programs.ENABLED else None


def decode_again(call, found):
    """decompress of a blob like the one this thread last decoded by decode_one_guessed, by
    that call's GuessedDecode (last_decode()): of the same framework and device (current, and
    16-byte aligned), and of a length guess() gives the same layout for, nothing remembered or
    forgotten since.  found: the blob's (origin, (address,), (length,)) as the caller's
    framework tells them (kvzip.arrays.blob_addresses), or None.  Returns the result, or None
    where the blob is not like it or the guess missed (the caller then takes the full path,
    which guesses again)."""
    if found is None or found[0] is not call.origin:
        return None
    (ptr,), (nbytes,) = found[1], found[2]
    table, lo, hi, shared = call.span
    if _table is not table or not lo <= nbytes < hi or (shared and _latest != call.layout.key):
        return None
    if call.scale_at is not None and ((ptr + call.scale_at) % 16 or not quantize_kernels.ENABLED):
        return None  # the dequantizing kernels need the scale aligned (and may be switched off)
    stream = call.origin.working_stream()
    return call.run(ptr, nbytes, stream) if stream is not None else None


def _guess_span(layout: Layout, nbytes: int) -> tuple | None:
    """(guess table, lo, hi, shared): while that table stands (no layout remembered, noted anew or
    forgotten), guess(n) gives layout for every lo <= n < hi, as it did for nbytes; where layout
    shares its band with others (shared), only while it is the layout decoded last (guess() then
    goes by recency).  None where guess(nbytes) would not give layout."""
    table = _guess_table()
    starts, bands = table
    i = bisect.bisect_right(starts, nbytes) - 1
    if i < 0 or not any(x is layout for x in bands[i]):
        return None
    hi = starts[i + 1] if i + 1 < len(starts) else 1 << 62
    return table, max(starts[i], layout.fixed_bytes), min(hi, layout.most_bytes + 1), len(bands[i]) > 1


def _views(layouts, pair, origin, distinct=None):
    """What a decode program hands out as it runs (see programs._DecodeProgram.run): origin's
    tensors straight from the kernels' output where the values come out final, else None (raw
    bits, for _handed_out to finish).  distinct: the different layouts among layouts, if known."""
    if origin is None or (pair is None and any(layout.dequantize for layout in distinct or layouts)):
        return None

    def views(buffer, offsets):
        return buffer.tensors([(at, layout.dtype_format, layout.shape) for at, layout in zip(offsets, layouts)])
    return views


def _handed_out(got: list, blobs, layouts, pair, views, origin) -> list:
    """A decode's results as the caller gets them: where the program handed out raw bits,
    QuantizeFP8's decode applied on the host side (if the kernels did not) and the export to
    origin's framework.  None stays None (a blob left to another path)."""
    if pair is None and views is None:
        got = [_dequantized(b, blob, layout) if layout.dequantize and b is not None else b
               for b, blob, layout in zip(got, blobs, layouts)]
    if views is None and origin is not None:
        got = [origin.export_tensor(b, layout.dtype_format, layout.shape) if b is not None else None
               for b, layout in zip(got, layouts)]
    return got


def decode_rows(layouts: list, jobs: np.ndarray, blobs: list, labels=None, origin=None, heads=None):
    """Decode blobs from their layouts and job rows (relative to each blob; changed in place).
    labels: what errors call each blob (its position in the caller's batch).  origin: hand the
    results out as that caller's tensors (built while the GPU decodes where the values come
    straight out of the kernel), else as raw-bit arrays.  heads: as decode_guessed (each blob's
    address and length) for rows on guessed layouts; then returns (results, misses)."""
    first, k = layouts[0], len(layouts)
    same = all(layout is first for layout in layouts)  # the usual batch: spare the per-blob loops
    jobs[:, _STREAMS] += (heads[:, _HEAD_PTR:_HEAD_PTR + 1] if heads is not None
                          else np.array([b.data.ptr for b in blobs], np.uint64)[:, None])
    fmt, chunk, ns = first.fmt, first.chunk, (first.n,) * k if same else tuple(layout.n for layout in layouts)
    pair = _fused_dequantize(layouts, blobs)
    distinct = layouts[:1] if same else layouts
    views = _views(layouts, pair, origin, distinct)
    if pair is not None:  # QuantizeFP8's decode applied by kvz_decode as it stores
        jobs[:, programs.DQ_SCALE] = [b.data.ptr + layout.dequantize[2] for b, layout in zip(blobs, layouts)]
    guessed = None
    if heads is not None:
        guessed = ((first.expect,) * k if same else tuple(layout.expect for layout in layouts), heads)
        escapes = sum(_escapes_at_most(layout, int(n)) for layout, n in zip(layouts, heads[:, _HEAD_LEN]))
    else:
        escapes = int(jobs[:, _N_ESC].sum())
    got = programs.decode_jobs(fmt, chunk, ns, jobs, labels, dequantize=pair, views=views,
                                 origin=origin if views is not None else None, guessed=guessed, escapes=escapes)
    got, misses = got if guessed is not None else (got, [])
    if misses:
        got = list(got)
        for i in misses:
            got[i] = None
    if guessed is not None:  # every layout a blob was decoded on, once
        hits = distinct if not misses else [layouts[i] for i in range(k) if got[i] is not None]
        for layout in {id(layout): layout for layout in hits}.values() if len(hits) > 1 else hits:
            _note(layout)
    got = _handed_out(got, blobs, layouts, pair, views, origin)
    return (got, misses) if guessed is not None else got


_BYTES_PER_ESCAPE = 3  # its esc_pos (uint16) and esc_exp (uint8) entries


def _escapes_at_most(layout: Layout, nbytes: int) -> int:
    """A bound on the escapes of a blob of layout that is nbytes long (all its bytes past the
    fixed ones taken for escape entries), without its header: what chooses the decoder's
    instance (programs.heavy) for a guessed decode."""
    return max(0, nbytes - layout.fixed_bytes) // _BYTES_PER_ESCAPE


def _fused_dequantize(layouts: list, blobs: list) -> tuple | None:
    """(fp8, source format) when every blob is of a quantized layout of one format pair that
    quantize_kernels handles (and its scale 16-byte aligned), else None."""
    if layouts[0].dequantize is None:
        return None
    pairs = {(layout.fmt.name, layout.dequantize[1]["quantize_fp8"]["source_format"]) if layout.dequantize else None
             for layout in layouts}
    if len(pairs) != 1 or None in pairs:
        return None
    (pair,) = pairs
    stage = layouts[0].dequantize[0]
    aligned = all((b.data.ptr + layout.dequantize[2]) % 16 == 0 for b, layout in zip(blobs, layouts))
    return pair if aligned and quantize_kernels.usable(get_backend("cuda"), pair[1], pair[0], stage.granularity) else None


def _dequantized(codes, blob, layout: Layout):
    """The caller's values of a quantized layout: its QuantizeFP8 stage on the decoded codes and the
    blob's scale (the stage checks the frame and takes the fast path where it can)."""
    stage, meta, at = layout.dequantize
    scales = blob[at:at + 4].view(np.float32)
    return stage.decode(Frame(get_backend("cuda"), {"data": codes, "scales": scales}, dict(meta))).streams["data"]
