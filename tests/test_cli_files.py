"""The kvzip command on files: compress, decompress, info, bench --device cpu, and their errors."""
import json
import subprocess
import sys

import numpy as np
import pytest

from kvzip import cli
from kvzip.cli import EXIT_CORRUPT, EXIT_FAILED, EXIT_NO_FILE, EXIT_OK, EXIT_WRONG_KIND, main
from kvzip.data import load_sample

try:
    import torch
except ImportError:
    torch = None


@pytest.fixture
def st_file(tmp_path):
    """A .safetensors file with BF16 KV, a float32 and an int64 tensor, and metadata."""
    st = pytest.importorskip("safetensors.numpy")
    tensors = dict(load_sample("html"))
    tensors["scale"] = np.linspace(-3, 3, 77, dtype=np.float32).reshape(7, 11)
    tensors["positions"] = np.arange(50, dtype=np.int64)
    path = tmp_path / "kv.safetensors"
    st.save_file(tensors, str(path), metadata={"model": "SmolLM2-135M", "note": "test"})
    return path


def run(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_safetensors_round_trip_is_byte_identical(st_file, tmp_path, capsys):
    st = pytest.importorskip("safetensors.numpy")
    packed, back = tmp_path / "kv.kvz.safetensors", tmp_path / "back.safetensors"
    status, out, _ = run(capsys, "compress", st_file, packed)
    assert status == EXIT_OK and "of 3" not in out and "ratio" in out
    assert packed.stat().st_size < 0.8 * st_file.stat().st_size
    # Still a valid safetensors file: the same names, blobs as U8, the metadata kept.
    with st.safe_open(str(packed), "np") as f:
        assert sorted(f.keys()) == sorted(st.load_file(str(st_file)))
        meta = f.metadata()
        assert meta["model"] == "SmolLM2-135M" and meta["note"] == "test" and "kvzip.header" in meta
        assert f.get_tensor("positions").dtype == np.int64 and f.get_tensor("scale").dtype == np.uint8
    status, _, _ = run(capsys, "decompress", packed, back)
    assert status == EXIT_OK
    assert back.read_bytes() == st_file.read_bytes()


def test_info_of_an_archive(st_file, tmp_path, capsys):
    packed = tmp_path / "kv.kvz.safetensors"
    assert run(capsys, "compress", "--checksum", st_file, packed)[0] == EXIT_OK
    status, out, _ = run(capsys, "info", packed)
    assert status == EXIT_OK
    assert "html/layer00.k" in out and "as is" in out and "compressed safetensors" in out
    status, out, _ = run(capsys, "info", "--json", packed)
    doc = json.loads(out)
    t = doc["tensors"]
    assert t["html/layer00.k"]["compressed"] and t["html/layer00.k"]["checksum"]
    assert t["html/layer00.k"]["dtype"] == "bfloat16" and t["html/layer00.k"]["shape"] == [3, 64, 64]
    assert 1.25 < t["html/layer00.k"]["ratio"] < 4 / 3
    assert t["scale"]["dtype"] == "float32" and t["positions"] == {
        "compressed": False, "dtype": "I64", "shape": [50], "raw_bytes": 400, "compressed_bytes": 400}
    assert doc["metadata"] == {"model": "SmolLM2-135M", "note": "test"}
    assert doc["raw_bytes"] == sum(v["raw_bytes"] for v in t.values())


def test_npy_round_trip_and_info(tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((40, 33)).astype(np.float16)
    src, blob, back = tmp_path / "x.npy", tmp_path / "x.kvz", tmp_path / "back.npy"
    np.save(src, x)
    assert run(capsys, "compress", src, blob)[0] == EXIT_OK
    status, out, _ = run(capsys, "info", blob)
    assert status == EXIT_OK and "float16" in out and "[40, 33]" in out and "checksum    no" in out
    doc = json.loads(run(capsys, "info", "--json", blob)[1])
    assert doc["shape"] == [40, 33] and doc["pipeline"][-1]["id"] == "serialize" and doc["escape_rate"] >= 0
    assert run(capsys, "decompress", blob, back)[0] == EXIT_OK
    np.testing.assert_array_equal(np.load(back), x)


def test_bfloat16_npy_needs_its_dtype(tmp_path, capsys):
    x = load_sample("code")["code/layer03.v"]
    src, blob, back = tmp_path / "kv.npy", tmp_path / "kv.kvz", tmp_path / "back.raw"
    np.save(src, x)  # NumPy writes bfloat16 as 2-byte void items
    status, _, err = run(capsys, "compress", src, blob)
    assert status == EXIT_WRONG_KIND and "--dtype bf16" in err and len(err.strip().splitlines()) == 1
    assert run(capsys, "compress", "--dtype", "bf16", src, blob)[0] == EXIT_OK
    assert json.loads(run(capsys, "info", "--json", blob)[1])["dtype"] == "bfloat16"
    assert run(capsys, "decompress", blob, back)[0] == EXIT_OK
    assert back.read_bytes() == x.tobytes()


def test_raw_file_round_trip(tmp_path, capsys):
    bits = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("prose").values()])[:12345]
    src, blob, back = tmp_path / "kv.bin", tmp_path / "kv.kvz", tmp_path / "kv.out"
    src.write_bytes(bits.tobytes())
    status, _, err = run(capsys, "compress", src, blob)
    assert status == EXIT_WRONG_KIND and "--dtype" in err
    assert run(capsys, "compress", "--dtype", "bf16", src, blob)[0] == EXIT_OK
    assert blob.stat().st_size < 0.8 * src.stat().st_size
    assert run(capsys, "decompress", blob, back)[0] == EXIT_OK
    assert back.read_bytes() == src.read_bytes()
    src.write_bytes(bits.tobytes()[:-1])  # not a whole number of values
    assert run(capsys, "compress", "--force", "--dtype", "bf16", src, blob)[0] == EXIT_WRONG_KIND


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_pt_round_trip(tmp_path, capsys):
    x = torch.from_numpy(load_sample("code")["code/layer01.k"].view(np.int16).copy()).view(torch.bfloat16)
    src, blob, back = tmp_path / "kv.pt", tmp_path / "kv.kvz", tmp_path / "back.pt"
    torch.save(x, src)
    assert run(capsys, "compress", src, blob)[0] == EXIT_OK
    assert run(capsys, "decompress", blob, back)[0] == EXIT_OK
    y = torch.load(back, weights_only=True)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and torch.equal(y.view(torch.int16), x.view(torch.int16))
    torch.save({"k": x, "step": 3}, src)
    status, _, err = run(capsys, "compress", "--force", src, blob)
    assert status == EXIT_WRONG_KIND and "'step' is int" in err


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_pt_state_dict_round_trip(tmp_path, capsys):
    """A state dict: compressed tensor by tensor into an archive, restored as .pt or .safetensors."""
    st = pytest.importorskip("safetensors.torch")
    sample = load_sample("html")
    state = {name: torch.from_numpy(v.view(np.int16).copy()).view(torch.bfloat16) for name, v in sample.items()}
    state["norm"] = torch.linspace(-2, 2, 96, dtype=torch.float32).reshape(8, 12)
    state["ids"] = torch.arange(10, dtype=torch.int64)
    src, packed = tmp_path / "model.pt", tmp_path / "model.kvz.safetensors"
    torch.save(state, src)
    assert run(capsys, "compress", src, packed)[0] == EXIT_OK
    assert packed.stat().st_size < 0.8 * sum(t.numel() * t.element_size() for t in state.values())
    doc = json.loads(run(capsys, "info", "--json", packed)[1])
    assert doc["tensors"]["html/layer00.k"]["compressed"] and not doc["tensors"]["ids"]["compressed"]
    for out in (tmp_path / "back.pt", tmp_path / "back.safetensors"):
        assert run(capsys, "decompress", packed, out)[0] == EXIT_OK
        back = torch.load(out, weights_only=True) if out.suffix == ".pt" else st.load_file(str(out))
        assert list(back) == list(state)
        for name, t in state.items():
            assert back[name].dtype == t.dtype and back[name].shape == t.shape
            assert torch.equal(back[name].view(torch.uint8) if t.dtype != torch.bool else back[name],
                               t.view(torch.uint8) if t.dtype != torch.bool else t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back.pt", "back.safetensors", "model.kvz.safetensors",
                                                           "model.pt"]


