"""``kvzip weights`` end to end: compress, decompress, info, verify on a single and a sharded
checkpoint, and the one-line errors with kvzip's exit statuses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvzip.cli import EXIT_CORRUPT, EXIT_FAILED, EXIT_NO_FILE, EXIT_OK, EXIT_WRONG_KIND, main
from kvzip import files

st_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("torch")

from test_weights_checkpoint import SLICE, write_sharded  # noqa: E402


def run(capsys, *argv):
    status = main(["weights", *[str(a) for a in argv]])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_single_file_end_to_end(tmp_path, capsys):
    packed, back = tmp_path / "m.kvz.safetensors", tmp_path / "back.safetensors"
    status, out, err = run(capsys, "compress", SLICE, packed)
    assert status == EXIT_OK and "2 tensors" in out and "ratio 1.4" in out and err == ""  # no bar off a terminal
    status, out, _ = run(capsys, "info", packed)
    assert status == EXIT_OK and "layout 1" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("embeddings.word_embeddings.weight"))
    assert row[1:4] == ["BF16", "[128,", "384]"] and row[4] == "98,304" and row[-1] == "exponent-huffman"
    assert float(row[-2]) > 1.45 and out.splitlines()[-1].startswith("total")
    doc = json.loads(run(capsys, "info", "--json", packed)[1])
    assert [t["name"] for t in doc["tensors"]] == ["embeddings.word_embeddings.weight",
                                                   "encoder.layer.0.intermediate.dense.weight"]
    assert doc["ratio"] > 1.47 and doc["metadata"]["source"].startswith("rows")
    status, out, _ = run(capsys, "verify", packed, "--against", SLICE)
    assert status == EXIT_OK and "2 tensors verified" in out
    status, out, _ = run(capsys, "decompress", "-q", packed, back)
    assert status == EXIT_OK and out == ""
    assert back.read_bytes() == SLICE.read_bytes()


def test_sharded_end_to_end(tmp_path, capsys):
    write_sharded(tmp_path / "model")
    status, out, _ = run(capsys, "compress", tmp_path / "model", tmp_path / "packed")
    assert status == EXIT_OK and "4 tensors in 2 shards" in out
    index = tmp_path / "packed" / "model.safetensors.index.json"
    status, out, _ = run(capsys, "info", index)
    assert status == EXIT_OK and "in 2 shards" in out and "model-00002-of-00002.safetensors" in out
    assert len(json.loads(run(capsys, "info", "--json", tmp_path / "packed")[1])["shards"]) == 2
    assert run(capsys, "verify", tmp_path / "packed", "--against", tmp_path / "model")[0] == EXIT_OK
    assert run(capsys, "decompress", index, tmp_path / "back")[0] == EXIT_OK
    for f in (tmp_path / "model").iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes()
    status, _, err = run(capsys, "decompress", index, tmp_path / "back")
    assert status == EXIT_FAILED and "exists (--force" in err
    assert run(capsys, "decompress", "--force", index, tmp_path / "back")[0] == EXIT_OK
    status, _, err = run(capsys, "compress", tmp_path / "model", tmp_path / "model")
    assert status == EXIT_FAILED and "overwrite IN" in err


def test_verify_catches_a_corrupted_file(tmp_path, capsys):
    packed = tmp_path / "m.kvz.safetensors"
    assert run(capsys, "compress", SLICE, packed)[0] == EXIT_OK
    st = files.read_safetensors(packed)
    a, b = st.entries["encoder.layer.0.intermediate.dense.weight"]["data_offsets"]
    raw = bytearray(packed.read_bytes())
    raw[8 + len(st.header_text) + b - 100] ^= 0x01  # a sign/mantissa byte
    packed.write_bytes(bytes(raw))
    status, out, err = run(capsys, "verify", packed)
    assert status == EXIT_CORRUPT and "checksum" in err and "intermediate" in err and "verified" not in out
    assert err.strip().splitlines()[-1].startswith("kvzip weights verify: error: 1 problem(s)")
    status, _, err = run(capsys, "decompress", packed, tmp_path / "back.safetensors")
    assert status == EXIT_CORRUPT and err.startswith("kvzip weights decompress: error: corrupt file:")
    assert not (tmp_path / "back.safetensors").exists()
    assert run(capsys, "info", packed)[0] == EXIT_OK  # info reads headers only


def test_verify_against_another_file_is_a_mismatch(tmp_path, capsys):
    packed = tmp_path / "m.kvz.safetensors"
    run(capsys, "compress", SLICE, packed)
    tensors = st_torch.load_file(str(SLICE))
    tensors["embeddings.word_embeddings.weight"][3, 3] *= 2
    other = tmp_path / "other.safetensors"
    st_torch.save_file(tensors, str(other))
    status, _, err = run(capsys, "verify", packed, "--against", other)
    assert status == EXIT_FAILED and "mismatch" in err and "embeddings" in err


def test_errors_are_one_line_with_kvzip_exit_statuses(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    packed = tmp_path / "m.kvz.safetensors"
    cases = [(("compress", tmp_path / "missing.safetensors", packed), EXIT_NO_FILE, "no such file"),
             (("compress", text, packed), EXIT_WRONG_KIND, "not a .safetensors file"),
             (("info", tmp_path), EXIT_WRONG_KIND, "no *.safetensors.index.json"),
             (("decompress", SLICE, tmp_path / "x"), EXIT_WRONG_KIND, "not a compressed checkpoint"),
             (("verify", SLICE), EXIT_WRONG_KIND, "not a compressed checkpoint")]
    for argv, want, words in cases:
        status, _, err = run(capsys, *argv)
        assert status == want and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert run(capsys, "compress", SLICE, packed)[0] == EXIT_OK
    status, _, err = run(capsys, "compress", SLICE, packed)
    assert status == EXIT_FAILED and "--force" in err
    assert run(capsys, "compress", "-f", "-q", SLICE, packed)[0] == EXIT_OK
    status, _, err = run(capsys, "compress", packed, tmp_path / "again")
    assert status == EXIT_WRONG_KIND and "already" in err
    truncated = tmp_path / "cut.kvz.safetensors"
    truncated.write_bytes(packed.read_bytes()[:-1000])
    status, _, err = run(capsys, "verify", truncated)
    assert status == EXIT_CORRUPT and "corrupt file" in err
    status, _, err = run(capsys, "verify", packed, "--against", tmp_path / "nothing")
    assert status == EXIT_NO_FILE


def test_listed_by_kvzip_help_and_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "kvzip", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "weights" in out.stdout and "compressed checkpoints" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvzip", "weights", "verify", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--against" in out.stdout
