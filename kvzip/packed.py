"""The packed container: many kvzip blobs as one buffer with one header (docs/format.md section 14
is the normative text of these bytes).

    offset    size  field
    0         8     magic b"KVZPACK\\n" (a blob's is b"KVZIP\\x00\\r\\n": the two never mix up)
    8         2     version (uint16): 2 (version 1 is still read)
    10        2     flags (uint16) = 0; a reader rejects any set bit
    12        4     K, member count (uint32); 0 allowed
    16        4     H, header length (uint32) = align(32 + E*K), E = 4 (version 2) or 16 (version 1)
    20        4     header_crc (uint32): CRC-32 of [0, H) with these 4 bytes zeroed
    24        8     L, total length (uint64): the container's length
    32        E*K   member table: version 2, each member's length / 16 (uint32); version 1, each
                    member's (offset from the container's start, length), uint64 each
    32+E*K          zero padding up to H
    H               the members in table order, back to back

All integers little-endian.  Member k sits at offset_0 = H, offset_{k+1} = offset_k + length_k
(every length is a multiple of ALIGN, as a blob's always is), and the last ends at L.  Version 2
stores only what the layout leaves open, the lengths, so a page of 16 tokens pays 4 bytes of
table, not 16; version 1 is written only for a member of 2^36 bytes or more.

pack() builds the header on the host and copies the members into one buffer of their framework
and device (on a GPU device to device, never through the host); unpack() checks the whole header
before it hands out any view, and the views are slices of the container, no copy.  Members are
not checked here: each is a full kvzip blob, validated by whatever decodes it.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from . import arrays
from .backends import get_backend
from .container import first_bytes
from .errors import FormatError
from .layout import ALIGN, MAGIC as BLOB_MAGIC, align, consecutive_fields

__all__ = ["pack", "unpack", "is_packed", "parse_table", "PACK_MAGIC", "PACK_VERSION"]

PACK_MAGIC = b"KVZPACK\n"
PACK_VERSION = 2    # what pack() writes (version 1 for a member of 2^36 bytes or more)
PACK_FLAGS = 0      # no flag is defined: a reader rejects any set bit


PACK_FIELDS = consecutive_fields((
    ("magic", 8, "8s"),
    ("version", 2, "H"),
    ("flags", 2, "H"),
    ("count", 4, "I"),
    ("header_len", 4, "I"),
    ("header_crc", 4, "I"),
    ("total_len", 8, "Q"),
))
PACK_FIELD = {f.name: f for f in PACK_FIELDS}
PACK_PREFIX = struct.Struct("<" + "".join(f.code for f in PACK_FIELDS))  # "<8sHHIIIQ", 32 bytes
PACK_PREFIX_SIZE = PACK_PREFIX.size
PACK_TABLE_AT = PACK_PREFIX_SIZE      # the member table follows the prefix
PACK_ENTRY = struct.Struct("<QQ")     # version 1: a member's (offset from the container's start, length)
PACK_ENTRY_SIZE = PACK_ENTRY.size
ENTRY_SIZES = {1: PACK_ENTRY_SIZE, 2: 4}  # a table entry's bytes by version (2: uint32 length / ALIGN)
MAX_UNITS = (1 << 32) - 1             # version 2's largest length, in ALIGN units
_CRC = PACK_FIELD["header_crc"]
_COUNT = PACK_FIELD["count"]
_VERSION = PACK_FIELD["version"]
# The header bytes a reader fetches first from a GPU: the whole header of up to 254 members, so
# a usual container costs one read-back (a longer header, a second one of exactly H bytes).
READ_AHEAD = 4096
_MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice

assert PACK_PREFIX_SIZE == 32 and PACK_PREFIX_SIZE % ALIGN == 0 and PACK_ENTRY_SIZE == ALIGN
assert PACK_MAGIC != BLOB_MAGIC and len(PACK_MAGIC) == len(BLOB_MAGIC)


def header_len(count: int, version: int = PACK_VERSION) -> int:
    """H of a container of count members: the prefix and the table, padded to ALIGN."""
    return align(PACK_TABLE_AT + ENTRY_SIZES[version] * count)


# ----------------------------------------------------------------------------- writing
def pack(blobs):
    """kvzip blobs (a list or tuple; any mix of container versions) as one packed container.

    The blobs must all be of one framework and device (bytes-likes and NumPy arrays on the CPU
    count as one: NumPy), each a 1-D uint8 array or bytes-like of a multiple of 16 bytes.
    Returns a 1-D uint8 array of that framework on that device (NumPy for an empty list: there is
    no blob to take a framework from).  On a GPU it is ordered on the caller's current stream,
    the members copied device to device; only the header (32 + 4 bytes a member) is built on the
    host.  The members are not decoded or checked here: decoding them does that."""
    members, origin = _import_members(blobs)
    lengths = [int(m.shape[0]) for m in members]
    head, total = _header(lengths)
    if origin.device != "cuda":
        out = np.empty(total, np.uint8)
        out[:len(head)] = np.frombuffer(head, np.uint8)
        if members:
            np.concatenate(members, out=out[len(head):])
        return origin.export_bytes(out)
    cuda = get_backend("cuda").xp.cuda
    with origin.stream_context():  # the caller's device and stream: ordered after the writers of the blobs
        buffer = origin.results(total)   # memory of the caller's framework (torch's allocator for torch)
        stream = cuda.get_current_stream()
        # The one host-to-device copy, in stream order (the memory may be torch's, freed by work
        # still queued there); from pageable memory, so CUDA has staged it when set() returns.
        buffer.array[:len(head)].set(np.frombuffer(head, np.uint8), stream=stream)
        at = len(head)
        for m, n in zip(members, lengths):
            if n:
                cuda.runtime.memcpyAsync(buffer.ptr + at, m.data.ptr, n, _MEMCPY_DEVICE_TO_DEVICE, stream.ptr)
            at += n
        return buffer.blobs([0], [total])[0]


def _import_members(blobs) -> tuple[list, arrays.Origin]:
    """The blobs as 1-D uint8 NumPy or CuPy arrays and their one origin; TypeError / ValueError
    naming the first member that does not fit, before any copy."""
    if not isinstance(blobs, (list, tuple)):
        raise TypeError(f"kvzip.pack takes a list of blobs, got {type(blobs).__name__}")
    try:
        imported = arrays.import_blobs(blobs)
    except TypeError:
        for k, b in enumerate(blobs):  # the failing one, to name it
            try:
                arrays.import_bytes(b)
            except TypeError as e:
                raise TypeError(f"kvzip.pack: member {k}: {e}") from None
        raise
    if not imported:
        return [], arrays.Origin("numpy")
    first = imported[0][1]
    for k, (u8, origin) in enumerate(imported):
        if origin != first:
            what = f"member {k} is a {_where(origin)} array and member 0 a {_where(first)} one: " \
                   "kvzip.pack takes blobs of one framework on one device"
            raise (TypeError if origin.framework != first.framework else ValueError)(what)
        if u8.shape[0] % ALIGN:
            raise ValueError(f"kvzip.pack: member {k} is {u8.shape[0]} bytes, not a multiple of {ALIGN}: "
                             "not a kvzip blob")
    return [u8 for u8, _ in imported], first


def _where(origin: arrays.Origin) -> str:
    device = origin.device if origin.device_index is None else f"{origin.device}:{origin.device_index}"
    return f"{origin.framework} ({device})"


def _header(lengths: list[int]) -> tuple[bytearray, int]:
    """The header of members of these lengths (section 14's layout rule) and the total length."""
    count = len(lengths)
    if count >= 1 << 32:
        raise ValueError(f"kvzip.pack: {count} members; a packed container holds fewer than 2**32")
    version = 2 if max(lengths, default=0) // ALIGN <= MAX_UNITS else 1
    H = header_len(count, version)
    ends = np.cumsum(np.asarray(lengths, np.uint64), dtype=np.uint64) + np.uint64(H)
    if version == 2:
        table = np.asarray(lengths, np.uint64) // np.uint64(ALIGN)
        table = table.astype("<u4")
    else:
        table = np.empty((count, 2), "<u8")
        table[:, 1] = lengths
        table[:1, 0] = H
        table[1:, 0] = ends[:-1]    # offset_{k+1} = offset_k + length_k (lengths are ALIGN multiples)
    total = int(ends[-1]) if count else H
    head = bytearray(H)
    PACK_PREFIX.pack_into(head, 0, PACK_MAGIC, version, PACK_FLAGS, count, H, 0, total)
    head[PACK_TABLE_AT:PACK_TABLE_AT + table.nbytes] = table.tobytes()
    struct.pack_into("<I", head, _CRC.offset, zlib.crc32(head))  # the CRC field is zero while it is computed
    return head, total


# ----------------------------------------------------------------------------- reading
def unpack(packed) -> list:
    """The member blobs of a packed container, in order, as zero-copy views: 1-D uint8 arrays of
    the container's framework (NumPy for a bytes-like, which the views are read-only views of;
    JAX, which has no views, gets arrays that may be copies).  The whole header is checked first
    (docs/format.md 14.2); kvzip.FormatError if it is malformed.  On a GPU this reads the header
    back (one synchronisation on the caller's stream)."""
    u8, origin = arrays.import_bytes(packed)
    spans = read_table(u8, origin)
    views = [u8[at:at + n] for at, n in spans]
    if origin.framework in ("numpy", "cupy"):
        return views
    if origin.framework == "torch" and packed.is_contiguous():
        return [packed.narrow(0, at, n) for at, n in spans]  # torch's own views, no DLPack round
    return [origin.export_bytes(v) for v in views]


def read_table(u8, origin: arrays.Origin) -> list[tuple[int, int]]:
    """The checked (offset, length) of each member of the container u8 (import_bytes's array)."""
    with origin.stream_context():
        be = get_backend(origin.backend_name)
        total = int(u8.shape[0])
        head = first_bytes(be, u8, min(total, READ_AHEAD))
        if len(head) >= PACK_PREFIX_SIZE and head[:len(PACK_MAGIC)] == PACK_MAGIC:
            version = _VERSION.read(head)
            want = header_len(_COUNT.read(head), version) if version in ENTRY_SIZES else 0
            if len(head) < want <= total:
                head = first_bytes(be, u8, want)
        return parse_table(head, total)


def is_packed(blob) -> bool:
    """Whether blob (anything import_bytes takes) starts with the packed container's magic.  On a
    GPU this reads 8 bytes back: the callers ask it only once decoding has failed."""
    u8, origin = arrays.import_bytes(blob)
    if u8.shape[0] < len(PACK_MAGIC):
        return False
    with origin.stream_context():
        return first_bytes(get_backend(origin.backend_name), u8, len(PACK_MAGIC)) == PACK_MAGIC


def parse_table(head: bytes, total_len: int) -> list[tuple[int, int]]:
    """Check a packed container's header (docs/format.md 14.2, in that order) and return each
    member's (offset, length).  head holds at least the container's first H bytes (or all of it
    when shorter); total_len is the container's length.  Raises FormatError naming the first
    check that fails."""
    if len(head) < len(PACK_MAGIC) or head[:len(PACK_MAGIC)] != PACK_MAGIC:
        if head[:len(BLOB_MAGIC)] == BLOB_MAGIC:
            raise FormatError("this is a kvzip blob, not a packed container: decode it with kvzip.decompress")
        raise FormatError("not a packed kvzip container (bad magic)")
    if total_len < PACK_PREFIX_SIZE or len(head) < PACK_PREFIX_SIZE:
        raise FormatError(f"packed container of {total_len} bytes is too short for its {PACK_PREFIX_SIZE}-byte prefix")
    _, version, flags, count, H, _, claimed = PACK_PREFIX.unpack_from(head)
    if version not in ENTRY_SIZES:
        raise FormatError(f"unsupported packed container version {version} (this kvzip reads versions 1 and 2)")
    if flags:
        raise FormatError(f"unknown packed container flags 0x{flags:04x}")
    if claimed != total_len:
        raise FormatError(f"packed container claims {claimed} bytes but is {total_len} (truncated or extended)")
    # K is bounded by the container's own length before anything is sized by it.
    table_end = PACK_TABLE_AT + ENTRY_SIZES[version] * count
    if table_end > total_len:
        raise FormatError(f"member count {count} does not fit a packed container of {total_len} bytes")
    if H != header_len(count, version) or H > total_len:
        raise FormatError(f"bad packed header length {H} for {count} members (it must be {header_len(count, version)})")
    if len(head) < H:
        raise FormatError("packed container header truncated")
    raw = bytearray(head[:H])
    stored = _CRC.read(raw)
    raw[_CRC.span] = bytes(_CRC.size)
    if zlib.crc32(raw) != stored:
        raise FormatError("packed container header CRC mismatch (corrupted header)")
    if any(raw[table_end:H]):
        raise FormatError("packed container header padding is not zero")
    if version == 1:
        return _spans(np.frombuffer(raw, "<u8", 2 * count, PACK_TABLE_AT).reshape(count, 2), H, total_len)
    lengths = np.frombuffer(raw, "<u4", count, PACK_TABLE_AT).astype(np.uint64) * np.uint64(ALIGN)
    ends = np.cumsum(lengths, dtype=np.uint64) + np.uint64(H)
    # Each length is below 2^36, but a forged table of many can carry the sum past 2^64: a
    # running end that falls is one that wrapped.
    if count > 1 and bool((ends[1:] < ends[:-1]).any()):
        raise FormatError("the packed members' lengths add up past 2**64 (a forged table)")
    end = int(ends[-1]) if count else H
    if end != total_len:
        raise FormatError(f"the packed members end at {end}, not at the container's end ({total_len})")
    starts = np.concatenate([np.array([H], np.uint64), ends[:-1]]) if count else ends
    return list(zip(starts.tolist(), lengths.tolist()))


def _spans(table: np.ndarray, H: int, total_len: int) -> list[tuple[int, int]]:
    """A version-1 table's entries once each is where the layout rule puts it: offset_0 = H, offset_{k+1}
    = offset_k + length_k, lengths ALIGN multiples, the last ending at total_len (which with the
    chain puts every member inside the container, in order, without overlap)."""
    count = table.shape[0]
    offsets, lengths = table[:, 0], table[:, 1]
    if count:
        # Every value at most total_len (< 2**63) first, so that no uint64 sum below wraps.
        inside = bool((offsets <= total_len).all() and (lengths <= total_len).all())
        ends = offsets + lengths if inside else None
        if inside and offsets[0] == H and (offsets[1:] == ends[:-1]).all() and not (lengths % ALIGN).any() \
                and ends[-1] == total_len:
            return list(zip(offsets.tolist(), lengths.tolist()))
    elif H == total_len:
        return []
    # Something is wrong: find the first entry that breaks the rule, with Python's exact integers.
    expected = H
    for k, (at, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
        if at != expected:
            raise FormatError(f"packed member {k}: offset {at} is not where the layout puts it ({expected}): "
                              "misaligned, overlapping, out of order or leaving a gap")
        if n % ALIGN:
            raise FormatError(f"packed member {k}: length {n} is not a multiple of {ALIGN}")
        if at + n > total_len:
            raise FormatError(f"packed member {k} ends at {at + n}, past the container's end ({total_len})")
        expected = at + n
    raise FormatError(f"the packed members end at {expected}, not at the container's end ({total_len})")
