"""Compressed checkpoints: a .safetensors file whose every tensor is a storage-level blob
(kvzip/weights/storage.py) held as a 1-D U8 tensor of the original name, so standard tools still
open it.  Its ``__metadata__`` is the original's plus

    kvzip.weights         "1", the layout version
    kvzip.weights.header  the original file's JSON header, verbatim (names, dtypes, shapes, data
                          offsets, the original __metadata__, padding)
    kvzip.weights.sha256  JSON object: name -> sha256 (hex) of the original tensor's bytes

so that decompressing writes the original file back byte for byte: the recorded header, then
every tensor decoded at its recorded offsets.  docs/weights-format.md is the normative
description; kvzip/weights/sharded.py does the same for a checkpoint split into shards.

Everything goes tensor by tensor: a compressed tensor is planned (its exact size, so the header
can be written first), then encoded and written; a decoded one is written or checked and
dropped.  Progress callbacks get the fraction of the work done, 0 to 1.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import files
from ..errors import FormatError
from . import storage
from .index import check_shard_tensors, find_index, read_index, shards

FORMAT_KEY, HEADER_KEY, SHA256_KEY = "kvzip.weights", "kvzip.weights.header", "kvzip.weights.sha256"
LAYOUT_VERSION = "1"
TORCH_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32",
                "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64"}
_SHA256 = re.compile("[0-9a-f]{64}")


def ignore_progress(fraction: float) -> None:
    pass


@dataclass
class Original:
    """An uncompressed checkpoint as a compressed one records it."""
    header_text: str  # the JSON header, verbatim
    entries: dict     # name -> {"dtype", "shape", "data_offsets"}, in data order
    metadata: dict    # the original __metadata__ ({} when it had none)

    @property
    def raw_bytes(self) -> int:
        return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in self.entries.values())


def _tiled(entries: dict, where: str) -> dict:
    """The entries in data order, checked to cover the data section without a gap or an overlap,
    as the safetensors format requires (so a restored file is the original byte for byte)."""
    ordered = dict(sorted(entries.items(), key=lambda item: item[1]["data_offsets"]))
    end = 0
    for name, e in ordered.items():
        a, b = e["data_offsets"]
        if a != end:
            raise FormatError(f"{where}: tensor {name!r} starts at byte {a} of the data, not at {end} (a gap or an "
                              "overlap)")
        end = b
    return ordered


def _metadata(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise FormatError(f"{where}: __metadata__ is not an object of strings")
    return value


def read_original(path: Path) -> tuple[Original, files.SafetensorsFile]:
    """An uncompressed .safetensors file, checked (FormatError; files.WrongKind if compressed)."""
    st = files.read_safetensors(path)
    metadata = _metadata(st.metadata, str(path))
    if FORMAT_KEY in metadata:
        raise files.WrongKind(f"{path} is a compressed checkpoint already")
    end = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in st.entries.values())
    if end != st.data.nbytes:
        raise FormatError(f"{path}: the tensors hold {end} bytes of its {st.data.nbytes}-byte data section")
    entries = _tiled(st.entries, str(path))
    return Original(st.header_text.decode("utf-8"), entries, metadata), st


# ---- writing --------------------------------------------------------------------------------------

def _write(dst: Path, original: Original, tensor_bytes, progress=ignore_progress) -> dict:
    """Write the compressed checkpoint of original; tensor_bytes(name) -> its bytes (1-D uint8),
    called twice a tensor (plan, then encode), so it must give the same bytes both times."""
    total = max(2 * original.raw_bytes, 1)
    done = 0
    plans, digests = {}, {}
    for name, e in original.entries.items():
        data = tensor_bytes(name)
        plans[name] = storage.plan(e["dtype"], e["shape"], data)
        digests[name] = hashlib.sha256(data).hexdigest()
        done += data.nbytes
        progress(done / total)
    entries, offset = {}, 0
    for name, p in plans.items():
        entries[name] = {"dtype": "U8", "shape": [p.nbytes], "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    metadata = {**original.metadata, FORMAT_KEY: LAYOUT_VERSION, HEADER_KEY: original.header_text,
                SHA256_KEY: json.dumps(digests, separators=(",", ":"))}
    head = files.safetensors_bytes_header(entries, metadata)
    with files.atomic_output(dst) as f:
        f.write(head)
        for name, p in plans.items():
            data = tensor_bytes(name)
            f.write(storage.encode(p, data))
            done += data.nbytes
            progress(done / total)
    return {"tensors": len(plans), "raw_bytes": original.raw_bytes, "bytes": len(head) + offset}


def compress_file(src: Path, dst: Path, progress=ignore_progress) -> dict:
    """Compress the .safetensors file src into the compressed checkpoint dst.  Returns
    {"tensors", "raw_bytes" (of the tensors), "bytes" (dst's length)}."""
    original, st = read_original(src)

    def tensor_bytes(name):
        a, b = original.entries[name]["data_offsets"]
        return st.data[a:b]

    return _write(Path(dst), original, tensor_bytes, progress)


def save_compressed(tensors: dict, path, metadata: dict | None = None) -> dict:
    """Save a dict of str -> torch.Tensor (any device) as a compressed checkpoint: the one
    ``kvzip weights compress`` makes of the .safetensors file of these tensors, in dict order,
    with metadata (str -> str) as its __metadata__."""
    import torch

    from_torch = {getattr(torch, v): k for k, v in TORCH_DTYPES.items() if hasattr(torch, v)}
    entries, offset = {}, 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor) or t.dtype not in from_torch:
            what = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
            raise TypeError(f"entry {name!r} is {what}; save_compressed takes str -> torch.Tensor of "
                            f"{', '.join(sorted(TORCH_DTYPES.values()))}")
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": from_torch[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    metadata = _metadata(metadata, "metadata")
    if any(k.startswith(FORMAT_KEY) for k in metadata):
        raise ValueError(f"metadata keys starting with {FORMAT_KEY!r} are the compressed checkpoint's own")
    text = files.safetensors_bytes_header(entries, metadata or None)[8:].decode("utf-8")

    def tensor_bytes(name):  # a view of a CPU tensor; a device tensor is copied, one at a time
        return tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()

    return _write(Path(path), Original(text, entries, metadata), tensor_bytes)


# ---- reading --------------------------------------------------------------------------------------

@dataclass
class Compressed:
    """A compressed checkpoint, its records checked against each other."""
    path: Path
    original: Original
    digests: dict               # name -> sha256 hex of the original tensor
    st: files.SafetensorsFile

    def blob(self, name: str) -> np.ndarray:
        a, b = self.st.entries[name]["data_offsets"]
        return np.asarray(self.st.data[a:b])

    def decode(self, name: str) -> np.ndarray:
        """The original bytes of tensor name (FormatError if its blob is corrupt or is not the
        dtype and shape the recorded header gives it)."""
        e = self.original.entries[name]
        try:
            dtype, shape, data = storage.decompress(self.blob(name))
        except FormatError as err:
            raise FormatError(f"tensor {name!r}: {err}") from None
        if dtype != e["dtype"] or list(shape) != e["shape"]:
            raise FormatError(f"tensor {name!r}: its blob holds {dtype} {list(shape)}, the recorded header says "
                              f"{e['dtype']} {e['shape']}")
        return data


def read_compressed(path: Path) -> Compressed:
    """A compressed checkpoint (FormatError if its records are malformed or disagree;
    files.WrongKind if it is a .safetensors file of another kind)."""
    path = Path(path)
    st = files.read_safetensors(path)
    meta = st.metadata if isinstance(st.metadata, dict) else {}
    if FORMAT_KEY not in meta:
        raise files.WrongKind(f"{path} is not a compressed checkpoint (`kvzip weights compress` writes those)")
    if meta[FORMAT_KEY] != LAYOUT_VERSION:
        raise FormatError(f"{path}: compressed checkpoint layout {meta[FORMAT_KEY]!r} (this kvzip reads "
                          f"{LAYOUT_VERSION!r})")
    try:
        header_text, digests = meta[HEADER_KEY], json.loads(meta[SHA256_KEY])
        doc = json.loads(header_text)
    except (KeyError, TypeError, RecursionError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: the compressed checkpoint's records are missing or not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(digests, dict):
        raise FormatError(f"{path}: the recorded header or digests are not JSON objects")
    metadata = _metadata(doc.pop("__metadata__", None), f"{path}: the recorded header")
    for name, e in doc.items():
        ok = isinstance(e, dict) and e.get("dtype") in storage.ITEMSIZE and isinstance(e.get("shape"), list) \
            and all(type(d) is int and d >= 0 for d in e["shape"]) and isinstance(e.get("data_offsets"), list) \
            and len(e["data_offsets"]) == 2 and all(type(o) is int for o in e["data_offsets"])
        if not ok or e["data_offsets"][1] - e["data_offsets"][0] != storage.ITEMSIZE[e["dtype"]] * \
                int(np.prod(e["shape"], dtype=object)):
            raise FormatError(f"{path}: the recorded header's entry for {name!r} is malformed")
    entries = _tiled(doc, f"{path}: the recorded header")
    if set(entries) != set(st.entries) or set(digests) != set(entries):
        raise FormatError(f"{path}: the stored tensors, the recorded header and the digests name different tensors")
    for name in entries:
        mine = st.entries[name]
        if mine["dtype"] != "U8" or len(mine["shape"]) != 1 or not _SHA256.fullmatch(str(digests[name])):
            raise FormatError(f"{path}: tensor {name!r} is not a U8 blob with a sha256 digest")
    return Compressed(path, Original(header_text, entries, metadata), digests, st)


def decompress_file(src: Path, dst: Path, progress=ignore_progress) -> dict:
    """Write the original .safetensors file of the compressed checkpoint src to dst, byte for
    byte.  Returns {"tensors", "raw_bytes", "bytes"}."""
    c = read_compressed(src)
    text = c.original.header_text.encode("utf-8")
    total, done = max(c.original.raw_bytes, 1), 0
    with files.atomic_output(Path(dst)) as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name in c.original.entries:
            data = c.decode(name)
            f.write(data)
            done += data.nbytes
            progress(done / total)
    return {"tensors": len(c.original.entries), "raw_bytes": c.original.raw_bytes, "bytes": 8 + len(text) + done}


def load_compressed(path, device="cpu") -> dict:
    """The tensors of a compressed checkpoint (a file, or an index or folder of shards) as a dict
    of str -> torch.Tensor on device, each decoded once, in the checkpoint's order."""
    import torch

    index = find_index(Path(path))
    doc = read_index(index)[0] if index else None
    out = {}
    for shard in (shards(doc) if doc else [Path(path)]):
        c = read_compressed(index.parent / shard if doc else shard)
        if doc:
            check_shard_tensors(doc, shard, c.original.entries)
        for name, e in c.original.entries.items():
            dtype, data = getattr(torch, TORCH_DTYPES[e["dtype"]]), c.decode(name)
            # the decoded bytes become the tensor, no copy (torch cannot view an empty array)
            t = torch.from_numpy(data).view(dtype).reshape(e["shape"]) if data.size else torch.empty(e["shape"], dtype=dtype)
            out[name] = t if str(device) == "cpu" else t.to(device)
    return out


def describe_file(path: Path) -> dict:
    """What ``kvzip weights info`` shows of a compressed checkpoint: per tensor its dtype, shape,
    raw and stored bytes, ratio and coding (from the blobs' headers, nothing decoded)."""
    c = read_compressed(path)
    tensors = []
    for name, e in c.original.entries.items():
        try:
            h = storage.read_header(c.blob(name))
        except FormatError as err:
            raise FormatError(f"tensor {name!r}: {err}") from None
        raw = e["data_offsets"][1] - e["data_offsets"][0]
        tensors.append({"name": name, "dtype": e["dtype"], "shape": e["shape"], "raw_bytes": raw,
                        "stored_bytes": h.nbytes, "ratio": raw / h.nbytes, "coding": storage.CODINGS[h.coding]})
    raw, stored = c.original.raw_bytes, sum(t["stored_bytes"] for t in tensors)
    return {"file": str(path), "layout": LAYOUT_VERSION, "metadata": c.original.metadata, "tensors": tensors,
            "raw_bytes": raw, "stored_bytes": stored, "ratio": raw / stored if stored else 1.0,
            "file_bytes": Path(path).stat().st_size}


def verify_file(path: Path, against: Path | None = None, progress=ignore_progress) -> dict:
    """Decode every tensor of a compressed checkpoint and check its sha256 against the recorded
    digest, and, given the original file, the original's tensors and metadata against the
    records.  Returns {"tensors": checked, "corrupt": [problems], "mismatch": [problems with
    against], "notes": [...]}; a malformed file raises FormatError."""
    c = read_compressed(path)
    report = {"tensors": 0, "corrupt": [], "mismatch": [], "notes": []}
    original, st = read_original(Path(against)) if against is not None else (None, None)
    if original is not None:
        _compare(c, original, report)
    total, done = max(c.original.raw_bytes, 1), 0
    for name, e in c.original.entries.items():
        try:
            digest = hashlib.sha256(c.decode(name)).hexdigest()
        except FormatError as err:
            report["corrupt"].append(str(err))
        else:
            if digest != c.digests[name]:
                report["corrupt"].append(f"tensor {name!r}: decoded sha256 {digest[:16]}... is not the recorded "
                                         f"{c.digests[name][:16]}...")
        if original is not None and name in original.entries:
            a, b = original.entries[name]["data_offsets"]
            if hashlib.sha256(st.data[a:b]).hexdigest() != c.digests[name]:
                report["mismatch"].append(f"tensor {name!r}: the original's sha256 is not the recorded one")
        report["tensors"] += 1
        done += e["data_offsets"][1] - e["data_offsets"][0]
        progress(done / total)
    return report


def _compare(c: Compressed, original: Original, report: dict) -> None:
    """The records of c against the original file's tensors and metadata (not their bytes)."""
    mine, theirs = c.original.entries, original.entries
    for name in sorted(set(mine) ^ set(theirs)):
        report["mismatch"].append(f"tensor {name!r} is only in the {'compressed' if name in mine else 'original'} "
                                  "file")
    for name in sorted(set(mine) & set(theirs)):
        if (mine[name]["dtype"], mine[name]["shape"]) != (theirs[name]["dtype"], theirs[name]["shape"]):
            report["mismatch"].append(f"tensor {name!r}: recorded {mine[name]['dtype']} {mine[name]['shape']}, "
                                      f"the original has {theirs[name]['dtype']} {theirs[name]['shape']}")
    if c.original.metadata != original.metadata:
        report["mismatch"].append("the original's __metadata__ is not the recorded one")
    if c.original.header_text != original.header_text and not report["mismatch"]:
        report["notes"].append("same tensors and metadata, but the original's header is written differently: "
                               "decompress gives the recorded header, not this file byte for byte")