def test_errors_have_one_line_and_a_status(st_file, tmp_path, capsys):
    x = np.ones(1000, np.float32)
    np.save(tmp_path / "x.npy", x)
    blob = tmp_path / "x.kvz"
    assert run(capsys, "compress", tmp_path / "x.npy", blob)[0] == EXIT_OK
    cases = [
        (("compress", tmp_path / "missing.npy", tmp_path / "o"), EXIT_NO_FILE, "no such file"),
        (("decompress", tmp_path / "missing.kvz", tmp_path / "o"), EXIT_NO_FILE, "no such file"),
        (("info", tmp_path / "missing.kvz"), EXIT_NO_FILE, "no such file"),
        (("info", st_file), EXIT_WRONG_KIND, "did not compress"),
        (("info", tmp_path / "x.npy"), EXIT_WRONG_KIND, "not a kvzip file"),
        (("decompress", st_file, tmp_path / "o"), EXIT_WRONG_KIND, "did not compress"),
        (("decompress", tmp_path / "x.npy", tmp_path / "o"), EXIT_WRONG_KIND, "not a kvzip file"),
        (("compress", blob, tmp_path / "o"), EXIT_WRONG_KIND, "kvzip blob already"),
        (("compress", tmp_path / "x.npy", blob), EXIT_FAILED, "exists"),
        (("compress", "--force", blob, blob), EXIT_FAILED, "the same file"),
    ]
    cut = tmp_path / "cut.kvz"
    cut.write_bytes(blob.read_bytes()[:-40])
    cases += [(("info", cut), EXIT_CORRUPT, "corrupt file"), (("decompress", cut, tmp_path / "o"), EXIT_CORRUPT,
                                                               "corrupt file")]
    for argv, want, text in cases:
        status, _, err = run(capsys, *argv)
        assert status == want, (argv, err)
        assert text in err and len(err.strip().splitlines()) == 1 and err.startswith(f"kvzip {argv[0]}: error:")
    assert not (tmp_path / "o").exists()


