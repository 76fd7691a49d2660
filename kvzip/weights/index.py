"""The index of a sharded checkpoint: a ``*.safetensors.index.json`` file, {"metadata": ...,
"weight_map": {tensor: shard file name}}, beside its shards."""
from __future__ import annotations

import json
from pathlib import Path

from .. import files
from ..errors import FormatError

INDEX_SUFFIX = ".safetensors.index.json"


def find_index(path: Path) -> Path | None:
    """The index a path names: itself if it is a .json file, the one *.safetensors.index.json of
    a folder; None for anything else (a single checkpoint file)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob(f"*{INDEX_SUFFIX}"))
        if len(found) != 1:
            raise files.WrongKind(f"{path} is a folder with {len(found) or 'no'} *{INDEX_SUFFIX} files"
                                  + ("; name the one to use" if found else ""))
        return found[0]
    return path if path.suffix == ".json" else None


def read_index(index: Path) -> tuple[dict, str]:
    """(the index's JSON object, its text), checked: a weight map of tensor names to plain file
    names in the index's folder."""
    try:
        text = Path(index).read_text(encoding="utf-8")
        doc = json.loads(text)
    except (UnicodeDecodeError, RecursionError, json.JSONDecodeError) as e:
        raise files.WrongKind(f"{index} is not a JSON index of shards ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise files.WrongKind(f"{index} is not an index of shards (no weight_map)")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard:
            raise FormatError(f"{index}: tensor {tensor!r} is in {shard!r}, which is not a file name in the index's "
                              "folder")
    return doc, text


def shards(doc: dict) -> list[str]:
    """The shard file names of an index, each once, in order of first mention."""
    return list(dict.fromkeys(doc["weight_map"].values()))


def check_shard_tensors(doc: dict, shard: str, names) -> None:
    """FormatError unless the shard holds exactly the tensors the index puts in it."""
    listed = {t for t, s in doc["weight_map"].items() if s == shard}
    if listed != set(names):
        raise FormatError(f"shard {shard} holds {len(set(names))} tensors, the index lists {len(listed)} other or "
                          "different ones")
