"""Files for the ``kvzip`` command: what a file holds, and compressing or restoring it whole.

Kinds, told by their first bytes (never by the name):

* a kvzip blob (docs/format.md): one tensor; ``kvzip.decompress`` reads it as it is;
* ``.safetensors``: every tensor kvzip can encode (BF16, F16, F32, F8_E4M3, F8_E5M2) becomes a
  U8 tensor holding its blob; the others stay as they are.  The result is still a valid
  safetensors file (a *kvzip archive*): same tensor names, the original metadata plus
  ``kvzip.header``, the original header text, so that restoring it gives the original file byte
  for byte (same header, same data offsets);
* ``.npy``: one array -> a blob;  ``.pt``: torch.save of one tensor -> a blob, of a flat dict
  of tensors (a state dict) -> a kvzip archive as above, of the .safetensors file the dict makes
  (restored as .pt or .safetensors, as the output name asks);
* anything else is a raw blob of values, when the caller names their format.

A blob restores to the kind the output name asks for: ``.npy``, ``.pt``, or raw bytes.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import FormatError

KVZIP_MAGIC = b"KVZIP\x00\r\n"
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format
ARCHIVE_KEY = "kvzip.header"
# safetensors dtype -> kvzip format name, for the dtypes kvzip encodes
SAFETENSORS_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}
SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                        "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_SAFETENSORS_HEADER = 100 << 20


class WrongKind(ValueError):
    """The file is not of a kind this operation takes."""


@dataclass
class SafetensorsFile:
    header_text: bytes  # the JSON between the length and the data, padding included
    entries: dict       # name -> {"dtype", "shape", "data_offsets"}, in header order
    metadata: dict | None
    data: np.ndarray    # uint8 view of the data section (a memory map)


def kind_of(path: Path) -> str:
    """"kvzip", "safetensors", "npy", "pt" or "raw" (FileNotFoundError when there is no file)."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(KVZIP_MAGIC):
        return "kvzip"
    if head.startswith(NPY_MAGIC):
        return "npy"
    if head.startswith(ZIP_MAGIC):
        return "pt"
    if len(head) >= 9:
        n = struct.unpack_from("<Q", head)[0]
        if 2 <= n <= MAX_SAFETENSORS_HEADER and head[8:9] == b"{" and 8 + n <= os.path.getsize(path):
            return "safetensors"
    return "raw"


def read_safetensors(path: Path) -> SafetensorsFile:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if not 2 <= n <= min(MAX_SAFETENSORS_HEADER, size - 8):
            raise FormatError(f"{path}: bad safetensors header length {n}")
        text = f.read(n)
    try:
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: safetensors header is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    metadata = doc.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, e in doc.items():
        ok = isinstance(e, dict) and e.get("dtype") in SAFETENSORS_ITEMSIZE and isinstance(e.get("shape"), list) \
            and all(isinstance(d, int) and d >= 0 for d in e["shape"]) and isinstance(e.get("data_offsets"), list) \
            and len(e["data_offsets"]) == 2 and all(isinstance(o, int) for o in e["data_offsets"])
        if ok:
            a, b = e["data_offsets"]
            ok = 0 <= a <= b <= data_len and b - a == int(np.prod(e["shape"], dtype=object)) * SAFETENSORS_ITEMSIZE[e["dtype"]]
        if not ok:
            raise FormatError(f"{path}: bad safetensors entry for tensor {name!r}")
    data = np.memmap(path, np.uint8, "r", offset=8 + n, shape=(data_len,)) if data_len else np.zeros(0, np.uint8)
    return SafetensorsFile(text, doc, metadata, data)


def safetensors_bytes_header(entries: dict, metadata: dict | None) -> bytes:
    """The 8-byte length and the JSON header (space-padded to a multiple of 8, as the format's
    writers do, so the data starts aligned)."""
    doc = ({"__metadata__": metadata} if metadata else {}) | entries
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def is_archive(st: SafetensorsFile) -> bool:
    return isinstance(st.metadata, dict) and ARCHIVE_KEY in st.metadata


