"""Package structure: the attention library stays apart from its demo, and no module of the
package imports another in a cycle (imports read from the source with ``ast``)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import csa_eqx

PACKAGE_ROOT = Path(csa_eqx.__file__).resolve().parent


def test_library_imports_neither_optax_nor_matplotlib():
    code = (
        "import sys, csa_eqx, csa_eqx.hf, csa_eqx.presets; "
        "print(sorted(m for m in ('optax', 'matplotlib', 'csa_eqx.demo') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout


def module_files() -> dict[str, Path]:
    """Every module of the package: dotted name -> source file."""
    modules = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its source (top level,
    functions, ``TYPE_CHECKING`` blocks); ``from X import y`` counts ``X.y`` when that is a
    module, else ``X``."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            targets = [
                f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_walker_resolves_relative_and_local_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom ..a import f\nimport json\n")
    known = {"pkg", "pkg.a", "pkg.sub", "pkg.sub.b"}
    graph = {
        "pkg": imported_modules("pkg", pkg / "__init__.py", known),
        "pkg.a": imported_modules("pkg.a", pkg / "a.py", known),
        "pkg.sub": set(),
        "pkg.sub.b": imported_modules("pkg.sub.b", pkg / "sub" / "b.py", known),
    }
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    graph["pkg.sub.b"] = set()
    assert find_cycle(graph) is None


def test_no_import_cycles():
    files = module_files()
    assert {"csa_eqx", "csa_eqx.demo.train", "csa_eqx.demo.models.lm"} <= set(files)
    graph = {name: imported_modules(name, path, set(files)) for name, path in files.items()}
    cycle = find_cycle(graph)
    if cycle:
        pytest.fail("import cycle: " + " -> ".join(cycle))