def test_a_corrupt_archive_is_refused(st_file, tmp_path, capsys):
    packed = tmp_path / "kv.kvz.safetensors"
    assert run(capsys, "compress", "--checksum", st_file, packed)[0] == EXIT_OK
    data = bytearray(packed.read_bytes())
    data[-3000] ^= 0x40  # inside the last blob's payload: its checksum fails
    packed.write_bytes(bytes(data))
    status, _, err = run(capsys, "decompress", packed, tmp_path / "back.safetensors")
    assert status == EXIT_CORRUPT and "checksum" in err
    assert not (tmp_path / "back.safetensors").exists()
    assert run(capsys, "compress", packed, tmp_path / "again")[0] == EXIT_WRONG_KIND


def test_bench_cpu_table_and_json(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    status, text, _ = run(capsys, "bench", "--device", "cpu", "--mib", "1", "--repeat", "1", "--json", out)
    assert status == EXIT_OK
    rows = json.loads(out.read_text())["rows"]
    names = [r["method"] for r in rows]
    assert any(n.startswith("kvzip, 1 thread") for n in names) and "numpy copy" in names
    assert any("checksum" in n for n in names)
    assert all(r["exact"] for r in rows)
    kvz = next(r for r in rows if r["method"].startswith("kvzip"))
    assert 1.25 < kvz["ratio"] < 4 / 3 and kvz["encode_MBps"] > 0
    for r in rows:
        assert r["method"] in text
    doc = json.loads(out.read_text())
    assert doc["cores"] >= 1 and "numba" in doc["versions"] and doc["date"]


def test_every_option_has_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, f"kvzip {name} {action.option_strings or action.dest} has no help"


def test_version_and_python_m(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("kvzip ")
    out = subprocess.run([sys.executable, "-m", "kvzip", "--help"], capture_output=True, text=True, check=True)
    for command in ("compress", "decompress", "info", "calibrate", "demo", "bench"):
        assert command in out.stdout


def _echo(argv):
    print("delegated", argv)
    return 7


def test_delegated_command_gets_its_arguments(monkeypatch, capsys):
    monkeypatch.setitem(cli.DELEGATED, "echo-args", ("print the arguments", f"{__name__}:_echo"))
    assert main(["echo-args", "--help", "x"]) == 7
    assert "delegated ['--help', 'x']" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "echo-args" in capsys.readouterr().out


def test_calibrate_reports_progress():
    import kvzip

    tensors = list(load_sample("code").values())
    sizes = []
    kvzip.calibrate(tensors, progress=sizes.append)
    assert sizes == [x.nbytes for x in tensors]


def test_bench_cuda_without_a_gpu_says_so(capsys):
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        pytest.skip("a CUDA GPU is here: the GPU bench would run in full")
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        pass
    assert main(["bench", "--device", "cuda", "--quick"]) == 2
    assert "needs a CUDA GPU and CuPy" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["ratio", "storage"])
def test_compress_ratio_mode(st_file, tmp_path, capsys, mode):
    """--mode ratio / storage: a smaller archive of the same tensors, restored byte for byte by a
    plain decompress (the blobs record their pipeline); --codebook with it is bad usage."""
    speed, ratio, back = tmp_path / "speed.safetensors", tmp_path / "ratio.safetensors", tmp_path / "back.safetensors"
    assert run(capsys, "compress", st_file, speed)[0] == EXIT_OK
    assert run(capsys, "compress", "--mode", mode, st_file, ratio)[0] == EXIT_OK
    assert ratio.stat().st_size < speed.stat().st_size
    assert run(capsys, "decompress", ratio, back)[0] == EXIT_OK
    assert back.read_bytes() == st_file.read_bytes()
    status, _, err = run(capsys, "compress", "--mode", mode, "--codebook", "bf16-kv", st_file, tmp_path / "x")
    assert status == cli.EXIT_USAGE and "--codebook" in err
