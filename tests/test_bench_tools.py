"""The kernel-development tools in benchmarks/ that run without a GPU: tree_ab.py's interleaved
A/B of two source trees, and sass_loops.py's loops of a kernel's SASS (where NVRTC and nvdisasm
are installed, as CI installs them)."""
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))


def _tree(root: Path, value: float) -> Path:
    (root / "kvzip").mkdir(parents=True)
    (root / "kvzip" / "__init__.py").write_text(f"FIGURE = {value}\n")
    return root


def test_tree_ab_runs_each_tree_in_turn_and_reports_medians(tmp_path, capsys):
    import tree_ab

    a, b = _tree(tmp_path / "a", 2.0), _tree(tmp_path / "b", 1.0)
    out = tmp_path / "ab.json"
    command = [sys.executable, "-c", "import kvzip; print('wall x:', kvzip.FIGURE, 'ms'); print('wall x:', 5, 'ms')"]
    result = tree_ab.main([str(a), str(b), "--rounds", "3", "--match", r"wall (\w+): ([\d.]+) ms", "--out", str(out),
                           "--", *command])
    assert result["medians"]["x"] == {"A": 2.0, "B": 1.0, "B/A": 0.5}
    assert result["medians"]["x #2"]["B/A"] == 1.0  # a label seen twice in a run is numbered
    assert len(result["runs"]["A"]) == len(result["runs"]["B"]) == 3
    rounds = [line.split()[2] for line in capsys.readouterr().out.splitlines() if line.startswith("round")]
    assert rounds == ["A:", "B:", "B:", "A:", "A:", "B:"]  # the order alternates a round
    assert out.exists()


def test_tree_ab_refuses_a_missing_command_and_a_tree_without_kvzip(tmp_path):
    import tree_ab

    a = _tree(tmp_path / "a", 1.0)
    with pytest.raises(SystemExit):
        tree_ab.main([str(a), str(a), "--match", "(x) (1)"])
    with pytest.raises(SystemExit):
        tree_ab.main([str(a), str(tmp_path), "--match", "(x) (1)", "--", "true"])


def _sass_tools() -> bool:
    if importlib.util.find_spec("cuda.bindings") is None:
        return False
    import sass_loops

    try:
        sass_loops.nvdisasm()
        sass_loops.compile_cubin({"code": "__global__ void k() {}", "names": ["k"], "options": []})
    except (SystemExit, RuntimeError, OSError):
        return False
    return True


@pytest.mark.skipif(not _sass_tools(), reason="needs NVRTC (nvidia-cuda-nvrtc, cuda-bindings) and nvdisasm")
def test_sass_loops_finds_a_kernels_loop_and_its_source_lines():
    import sass_loops

    code = ("__global__ void k(float* x, int n) {\n"
            "    for (int i = threadIdx.x; i < n; i += blockDim.x)\n"
            "        x[i] = x[i] * 2.0f + 1.0f;\n"
            "}\n")
    cubin, lowered = sass_loops.compile_cubin({"code": code, "names": ["k"], "options": ["-lineinfo"]}, log=[])
    # NVRTC's empty log is one byte: read into a bytes object it would overwrite CPython's shared b" "
    assert bytes([32]).decode() == chr(32)
    sass = sass_loops.function_sass(cubin, lowered["k"])
    assert sass and all(len(row) == 4 for row in sass)
    spans = sass_loops.loops(sass)
    assert spans, "the grid-stride loop has a backward branch"
    first, last = spans[-1]
    lines = {where[1] for _, _, where, _ in sass[first:last + 1]}
    assert 3 in lines  # the loop body's source line
    blocks = sass_loops.blocks(sass[first:last + 1])
    assert blocks[0][0] == 0 and blocks[-1][1] == last - first
