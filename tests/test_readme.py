"""The README's Python example runs as written (with torch installed, as the README says), and
docs/format.md's worked example is what its script prints."""
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


def test_format_worked_example_is_what_its_script_prints(capsys):
    """docs/format.md section 11: its script prints exactly the hex dump the section shows."""
    spec = README.parent / "docs" / "format.md"
    if not spec.is_file():
        pytest.skip("no docs/format.md next to the tests (an installed copy of the tests)")
    text = spec.read_text()
    section = text[text.index("## 11. Worked example"):text.index("## 12.")]
    script = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    shown = re.search(r"Output \((\d+) bytes\):\n\n```\n(.*?)```", section, flags=re.S)
    exec(compile(script, str(spec), "exec"), {})
    printed = capsys.readouterr().out
    assert printed == shown.group(2)
    assert len(printed.splitlines()) == -(-int(shown.group(1)) // 16)
