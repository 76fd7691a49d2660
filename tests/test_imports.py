"""kvzip's modules import each other without cycles, counting imports made inside functions too
(a lazy import that closes a cycle is still a cycle a reader must untangle).  Modules are named as
installed: the top-level stages/ and codebooks/ directories are kvzip.stages and kvzip.codebooks."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvzip": ROOT / "kvzip", "kvzip.stages": ROOT / "stages", "kvzip.codebooks": ROOT / "codebooks"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, where in PACKAGES.items():
        for path in where.rglob("*.py"):
            parts = path.relative_to(where).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The kvzip modules `name` imports.  `from P import x` counts as importing P.x when that is
    a module, else P; a relative import resolves against the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in out if m in modules and m != name}


def _cycle(graph: dict) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["kvzip"], "the import graph is empty: the scan is broken"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_gpu_runtime_never_imports_the_framework_interop():
    """kvzip/gpu is handed device pointers and its caller (an allocator and exporter): neither it
    nor anything it imports, directly or not, imports kvzip.arrays (DLPack, torch, JAX)."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    for start in (m for m in graph if m.startswith("kvzip.gpu")):
        seen, todo = {start}, [start]
        while todo:
            for n in graph[todo.pop()] - seen:
                assert n != "kvzip.arrays", f"{start} reaches kvzip.arrays"
                seen.add(n)
                todo.append(n)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_import_from_the_clone_root():
    """What a newcomer pasting the README example in the clone root runs."""
    code = "import kvzip, numpy as np; b = kvzip.compress(np.ones(64, np.float32)); " \
           "assert (kvzip.decompress(b) == 1).all(); print(kvzip.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()).resolve() == ROOT / "kvzip" / "__init__.py"
