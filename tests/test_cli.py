"""The kvzip command line."""
import json
import re

import pytest

from kvzip.cli import main
from kvzip.codebook import Codebook
from kvzip.data import load_sample


@pytest.fixture
def kv_file(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "kv.safetensors"
    st.save_file(load_sample("html"), str(path))
    return path


def test_calibrate_writes_a_loadable_codebook(kv_file, tmp_path, capsys):
    out = tmp_path / "my-model.json"
    assert main(["calibrate", str(kv_file), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    cb = Codebook.from_json(out)
    assert cb.name == "my-model" and cb.format.name == "bf16"
    assert 0 in cb.exponents
    assert f"{cb.coverage:.4%}" in printed and str(out) in printed
    assert cb.provenance["sources"] == ["kv.safetensors"]
    assert json.loads(out.read_text())["exponents"] == list(cb.exponents)


def test_calibrate_options(kv_file, tmp_path, capsys):
    out = tmp_path / "cb.json"
    assert main(["calibrate", str(kv_file), str(kv_file), "-o", str(out), "--format", "bf16",
                 "--name", "twice", "--always-include"]) == 0
    cb = Codebook.from_json(out)
    assert cb.name == "twice" and cb.provenance["always_include"] == []
    assert cb.provenance["values"] == 2 * sum(x.size for x in load_sample("html").values())


def test_calibrate_errors(kv_file, tmp_path, capsys):
    out = tmp_path / "cb.json"
    assert main(["calibrate", str(tmp_path / "missing.safetensors"), "-o", str(out)]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["calibrate", str(kv_file), "-o", str(out), "--format", "fp16"]) == 1
    assert "format=fp16" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit):  # -o is required
        main(["calibrate", str(kv_file)])


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_demo_cpu_round_trips_and_reports(capsys):
    assert main(["demo", "--backend", "cpu", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "backend cpu" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("prose", "code", "html", "all")}
    assert set(rows) == {"prose", "code", "html", "all"}
    for kind, cols in rows.items():
        ratio = float(cols[4])
        assert 1.25 < ratio < 4 / 3  # real BF16 KV: close to the 16/12 ceiling
        assert cols[-1] == "yes"
    values = int(rows["prose"][1].replace(",", ""))
    assert values == sum(x.size for x in load_sample("prose").values())
    assert re.search(r"\d+\.\d+%", rows["all"][5])


def test_demo_rejects_bad_repeat():
    with pytest.raises(SystemExit):
        main(["demo", "--repeat", "0"])


def test_module_entry_point_knows_every_command():
    """python -m kvzip.cli must register all sub-commands before it runs (bench once was not)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvzip.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("calibrate", "demo", "bench"):
        assert command in out.stdout
