"""Compressed checkpoints (kvzip/weights/checkpoint.py, sharded.py): byte-identical restores, the
Python API, standard tools opening the compressed file, bad files refused, tensor-by-tensor memory."""
from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from kvzip import FormatError, files
from kvzip.weights import checkpoint, sharded, storage

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
safe_open = pytest.importorskip("safetensors").safe_open

SLICE = Path(__file__).resolve().parent / "data" / "minilm-slice-bf16.safetensors"


def weight_like(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.03).to(dtype)


def every_dtype() -> dict:
    """One tensor of each dtype safetensors and torch share, some 0-d, empty or odd-sized."""
    out = {"bf16": weight_like((33, 65), torch.bfloat16), "f16": weight_like((1000, 7), torch.float16),
           "f32": weight_like((4097,), torch.float32), "f64": weight_like((3, 3), torch.float64),
           "scalar": torch.tensor(2.5, dtype=torch.bfloat16), "empty": torch.zeros((0, 5), dtype=torch.float32),
           "e4m3": weight_like((17,), torch.float32).to(torch.float8_e4m3fn),
           "e5m2": weight_like((17,), torch.float32).to(torch.float8_e5m2),
           "mask": torch.arange(11) % 3 == 0, "transposed": weight_like((40, 30), torch.bfloat16).t()}
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        out[name] = torch.arange(-5, 20).to(getattr(torch, name)) if name.startswith("int") else \
            torch.arange(0, 25).to(getattr(torch, name))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.contiguous().reshape(-1).view(torch.uint8).equal(
        b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture
def model(tmp_path) -> Path:
    """A small .safetensors checkpoint written by the safetensors library: real BF16 weights, a
    weight-like FP16 and FP32 tensor, an int64 and a bool tensor, metadata."""
    tensors = dict(st_torch.load_file(str(SLICE)))
    tensors |= {"norm.f32": weight_like((384,), torch.float32), "head.f16": weight_like((64, 96), torch.float16),
                "position_ids": torch.arange(512).reshape(1, 512), "flags": torch.ones(9, dtype=torch.bool)}
    path = tmp_path / "model.safetensors"
    st_torch.save_file(tensors, str(path), metadata={"format": "pt", "note": "test"})
    return path


def test_compress_then_decompress_gives_the_file_back(model, tmp_path):
    packed, back = tmp_path / "model.kvz.safetensors", tmp_path / "back.safetensors"
    done = checkpoint.compress_file(model, packed)
    assert done["tensors"] == 6 and done["bytes"] == packed.stat().st_size
    assert checkpoint.decompress_file(packed, back)["bytes"] == model.stat().st_size
    assert back.read_bytes() == model.read_bytes()


def test_standard_tools_open_the_compressed_file(model, tmp_path):
    packed = tmp_path / "model.kvz.safetensors"
    checkpoint.compress_file(model, packed)
    with safe_open(str(packed), "pt") as f, safe_open(str(model), "pt") as g:
        assert list(f.keys()) == list(g.keys())
        meta = f.metadata()
        assert meta["format"] == "pt" and meta["note"] == "test" and meta[checkpoint.FORMAT_KEY] == "1"
        digests = json.loads(meta[checkpoint.SHA256_KEY])
        for name in g.keys():
            blob = f.get_tensor(name)
            assert blob.dtype == torch.uint8 and blob.dim() == 1
            dtype, shape, data = storage.decompress(blob.numpy())
            original = g.get_tensor(name)
            assert list(shape) == list(original.shape)
            assert same_bits(torch.from_numpy(data).view(original.dtype).reshape(shape), original)
            assert hashlib.sha256(data).hexdigest() == digests[name]
    assert json.loads(meta[checkpoint.HEADER_KEY]) == json.loads(files.read_safetensors(model).header_text)


def test_info_reports_each_tensor(model, tmp_path):
    packed = tmp_path / "model.kvz.safetensors"
    checkpoint.compress_file(model, packed)
    doc = checkpoint.describe_file(packed)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows["position_ids"]["coding"] == "raw" and rows["flags"]["dtype"] == "BOOL"
    bf16 = rows["encoder.layer.0.intermediate.dense.weight"]
    assert bf16["coding"] == "exponent-huffman" and bf16["shape"] == [128, 384] and bf16["ratio"] > 1.45
    assert rows["head.f16"]["coding"] == "exponent-huffman" and rows["head.f16"]["ratio"] > 1.1
    assert doc["raw_bytes"] == sum(t["raw_bytes"] for t in doc["tensors"])
    assert doc["metadata"] == {"format": "pt", "note": "test"}


def test_save_and_load_every_dtype_and_shape(tmp_path):
    tensors = every_dtype()
    path = tmp_path / "all.kvz.safetensors"
    checkpoint.save_compressed(tensors, path, metadata={"who": "test"})
    loaded = checkpoint.load_compressed(path)
    assert list(loaded) == list(tensors)
    for name, t in tensors.items():
        assert same_bits(loaded[name], t), name
    # decompressing gives a plain .safetensors file of the same tensors and metadata
    back = tmp_path / "all.safetensors"
    checkpoint.decompress_file(path, back)
    with safe_open(str(back), "pt") as f:
        assert f.metadata() == {"who": "test"}
        for name, t in tensors.items():
            assert same_bits(f.get_tensor(name), t), name


def test_save_refuses_what_it_cannot_store(tmp_path):
    with pytest.raises(TypeError, match="complex64"):
        checkpoint.save_compressed({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "x")
    with pytest.raises(TypeError):
        checkpoint.save_compressed({"a": np.zeros(3)}, tmp_path / "x")
    with pytest.raises(ValueError, match="own"):
        checkpoint.save_compressed({"a": torch.zeros(3)}, tmp_path / "x", metadata={"kvzip.weights": "2"})
    with pytest.raises(FormatError):
        checkpoint.save_compressed({"a": torch.zeros(3)}, tmp_path / "x", metadata={"n": 3})
    assert not (tmp_path / "x").exists()


def test_special_values_come_back(tmp_path):
    bits = np.array([0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0, 0x8000, 1, 0x807F] * 5000, dtype=np.uint16)
    x = {"specials": torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)}
    checkpoint.save_compressed(x, tmp_path / "s.kvz")
    assert same_bits(checkpoint.load_compressed(tmp_path / "s.kvz")["specials"], x["specials"])


# ---- bad files -------------------------------------------------------------------------------

def rewrite_metadata(path: Path, out: Path, edit) -> None:
    """out: path with edit(metadata) applied to its header (the data as it is)."""
    st = files.read_safetensors(path)
    meta = dict(st.metadata)
    edit(meta)
    head = files.safetensors_bytes_header(st.entries, meta)
    out.write_bytes(head + np.asarray(st.data).tobytes())


def test_forged_records_are_refused(model, tmp_path):
    packed = tmp_path / "model.kvz.safetensors"
    checkpoint.compress_file(model, packed)
    original = json.loads(files.read_safetensors(packed).metadata[checkpoint.HEADER_KEY])

    def header_with(**change):
        def edit(meta):
            doc = json.loads(meta[checkpoint.HEADER_KEY])
            doc["flags"] |= change
            meta[checkpoint.HEADER_KEY] = json.dumps(doc)
        return edit

    a, b = original["flags"]["data_offsets"]
    cases = {
        "layout": lambda m: m.__setitem__(checkpoint.FORMAT_KEY, "9"),
        "no header": lambda m: m.pop(checkpoint.HEADER_KEY),
        "header not JSON": lambda m: m.__setitem__(checkpoint.HEADER_KEY, "{"),
        "header nested too deep": lambda m: m.__setitem__(checkpoint.HEADER_KEY, "[" * 10**5 + "]" * 10**5),
        "digests not JSON": lambda m: m.__setitem__(checkpoint.SHA256_KEY, "[1]"),
        "missing digest": lambda m: m.__setitem__(checkpoint.SHA256_KEY, json.dumps(
            {k: v for k, v in json.loads(m[checkpoint.SHA256_KEY]).items() if k != "flags"})),
        "bad digest": lambda m: m.__setitem__(checkpoint.SHA256_KEY, json.dumps(
            {**json.loads(m[checkpoint.SHA256_KEY]), "flags": "xyz"})),
        "shape": header_with(shape=[10]),
        "dtype": header_with(dtype="U8"),
        "unknown dtype": header_with(dtype="C64"),
        "overlap": header_with(data_offsets=[a - 1, b - 1]),
    }
    for what, edit in cases.items():
        bad = tmp_path / f"bad-{len(what)}.safetensors"
        rewrite_metadata(packed, bad, edit)
        with pytest.raises(FormatError):
            checkpoint.decompress_file(bad, tmp_path / "out.safetensors")
            pytest.fail(f"accepted: {what}")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_changed_shape_that_fits_is_caught_when_decoding(model, tmp_path):
    packed, bad = tmp_path / "model.kvz.safetensors", tmp_path / "bad.safetensors"
    checkpoint.compress_file(model, packed)

    def edit(meta):
        doc = json.loads(meta[checkpoint.HEADER_KEY])
        doc["head.f16"]["shape"] = [96, 64]
        meta[checkpoint.HEADER_KEY] = json.dumps(doc)

    rewrite_metadata(packed, bad, edit)
    with pytest.raises(FormatError, match="head.f16"):
        checkpoint.decompress_file(bad, tmp_path / "out.safetensors")


def test_corrupted_blob_is_reported_by_verify(model, tmp_path):
    packed = tmp_path / "model.kvz.safetensors"
    checkpoint.compress_file(model, packed)
    st = files.read_safetensors(packed)
    a, b = st.entries["head.f16"]["data_offsets"]
    raw = bytearray(packed.read_bytes())
    raw[8 + len(st.header_text) + (a + b) // 2] ^= 0x10
    packed.write_bytes(bytes(raw))
    report = checkpoint.verify_file(packed)
    assert report["tensors"] == 6 and len(report["corrupt"]) == 1 and "head.f16" in report["corrupt"][0]
    with pytest.raises(FormatError, match="head.f16"):
        checkpoint.decompress_file(packed, tmp_path / "out.safetensors")


def test_verify_against_the_original(model, tmp_path):
    packed = tmp_path / "model.kvz.safetensors"
    checkpoint.compress_file(model, packed)
    assert checkpoint.verify_file(packed, model) == {"tensors": 6, "corrupt": [], "mismatch": [], "notes": []}
    other = tmp_path / "other.safetensors"
    tensors = st_torch.load_file(str(model))
    tensors["head.f16"][0, 0] += 1
    st_torch.save_file(tensors, str(other), metadata={"format": "pt", "note": "test"})
    report = checkpoint.verify_file(packed, other)
    assert report["corrupt"] == [] and len(report["mismatch"]) == 1 and "head.f16" in report["mismatch"][0]
    # same tensors and metadata, written another way: a note, no mismatch
    st = files.read_safetensors(model)
    respaced = tmp_path / "respaced.safetensors"
    text = st.header_text.rstrip() + b" " * 16
    respaced.write_bytes(struct.pack("<Q", len(text)) + text + np.asarray(st.data).tobytes())
    report = checkpoint.verify_file(packed, respaced)
    assert report["mismatch"] == [] and len(report["notes"]) == 1


def test_not_compressed_and_not_standard_inputs(model, tmp_path):
    with pytest.raises(files.WrongKind):
        checkpoint.decompress_file(model, tmp_path / "x")
    packed = tmp_path / "model.kvz.safetensors"
    checkpoint.compress_file(model, packed)
    with pytest.raises(files.WrongKind):
        checkpoint.compress_file(packed, tmp_path / "x")
    gap = tmp_path / "gap.safetensors"  # the last tensor's bytes followed by 8 bytes no tensor holds
    gap.write_bytes(model.read_bytes() + bytes(8))
    with pytest.raises(FormatError, match="data section"):
        checkpoint.compress_file(gap, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_memory_is_one_tensor_at_a_time(tmp_path):
    tensors = {f"layer{i}": weight_like((512, 1024), torch.bfloat16, seed=i) for i in range(8)}  # 1 MiB each
    src, packed, back = tmp_path / "m.safetensors", tmp_path / "m.kvz", tmp_path / "b.safetensors"
    st_torch.save_file(tensors, str(src))
    del tensors
    checkpoint.compress_file(src, tmp_path / "warm.kvz")  # compile and cache outside the measurement
    for step in (lambda: checkpoint.compress_file(src, packed), lambda: checkpoint.decompress_file(packed, back),
                 lambda: checkpoint.verify_file(packed)):
        tracemalloc.start()
        step()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 3 << 20, peak  # the checkpoint is 8 MiB
    assert back.read_bytes() == src.read_bytes()


# ---- sharded ---------------------------------------------------------------------------------

def write_sharded(folder: Path) -> dict:
    folder.mkdir()
    shard_tensors = [{"a.weight": weight_like((100, 64), torch.bfloat16, 1), "a.bias": weight_like((64,), torch.float32)},
                     {"b.weight": weight_like((64, 100), torch.bfloat16, 2), "ids": torch.arange(10)}]
    weight_map, total = {}, 0
    for i, tensors in enumerate(shard_tensors):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        st_torch.save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map |= {k: name for k in tensors}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    return {k: v for t in shard_tensors for k, v in t.items()}


def test_sharded_round_trip_and_load(tmp_path):
    tensors = write_sharded(tmp_path / "model")
    index = tmp_path / "model" / "model.safetensors.index.json"
    done = sharded.compress_index(index, tmp_path / "packed")
    assert done["shards"] == 2 and done["tensors"] == 4
    packed_index = json.loads((tmp_path / "packed" / index.name).read_text())
    assert packed_index["weight_map"] == json.loads(index.read_text())["weight_map"]
    assert packed_index["metadata"][sharded.INDEX_KEY] == index.read_text()
    assert packed_index["metadata"]["total_size"] == sharded.describe_index(tmp_path / "packed" / index.name)[
        "stored_bytes"]
    loaded = checkpoint.load_compressed(tmp_path / "packed")
    assert sorted(loaded) == sorted(tensors) and all(same_bits(loaded[k], t) for k, t in tensors.items())
    sharded.decompress_index(tmp_path / "packed" / index.name, tmp_path / "back")
    for f in (tmp_path / "model").iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name
    report = sharded.verify_index(tmp_path / "packed" / index.name, tmp_path / "model")
    assert report == {"tensors": 4, "corrupt": [], "mismatch": [], "notes": []}


def test_hostile_index_is_refused(tmp_path):
    write_sharded(tmp_path / "model")
    index = tmp_path / "model" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    for shard in ("../model/model-00001-of-00002.safetensors", "/etc/passwd", "..", ""):
        index.write_text(json.dumps({**doc, "weight_map": {**doc["weight_map"], "a.weight": shard}}))
        with pytest.raises(FormatError):
            sharded.compress_index(index, tmp_path / "out")
    index.write_text(json.dumps({**doc, "weight_map": {**doc["weight_map"], "ghost": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FormatError, match="index lists"):
        sharded.compress_index(index, tmp_path / "out")
    index.write_text("[]")
    with pytest.raises(files.WrongKind):
        sharded.compress_index(index, tmp_path / "out")


def test_a_shard_swapped_for_another_is_refused(tmp_path):
    write_sharded(tmp_path / "model")
    sharded.compress_index(tmp_path / "model" / "model.safetensors.index.json", tmp_path / "packed")
    first, second = sorted((tmp_path / "packed").glob("model-*.safetensors"))
    second.write_bytes(first.read_bytes())
    with pytest.raises(FormatError, match="index lists"):
        checkpoint.load_compressed(tmp_path / "packed")
    with pytest.raises(FormatError, match="index lists"):
        sharded.verify_index(tmp_path / "packed" / "model.safetensors.index.json")
