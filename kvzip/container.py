"""The kvzip container: a self-describing blob.  docs/format.md is the normative description.

    offset  size  field
    0       8     magic b"KVZIP\\x00\\r\\n"
    8       2     format version (uint16), 1
    10      2     flags (uint16): bit 0 payload checksum present, bit 1 stored raw (size fallback)
    12      4     header length H (uint32): multiple of 16, the payload starts here
    16      8     payload length P (uint64): multiple of 16; blob length is exactly H + P
    24      8     payload checksum (uint64, sum64 of the payload; 0 when flag bit 0 is clear)
    32      4     metadata length J (uint32)
    36      4     stream count S (uint32)
    40      4     header CRC-32 (zlib/ISO-HDLC) of bytes [0, H) with these 4 bytes zeroed
    44      4     reserved, 0
    48      16*S  stream table: per stream (offset from payload start uint64, length in bytes uint64)
    48+16S  J     metadata: UTF-8 JSON object {"meta": {...}, "streams": [[name, dtype], ...]}
    ...           zero padding up to H
    H       P     payload: streams in table order, each starting 16-byte aligned, zero padding between

All integers little-endian.  Parsing validates every field before anything is sliced.

That is version 1.  Blobs of the preset pipeline get the compact version-2 header instead
(docs/format.md section 13; kvzip/layout.py's COMPACT_FIELDS): 64 bytes of fixed fields that
stand for exactly the version-1 header of the same blob; parse_header turns either into the
same Header, and writers go through header_for, which picks the compact one when it holds the
blob exactly.
The layout itself (field offsets, alignment, stream order, the escape streams' arithmetic) is
kvzip/layout.py's; the names below are re-exported from there.
"""
from __future__ import annotations

import dataclasses
import json
import re
import threading
from dataclasses import dataclass

import numpy as np

from . import layout as _layout
from .checksum import sum64, sum64_finish, sum64_start
from .errors import FormatError
from .layout import (ALIGN, FLAG_CHECKSUM, FLAG_STORED, KNOWN_FLAGS, MAGIC, MAX_HEADER,  # noqa: F401 (re-exported)
                     MAX_STREAMS, PREFIX, STREAM_ORDER, VERSION, canonical_order)

STREAM_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "float32": np.float32}
# dtype -> its name in the stream table (numpy's dtype.name is a slow property: ~1 us a call)
STREAM_DTYPE_NAMES = {np.dtype(t): name for name, t in STREAM_DTYPES.items()}


_align = _layout.align
layout = _layout.place  # payload offsets for streams of the given byte lengths, and the payload length


@dataclass
class Header:
    flags: int
    header_len: int
    payload_len: int
    checksum: int
    meta: dict
    streams: list  # [(name, dtype, offset, length)]


def build_header(meta: dict, streams: list[tuple[str, str, int]], flags: int, checksum: int = 0) -> bytes:
    """Header bytes for streams [(name, dtype name, nbytes)] laid out by layout()."""
    offsets, payload_len = layout([nb for _, _, nb in streams])
    doc = {"meta": meta, "streams": [[name, dt] for name, dt, _ in streams]}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")
    table = b"".join(_layout.ENTRY.pack(off, nb) for off, (_, _, nb) in zip(offsets, streams))
    header_len = _align(_layout.TABLE_AT + len(table) + len(text))
    if header_len > MAX_HEADER:
        raise ValueError(f"header of {header_len} bytes exceeds the {MAX_HEADER}-byte limit")
    prefix = PREFIX.pack(MAGIC, VERSION, flags, header_len, payload_len, checksum, len(text), len(streams), 0)
    raw = bytearray(prefix + table + text + bytes(header_len - PREFIX.size - len(table) - len(text)))
    _layout.seal(raw)
    return bytes(raw)


def header_for(meta: dict, streams: list[tuple[str, str, int]], flags: int, checksum: int = 0) -> bytes:
    """The header a writer writes: the compact one (version 2) when it holds this blob exactly,
    else build_header's (version 1)."""
    compact = compact_header(meta, streams, flags, checksum)
    return compact if compact is not None else build_header(meta, streams, flags, checksum)