@contextmanager
def atomic_output(path: Path):
    """A binary file object writing to a temporary file next to path, renamed to path when the
    block ends without an error: an interrupted run leaves no half-written output."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_atomic(path: Path, pieces) -> int:
    """Write the byte pieces (bytes or uint8 arrays) to path (atomic_output); returns their length."""
    total = 0
    with atomic_output(path) as f:
        for piece in pieces:
            f.write(piece)
            total += len(piece) if isinstance(piece, bytes) else piece.nbytes
    return total


def safetensors_of_arrays(arrays: dict, metadata: dict | None = None) -> SafetensorsFile:
    """The .safetensors file of {name: (safetensors dtype, shape, uint8 bytes)}, in memory: the
    header written as the format's writers do, the tensors in the dict's order."""
    entries, offset = {}, 0
    for name, (dtype, shape, raw) in arrays.items():
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
    head = safetensors_bytes_header(entries, metadata)
    data = np.concatenate([raw for _, _, raw in arrays.values()]) if arrays else np.zeros(0, np.uint8)
    return SafetensorsFile(head[8:], entries, metadata, data)


# ---------------------------------------------------------------------------- safetensors archives
def compress_safetensors(st: SafetensorsFile, out: Path, compress, progress) -> dict:
    """Write the kvzip archive of st to out.  compress(bits, format) -> uint8 blob; progress(nbytes)
    after each tensor.  Returns {"tensors", "compressed", "raw_bytes", "bytes"}."""
    entries, pieces, offset = {}, [], 0
    compressed = 0
    for name, e in st.entries.items():
        a, b = e["data_offsets"]
        raw = st.data[a:b]
        fmt = SAFETENSORS_FORMATS.get(e["dtype"])
        if fmt is not None:
            item = SAFETENSORS_ITEMSIZE[e["dtype"]]
            bits = (raw.view(f"<u{item}") if item > 1 else raw).reshape(e["shape"])
            piece = np.asarray(compress(bits, fmt))
            entries[name] = {"dtype": "U8", "shape": [int(piece.nbytes)], "data_offsets": [offset, offset + piece.nbytes]}
            compressed += 1
        else:
            piece = raw
            entries[name] = {"dtype": e["dtype"], "shape": e["shape"], "data_offsets": [offset, offset + raw.nbytes]}
        pieces.append(piece)
        offset += piece.nbytes
        progress(b - a)
    metadata = dict(st.metadata or {})
    if ARCHIVE_KEY in metadata:
        raise WrongKind("it is a kvzip archive already")
    metadata[ARCHIVE_KEY] = st.header_text.decode("utf-8")
    written = write_atomic(out, [safetensors_bytes_header(entries, metadata), *pieces])
    return {"tensors": len(st.entries), "compressed": compressed, "raw_bytes": int(st.data.nbytes) + 8 + len(st.header_text),
            "bytes": written}


def archive_tensors(st: SafetensorsFile) -> dict:
    """{name: (original entry, the archive's bytes for it, whether they are a blob)} of an archive,
    checked against the original header it records."""
    try:
        original = json.loads(st.metadata[ARCHIVE_KEY])
    except (TypeError, json.JSONDecodeError) as e:
        raise FormatError(f"the archive's {ARCHIVE_KEY} is not a safetensors header ({e})") from None
    if not isinstance(original, dict):
        raise FormatError(f"the archive's {ARCHIVE_KEY} is not a safetensors header")
    original.pop("__metadata__", None)
    if list(original) != list(st.entries):
        raise FormatError("the archive's tensors are not those of the header it records")
    out = {}
    for name, e in original.items():
        mine = st.entries[name]
        a, b = mine["data_offsets"]
        blob = isinstance(e, dict) and e.get("dtype") in SAFETENSORS_FORMATS
        if not (isinstance(e, dict) and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2) \
                or (mine["dtype"] != "U8" if blob else mine["dtype"] != e.get("dtype")):
            raise FormatError(f"tensor {name!r}: archive entry does not match the recorded header")
        out[name] = (e, st.data[a:b], blob)
    return out


def restore_safetensors(st: SafetensorsFile, out: Path, decompress, progress) -> dict:
    """Write the original file of the archive st to out: the recorded header, each tensor at its
    recorded offsets.  decompress(blob, entry) -> uint8 bytes of the values (entry: the recorded
    header's, to check dtype and shape against)."""
    text = st.metadata[ARCHIVE_KEY].encode("utf-8")
    tensors = archive_tensors(st)
    ordered = sorted(tensors.items(), key=lambda kv: kv[1][0]["data_offsets"][0])
    pieces, end = [struct.pack("<Q", len(text)), text], 0
    for name, (e, stored, blob) in ordered:
        a, b = e["data_offsets"]
        if a != end:
            raise FormatError(f"tensor {name!r}: the recorded header leaves a gap or overlap at byte {end}")
        data = decompress(stored, e) if blob else stored
        if data.nbytes != b - a:
            raise FormatError(f"tensor {name!r}: {data.nbytes} bytes decoded, the header says {b - a}")
        pieces.append(data)
        end = b
        progress(stored.nbytes)
    written = write_atomic(out, pieces)
    return {"tensors": len(tensors), "bytes": written}
