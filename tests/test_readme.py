"""The README's Python example runs as written (with torch installed, as the README says)."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(capsys):
    pytest.importorskip("torch")
    if not README.is_file():
        pytest.skip("no README.md next to the tests (an installed copy of the tests)")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    exec(compile(blocks[0], str(README), "exec"), {})
    ratio = float(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1.2 < ratio < 4 / 3
