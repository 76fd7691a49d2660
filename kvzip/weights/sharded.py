"""Sharded checkpoints: a ``*.safetensors.index.json`` ({"metadata": ..., "weight_map": {tensor:
shard file}}) and its shards in one folder.  Compressing one compresses every shard into a
file of the same name in the output folder (kvzip/weights/checkpoint.py), then writes the
index of the compressed shards under the original index's name:

    {"metadata": {"kvzip.weights": "1", "kvzip.weights.index": <the original index, verbatim>,
                  "total_size": <bytes of the compressed tensors>},
     "weight_map": <the original weight map>}

Decompressing restores every shard and then the original index, byte for byte.  The index is
written last, so an interrupted run leaves no index beside the shards it did write.
"""
from __future__ import annotations

import json
from pathlib import Path

from .. import files
from ..errors import FormatError
from . import checkpoint
from .index import check_shard_tensors, find_index, read_index, shards

INDEX_KEY = "kvzip.weights.index"


def _weighted(progress, sizes: list[int]):
    """Per-shard progress callbacks that together report the fraction of all shards' work."""
    total = max(sum(sizes), 1)
    before = 0
    for size in sizes:
        yield lambda f, before=before, size=size: progress((before + f * size) / total)
        before += size


def _checked_shards(doc: dict, index: Path, progress, entries_of):
    """(name, path beside the index, progress callback) of each of doc's shards in turn, each
    checked against doc's weight map (entries_of(path): the shard's tensor entries) first."""
    names = shards(doc)
    sources = [Path(index).parent / s for s in names]
    for shard, src, step in zip(names, sources, _weighted(progress, [p.stat().st_size for p in sources])):
        check_shard_tensors(doc, shard, entries_of(src))
        yield shard, src, step


def _original_entries(path: Path) -> dict:
    return checkpoint.read_original(path)[0].entries


def _compressed_entries(path: Path) -> dict:
    return checkpoint.read_compressed(path).original.entries


def compress_index(index: Path, out_dir: Path, progress=checkpoint.ignore_progress) -> dict:
    """Compress the index's shards into out_dir and write the compressed index there."""
    doc, text = read_index(index)
    names = shards(doc)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {"tensors": 0, "raw_bytes": 0, "bytes": 0}
    for shard, src, step in _checked_shards(doc, index, progress, _original_entries):
        result = checkpoint.compress_file(src, out_dir / shard, step)
        done = {k: done[k] + result[k] for k in done}
    stored = sum(checkpoint.describe_file(out_dir / s)["stored_bytes"] for s in names)
    compressed = {"metadata": {checkpoint.FORMAT_KEY: checkpoint.LAYOUT_VERSION, INDEX_KEY: text,
                               "total_size": stored}, "weight_map": doc["weight_map"]}
    files.write_atomic(out_dir / Path(index).name, [(json.dumps(compressed, indent=2) + "\n").encode("utf-8")])
    return {**done, "shards": len(names)}


def read_compressed_index(index: Path) -> tuple[dict, str]:
    """(the original index, its text) of a compressed index, checked against the compressed one."""
    doc, _ = read_index(index)
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or checkpoint.FORMAT_KEY not in meta:
        raise files.WrongKind(f"{index} is not the index of a compressed checkpoint")
    if meta[checkpoint.FORMAT_KEY] != checkpoint.LAYOUT_VERSION or not isinstance(meta.get(INDEX_KEY), str):
        raise FormatError(f"{index}: unknown compressed index layout {meta[checkpoint.FORMAT_KEY]!r}")
    text = meta[INDEX_KEY]
    try:
        original = json.loads(text)
    except (RecursionError, json.JSONDecodeError) as e:
        raise FormatError(f"{index}: the recorded original index is not JSON ({e})") from None
    if not isinstance(original, dict) or original.get("weight_map") != doc["weight_map"]:
        raise FormatError(f"{index}: the recorded original index has another weight map")
    return original, text


def decompress_index(index: Path, out_dir: Path, progress=checkpoint.ignore_progress) -> dict:
    """Restore the shards of a compressed index into out_dir, then the original index."""
    original, text = read_compressed_index(index)
    names = shards(original)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {"tensors": 0, "raw_bytes": 0, "bytes": 0}
    for shard, src, step in _checked_shards(original, index, progress, _compressed_entries):
        result = checkpoint.decompress_file(src, out_dir / shard, step)
        done = {k: done[k] + result[k] for k in done}
    files.write_atomic(out_dir / Path(index).name, [text.encode("utf-8")])
    return {**done, "shards": len(names)}


def describe_index(index: Path) -> dict:
    original, _ = read_compressed_index(index)
    parts = [checkpoint.describe_file(Path(index).parent / s) for s in shards(original)]
    raw, stored = sum(p["raw_bytes"] for p in parts), sum(p["stored_bytes"] for p in parts)
    return {"index": str(index), "layout": checkpoint.LAYOUT_VERSION, "shards": parts, "raw_bytes": raw,
            "stored_bytes": stored, "ratio": raw / stored if stored else 1.0}


def verify_index(index: Path, against: Path | None = None, progress=checkpoint.ignore_progress) -> dict:
    """verify_file of every shard (against the shard of the same name beside the original index),
    and the recorded original index against that one."""
    original, text = read_compressed_index(index)
    report = {"tensors": 0, "corrupt": [], "mismatch": [], "notes": []}
    theirs = None
    if against is not None:
        theirs = find_index(against)
        if theirs is None:
            raise files.WrongKind(f"--against {against}: a sharded checkpoint is checked against an index or its folder")
        if read_index(theirs)[1] != text:
            report["mismatch"].append(f"{theirs} is not the recorded original index")
    for shard, src, step in _checked_shards(original, index, progress, _compressed_entries):
        part = checkpoint.verify_file(src, theirs.parent / shard if theirs else None, step)
        report["tensors"] += part["tensors"]
        for key in ("corrupt", "mismatch", "notes"):
            report[key] += [f"{shard}: {line}" for line in part[key]]
    return report