_FORMAT_OF_CODE = {code: name for name, code in _layout.DTYPE_CODES.items()}
_SOURCE_CODE = {name: code for code, name in enumerate(_layout.CODEBOOK_SOURCES)}
_COMPACT_CODEBOOK = _layout.COMPACT_FIELD["codebook"]


def compact_header(meta: dict, streams: list[tuple[str, str, int]], flags: int, checksum: int = 0) -> bytes | None:
    """The compact header of a blob with this metadata and these streams [(name, dtype name,
    nbytes)]: version 3 for the ratio mode's (ChannelPack then Serialize), version 4 for the
    storage mode's (ChannelRans then Serialize), version 2 for the
    others; or None where neither holds them exactly: a pipeline other than the preset ones (or
    their stored-raw fallback), a codebook name other than the shipped default's, n >= 2**32, a
    shape whose LEB128 takes more than 8 bytes.  Exactly: a reader's metadata and streams of it
    are these (compared here), so choosing it loses nothing."""
    fmt = _format_name(meta.get("dtype"))
    shape = meta.get("shape")
    if fmt is None or type(shape) is not list or len(shape) > 255 or meta.get("format") != fmt \
            or not all(type(d) is int and d >= 0 for d in shape) or not isinstance(meta.get("n"), int) \
            or not 0 <= meta["n"] < _layout.COMPACT_MAX_N:
        return None
    sides = _layout.leb128(shape)
    if len(sides) > _layout.COMPACT_SHAPE_BYTES:
        return None
    names = {name: nb for name, _, nb in streams}
    pipeline = meta.get("pipeline")
    first = pipeline[0].get("id") if type(pipeline) is list and len(pipeline) == 2 and type(pipeline[0]) is dict \
        else None
    if not flags & FLAG_STORED and first in ("channel_pack", "channel_rans"):
        chunk_log2 = _chunk_log2(pipeline[0])
        # Versions 3 and 4 share one layout; three counts give the variable streams' lengths.
        version, counts = ((_layout.RATIO_VERSION, (names.get("esc_exp", 0), names.get("exp_high", 0),
                                                    names.get("sec_codes", 0))) if first == "channel_pack" else
                           (_layout.STORAGE_VERSION, (names.get("esc_exp", 0), names.get("words", 0) // 2,
                                                      names.get("tables", 0))))
        head = None if chunk_log2 is None else _layout.RATIO.pack(
            MAGIC, version, flags, _layout.COMPACT_SIZE, sides, checksum, counts[0], counts[1], 0,
            _layout.DTYPE_CODES[fmt], chunk_log2, len(shape), 0, counts[2], bytes(_layout.RATIO_FIELD["tail"].size))
    else:
        head = _preset_head(meta, fmt, sides, len(shape), names, flags, checksum)
    if head is None:
        return None
    head = bytearray(head)
    _layout.seal(head)
    try:
        hdr = _parse_compact(bytes(head), _layout.COMPACT_SIZE + layout([nb for _, _, nb in streams])[1])
    except FormatError:
        return None
    if hdr.meta != meta or [s[:2] + (s[3],) for s in hdr.streams] != [tuple(s) for s in streams]:
        return None
    return bytes(head)


def ratio_streams(n: int, fmt, channels: int, chunk: int, escapes: int = 0, high_bytes: int = 0,
                  second_bytes: int = 0) -> list[tuple[str, str, int]]:
    """The ratio mode's streams [(name, dtype name, nbytes)] in payload order (docs/format.md
    15.4) for n values of fmt in chunks of chunk, with these escapes, exp_high and sec_codes
    bytes: what a version-3 header stands for."""
    from .bitpack import groups
    from .channel_codebook import CODE_BITS, TABLE_WIDTH

    G, nchunks = groups(n), -(-n // chunk)
    sizes = (CODE_BITS * G, fmt.rest_bits * G, 2 * nchunks, _layout.ESC_POS_BYTES * escapes, escapes, high_bytes,
             second_bytes, 2 * nchunks, TABLE_WIDTH * channels)
    return [(name, dt, nb) for (name, dt), nb in zip(_layout.RATIO_STREAMS, sizes)]


def with_counts(head: bytes, escapes: int, high_bytes: int, second_bytes: int = 0, checksum: int = 0) -> bytes:
    """A version-2 or version-3 header (compact_header's for a tensor) with its counts and payload
    checksum set and the CRC sealed again: the header of the same tensor's blob with those
    streams' lengths (the counts are all a compact header says of them; second_bytes: version
    3's sec_codes bytes)."""
    raw = bytearray(head)
    fields = [("escapes", escapes), ("high_bytes", high_bytes), ("checksum", checksum), ("header_crc", 0)]
    version = _layout.version_of(head)
    if version == _layout.RATIO_VERSION:
        fields.append(("second_bytes", second_bytes))
    elif version != _layout.COMPACT_VERSION or second_bytes:
        raise ValueError(f"with_counts takes a version-2 or version-3 header, not version {version}")
    for name, value in fields:
        f = _layout.RATIO_FIELD[name]  # the fields version 2 has too sit where version 3 has them
        raw[f.offset:f.offset + f.size] = value.to_bytes(f.size, "little")
    _layout.seal(raw)
    return bytes(raw)


def _chunk_log2(config: dict) -> int | None:
    """log2 of a stage config's chunk, or None where it is not a power of two."""
    chunk = config.get("chunk")
    if type(chunk) is not int or chunk <= 0 or chunk & (chunk - 1):
        return None
    return chunk.bit_length() - 1


def _preset_head(meta: dict, fmt: str, sides: bytes, ndim: int, names: dict, flags: int, checksum: int) -> bytes | None:
    """compact_header's version-2 fields (the CRC still 0), or None where they cannot hold meta."""
    chunk_log2 = source = 0
    exponents = bytes(16)
    if not flags & FLAG_STORED:
        pipeline, codebook = meta.get("pipeline"), meta.get("codebook")
        if not (type(pipeline) is list and len(pipeline) == 4 and type(pipeline[2]) is dict
                and type(codebook) is dict):
            return None
        chunk_log2 = _chunk_log2(pipeline[2])
        if chunk_log2 is None:
            return None
        given = pipeline[1].get("codebook") if type(pipeline[1]) is dict else None
        source = _SOURCE_CODE["default" if given is None else "auto" if given == "auto" else
                              "named" if codebook.get("name") else "given"]
        try:
            exponents = bytes(codebook.get("exponents"))
        except (TypeError, ValueError):
            return None
        if len(exponents) != 16:
            return None
    return _layout.COMPACT.pack(MAGIC, _layout.COMPACT_VERSION, flags, _layout.COMPACT_SIZE, sides, checksum,
                                names.get("esc_exp", 0), names.get("exp_high", 0), 0, _layout.DTYPE_CODES[fmt],
                                chunk_log2, ndim, source, exponents)


def _format_name(dtype) -> str | None:
    """The short format name of a dtype name the compact header can hold, else None."""
    from .formats import BY_DTYPE_NAME

    fmt = BY_DTYPE_NAME.get(dtype) if type(dtype) is str else None
    return fmt.name if fmt is not None and fmt.name in _layout.DTYPE_CODES else None


def _parse_compact(head: bytes, blob_len: int | None) -> Header:
    """A compact header, version 2 (docs/format.md section 13), 3 (section 15.6) or 4 (16.5), as the Header
    a version-1 one parses to: the metadata and stream table it stands for.  blob_len None: the
    blob is as long as its header's streams say (claimed_length)."""
    from .bitpack import groups
    from .channel_codebook import channels_of
    from .formats import FORMATS

    (_, _, flags, header_len, sides, checksum, escapes, high_bytes, _, dtype, chunk_log2, ndim, source,
     exponents) = _layout.COMPACT.unpack_from(head)
    version = _layout.version_of(head)
    if header_len != _layout.COMPACT_SIZE or (blob_len is not None and blob_len < header_len):
        raise FormatError(f"bad header length {header_len} for a version-{version} blob of {blob_len} bytes")
    payload_len = blob_len - header_len if blob_len is not None else None
    if payload_len is not None and payload_len % ALIGN:
        raise FormatError(f"payload of {payload_len} bytes is not a multiple of {ALIGN}")
    _check_sums(head, header_len, flags, checksum)
    fmt_name = _FORMAT_OF_CODE.get(dtype)
    if fmt_name is None:
        raise FormatError(f"unknown dtype code {dtype}")
    fmt = FORMATS[fmt_name]
    read = _layout.unleb128(sides, ndim)
    if read is None or any(sides[read[1]:]):
        raise FormatError("bad shape field (not ndim shortest LEB128 numbers followed by zeros)")
    shape = list(read[0])
    n = 1
    for d in shape:
        n *= d
    if n >= _layout.COMPACT_MAX_N:
        raise FormatError(f"shape {shape} holds {n} values; a version-{version} header holds fewer than 2**32")
    meta = {"dtype": fmt.dtype_name, "shape": shape, "n": n, "format": fmt_name}
    serialize = {"id": "serialize", "checksum": bool(flags & FLAG_CHECKSUM)}
    G = groups(n)
    if version == _layout.STORAGE_VERSION:
        from .stages.channel_rans import LANES, MAX_CHUNK, MIN_CHUNK

        table_bytes, tail = _layout.STORAGE.unpack_from(head)[-2:]
        if flags & FLAG_STORED or source or any(tail):
            raise FormatError("a version-4 header has the stored-raw flag or a reserved byte set")
        if not MIN_CHUNK <= 1 << chunk_log2 <= MAX_CHUNK:
            raise FormatError(f"bad chunk (2**{chunk_log2}) for the storage mode")
        meta["pipeline"] = [{"id": "channel_rans", "chunk": 1 << chunk_log2}, serialize]
        nchunks = -(-n // (1 << chunk_log2))
        sizes = (fmt.rest_bits * G, 4 * nchunks, escapes, 4 * LANES * nchunks, table_bytes, 4 * nchunks, 2 * high_bytes)
        table = [(name, dt, nb) for (name, dt), nb in zip(_layout.STORAGE_STREAMS, sizes)]
    elif version == _layout.RATIO_VERSION:
        second_bytes, tail = _layout.RATIO.unpack_from(head)[-2:]
        if flags & FLAG_STORED or source or any(tail):
            raise FormatError("a version-3 header has the stored-raw flag or a reserved byte set")
        if not 3 <= chunk_log2 <= 15:
            raise FormatError(f"bad chunk (2**{chunk_log2}) for the ratio mode")
        meta["pipeline"] = [{"id": "channel_pack", "chunk": 1 << chunk_log2}, serialize]
        table = ratio_streams(n, fmt, channels_of(shape), 1 << chunk_log2, escapes, high_bytes, second_bytes)
    elif flags & FLAG_STORED:
        if chunk_log2 or escapes or high_bytes or source or any(exponents):
            raise FormatError("a stored-raw version-2 header has chunk, escape, codebook fields set")
        meta["pipeline"] = [serialize]
        table = [("data", STREAM_DTYPE_NAMES[np.dtype(fmt.uint_dtype)], n * fmt.itemsize)]
    else:
        if not 3 <= chunk_log2 <= 16 or source >= len(_layout.CODEBOOK_SOURCES):
            raise FormatError(f"bad chunk (2**{chunk_log2}) or codebook source ({source})")
        kind = _layout.CODEBOOK_SOURCES[source]
        codebook = {"name": None if kind in ("given", "auto") else f"{fmt_name}-kv", "format": fmt_name,
                    "exponents": list(exponents)}
        recorded = {"default": None, "auto": "auto"}.get(kind, codebook)
        meta["pipeline"] = [{"id": "exponent_split"},
                            {"id": "top16_pack", "codebook": dict(recorded) if recorded is codebook else recorded},
                            {"id": "escape_stream", "chunk": 1 << chunk_log2}, serialize]
        meta["codebook"] = codebook
        sizes = (4 * G, fmt.rest_bits * G, 2 * -(-n // (1 << chunk_log2)), _layout.ESC_POS_BYTES * escapes, escapes,
                 high_bytes)
        table = [(name, dt, nb) for (name, dt), nb in zip(_layout.FUSED_STREAMS, sizes)]
    offsets, need = layout([nb for _, _, nb in table])
    if payload_len is None:
        payload_len = need
    if need != payload_len:
        raise FormatError(f"payload of {payload_len} bytes; the header's streams take {need}")
    return Header(flags, header_len, payload_len, checksum, meta,
                  [(name, dt, off, nb) for (name, dt, nb), off in zip(table, offsets)])


def _check_sums(head: bytes, header_len: int, flags: int, checksum: int) -> bytearray:
    """The header's CRC and the checksum field's flag, as every version has them; returns the
    header bytes with the CRC field zeroed."""
    raw = bytearray(head[:header_len])
    stored, crc = _layout.crc_blanked(raw)
    if crc != stored:
        raise FormatError("header checksum mismatch (corrupted header)")
    if not flags & FLAG_CHECKSUM and checksum:
        raise FormatError("payload checksum set without its flag")
    return raw


# The metadata JSON's nesting depth limit.  A writer's deepest value is a codebook's exponent list
# inside a stage config inside meta.pipeline (depth 6); the limit keeps every later step (parsing,
# copying, repr) far from Python's recursion limit however deep the caller's own stack is.
MAX_JSON_DEPTH = 32
# Strings of a JSON text, escapes included (the unrolled form: a run of plain bytes is one step),
# which json_depth skips to count only structure; and every byte that is not a bracket.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(text: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, counted without recursion.

    For valid JSON this is exact: outside strings no '"' occurs, so each match of _JSON_STRING
    is one whole string.  For invalid JSON it is exact up to the point where a parser stops
    (a parser reads a string to the same closing quote), which is all a limit checked before
    parsing needs."""
    brackets = _JSON_STRING.sub(b"", text).translate(None, _NOT_BRACKETS)
    if len(brackets) <= 4096:  # a writer's metadata: a few dozen brackets
        return _depth_of(brackets)
    return int(np.cumsum(_STEP[np.frombuffer(brackets, np.uint8)], dtype=np.int64).max(initial=0))


def _depth_of(brackets: bytes) -> int:
    depth = deepest = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    """A JSON object's dict; duplicate keys are refused (RFC 8259 leaves their meaning open, so
    two decoders could read one blob differently)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _DuplicateKey(f"duplicate key {dup[:80]!r}")
    return d


def _parse_metadata(text: bytes):
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise FormatError(f"metadata JSON nests {depth} deep; the limit is {MAX_JSON_DEPTH}")
    try:
        return json.loads(text.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"metadata is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None


# Headers of blobs that decoded, by their bytes and the blob's length (a serving loop decodes the
# same few shapes; parsing and checking one costs ~25 us).  Only remember_header adds to it, after
# a whole blob has passed every check, so a stream of rejected blobs leaves nothing behind; and it
# holds at most CACHE_BYTES of header bytes, none over CACHE_HEADER_MAX (a writer's header is ~1 KB).
_parsed: dict = {}
_parsed_bytes = 0
CACHE_BYTES = 4 << 20
CACHE_HEADER_MAX = 16 << 10
_parsed_lock = threading.Lock()
_HEADER_LEN = _layout.HEADER_LEN


def _cache_key(head: bytes, blob_len: int):
    if len(head) < PREFIX.size:
        return None
    header_len = _HEADER_LEN.read(head)
    if header_len > CACHE_HEADER_MAX or len(head) < header_len:
        return None
    return bytes(head[:header_len]), blob_len


def parse_header(head: bytes, blob_len: int) -> Header:
    """Validate and decode a header.  ``head`` holds at least the first H bytes (or the whole
    blob if shorter); ``blob_len`` is the blob's full length.

    A header remember_header was given comes from the cache: the same bytes parse to the same
    Header, so the cache changes no answer.  Each caller gets its own top-level meta dict, which
    is all the decoders change."""
    key = _cache_key(head, blob_len)
    hit = _parsed.get(key) if key is not None else None
    hdr = hit if hit is not None else _parse_header(head, blob_len)
    return dataclasses.replace(hdr, meta=dict(hdr.meta))


def claimed_length(head: bytes) -> int:
    """The length of the blob whose header starts head (its first bytes: at least the header),
    as the header says: what decompress_into reads of a buffer holding a blob at its start.
    FormatError where head is no valid header."""
    if len(head) < PREFIX.size:
        raise FormatError(f"{len(head)} bytes are too short to hold a kvzip header")
    magic, version, _, header_len, payload_len = PREFIX.unpack_from(head)[:5]
    if magic == MAGIC and version in _layout.COMPACT_VERSIONS and len(head) >= _layout.COMPACT_SIZE:
        hdr = _parse_compact(head, None)
        return hdr.header_len + hdr.payload_len
    length = header_len + payload_len
    parse_header(head, length)  # every check of a version-1 header (or the error a bad one gets)
    return length


def remember_header(head: bytes, blob_len: int, hdr: Header) -> None:
    """Cache hdr, parse_header's answer for head, once its whole blob has decoded."""
    global _parsed_bytes
    key = _cache_key(head, blob_len)
    if key is None:
        return
    with _parsed_lock:  # decodes on several threads: _parsed and _parsed_bytes change together
        if key in _parsed:
            return
        while _parsed and _parsed_bytes + len(key[0]) > CACHE_BYTES:  # the oldest go first
            oldest = next(iter(_parsed))
            del _parsed[oldest]
            _parsed_bytes -= len(oldest[0])
        # Decoders change only their own copy of meta's top level (frame_from_header copies it).
        _parsed[key] = dataclasses.replace(hdr, meta=dict(hdr.meta))
        _parsed_bytes += len(key[0])


def _parse_header(head: bytes, blob_len: int) -> Header:
    if blob_len < PREFIX.size or len(head) < PREFIX.size:
        raise FormatError(f"blob of {blob_len} bytes is too short to be a kvzip container")
    magic, version, flags, header_len, payload_len, checksum, meta_len, nstreams, _ = PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise FormatError("not a kvzip blob (bad magic)")
    if version != VERSION and version not in _layout.COMPACT_VERSIONS:
        raise FormatError(f"unsupported container version {version} (this kvzip reads versions {VERSION} and "
                          f"{', '.join(map(str, _layout.COMPACT_VERSIONS))})")
    if flags & ~KNOWN_FLAGS:
        raise FormatError(f"unknown flags 0x{flags:04x}")
    if version != VERSION:  # the compact headers, 64 bytes
        if len(head) < _layout.COMPACT_SIZE or blob_len < _layout.COMPACT_SIZE:
            raise FormatError(f"blob of {blob_len} bytes is too short for a version-{version} header")
        return _parse_compact(head, blob_len)
    if not _layout.header_fits(header_len, blob_len):
        raise FormatError(f"bad header length {header_len} for a blob of {blob_len} bytes")
    if len(head) < header_len:
        raise FormatError("header truncated")
    if not _layout.payload_fits(header_len, payload_len, blob_len):
        raise FormatError(f"payload length {payload_len} does not match the blob ({blob_len} - {header_len} bytes)")
    if not _layout.table_fits(nstreams, meta_len, header_len):
        raise FormatError(f"stream count {nstreams} / metadata length {meta_len} do not fit the header")
    raw = _check_sums(head, header_len, flags, checksum)
    text_at = _layout.entry_at(nstreams)
    doc = _parse_metadata(bytes(raw[text_at:text_at + meta_len]))
    if not (isinstance(doc, dict) and isinstance(doc.get("meta"), dict)
            and isinstance(doc.get("streams"), list) and len(doc["streams"]) == nstreams):
        raise FormatError("metadata lacks meta / streams, or lists the wrong number of streams")
    streams, end = [], 0
    for k, entry in enumerate(doc["streams"]):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[1] in STREAM_DTYPES):
            raise FormatError(f"stream entry {entry!r} is not [name, dtype]")
        off, nb = _layout.ENTRY.unpack_from(raw, _layout.entry_at(k))
        itemsize = np.dtype(STREAM_DTYPES[entry[1]]).itemsize
        if off % ALIGN or off < end or off + nb > payload_len or nb % itemsize:
            raise FormatError(f"stream {entry[0]!r}: offset {off} / length {nb} are out of bounds or misaligned")
        end = off + nb
        streams.append((entry[0], entry[1], off, nb))
    if len({s[0] for s in streams}) != len(streams):
        raise FormatError("duplicate stream names")
    return Header(flags, header_len, payload_len, checksum, doc["meta"], streams)


def assemble(backend, header: bytes, arrays: list, payload_len: int, offsets: list[int]):
    """One uint8 blob on the backend: header then each stream at its offset (zero padding)."""
    xp = backend.xp
    blob = backend.zeros(len(header) + payload_len, np.uint8)
    blob[: len(header)] = backend.from_numpy(np.frombuffer(header, np.uint8))
    base = len(header)
    for off, a in zip(offsets, arrays):
        flat = a.reshape(-1).view(xp.uint8)
        blob[base + off: base + off + flat.shape[0]] = flat
    return blob


def first_bytes(backend, u8, nbytes: int) -> bytes:
    """The first nbytes of a 1-D uint8 array on backend, as bytes (from a GPU: one read-back)."""
    if backend.name == "cuda":
        return backend.read_bytes(u8, nbytes)
    return backend.to_numpy(u8[:nbytes]).tobytes()


def read_head(backend, blob) -> bytes:
    """The header bytes of a blob on any backend, fetching no more than needed from a GPU."""
    want = min(blob.shape[0], 4096)
    head = first_bytes(backend, blob, want)
    if len(head) >= PREFIX.size:
        header_len = _HEADER_LEN.read(head)
        if want < header_len <= min(MAX_HEADER, blob.shape[0]):
            head = first_bytes(backend, blob, header_len)
    return head


def stream_views(backend, blob, hdr: Header) -> dict:
    """Zero-copy typed views of each stream inside the blob."""
    out = {}
    if backend.name == "cuda" and not getattr(backend, "simulated", True):
        # One constructor call per stream instead of a slice and a view (each costs microseconds).
        cupy = backend.xp
        for name, dt, off, nb in hdr.streams:
            dtype = np.dtype(STREAM_DTYPES[dt])
            out[name] = cupy.ndarray((nb // dtype.itemsize,), dtype, blob.data + (hdr.header_len + off))
        return out
    for name, dt, off, nb in hdr.streams:
        start = hdr.header_len + off
        out[name] = blob[start:start + nb].view(STREAM_DTYPES[dt])
    return out


PAYLOAD_MISMATCH = "payload checksum mismatch (corrupted payload)"


def verify_payload(backend, blob, hdr: Header) -> None:
    if hdr.flags & FLAG_CHECKSUM:
        got = sum64(backend.xp, blob[hdr.header_len:])
        if got != hdr.checksum:
            raise FormatError(PAYLOAD_MISMATCH)


class PayloadCheck:
    """A CPU blob's payload checksum, verified later than verify_payload would: the CPU fused
    decode sums the words as it decodes them (stages/fused_cpu.py) and hands the sum to
    ``finish``; whoever else ends up with it calls ``verify``, which sums the payload itself.
    The caller (kvzip/staged.py) verifies before anything reads the payload but that decode,
    and before any error is raised, so the checksum error wins as with verify_payload."""

    __slots__ = ("payload", "hdr", "done")

    def __init__(self, blob, hdr: Header):
        self.payload, self.hdr, self.done = blob[hdr.header_len:], hdr, False

    def words(self):
        """The payload as uint64 words (its length is a multiple of 16)."""
        return self.payload.view(np.uint64)

    def stream_at(self, name: str) -> int:
        """Byte offset of a stream in the payload."""
        return next(off for k, _, off, _ in self.hdr.streams if k == name)

    def finish(self, inner) -> None:
        """Compare sum64's inner sum, taken by the caller over every payload word, with the header's."""
        self.done = True
        if sum64_finish(inner, self.payload.shape[0]) != self.hdr.checksum:
            raise FormatError(PAYLOAD_MISMATCH)

    def verify(self) -> None:
        """Sum the payload here, unless that was done already."""
        if not self.done:
            self.finish(sum64_start(np, self.payload))
