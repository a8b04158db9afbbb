"""The execution seams hold (issue: architecture step 2): every execution-path choice lives in
``_auto.py`` or ``Execution`` (``_execution.py``). Read from the source with ``ast``: no module
elsewhere asks for the backend, and none tests a value against a strategy class."""

import ast
import inspect
from pathlib import Path

import equinox as eqx

import csa_eqx

PACKAGE_ROOT = Path(csa_eqx.__file__).resolve().parent
CHOOSERS = {"_auto.py", "_execution.py"}


def library_sources() -> dict[str, ast.AST]:
    """Every library module outside the choosers and the demo application, parsed."""
    out = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        rel = path.relative_to(PACKAGE_ROOT)
        if rel.parts[0] == "demo" or rel.name in CHOOSERS:
            continue
        out[str(rel)] = ast.parse(path.read_text(), str(path))
    return out


def strategy_classes() -> set[str]:
    """Names of the public strategy families' classes: every class exported by ``csa_eqx``
    that derives from one of its ``Abstract*`` bases (the bases included)."""
    bases = {
        obj
        for name, obj in vars(csa_eqx).items()
        if name.startswith("Abstract") and inspect.isclass(obj) and issubclass(obj, eqx.Module)
    }
    return {
        name
        for name, obj in vars(csa_eqx).items()
        if inspect.isclass(obj) and any(issubclass(obj, base) for base in bases)
    }


def _names(node: ast.AST) -> set[str]:
    """Class names an ``isinstance`` second argument refers to (names, attributes, tuples,
    ``X | Y`` unions)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(e) for e in node.elts))
    if isinstance(node, ast.BinOp):
        return _names(node.left) | _names(node.right)
    return set()


def test_the_families_are_found():
    found = strategy_classes()
    for name in ("AbstractSelection", "StreamingSelection", "AbstractPicks", "AbstractPlacement"):
        assert name in found


def test_no_backend_choice_outside_the_choosers():
    hits = [
        f"{rel}:{node.lineno}"
        for rel, tree in library_sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute | ast.Name)
        and (node.attr if isinstance(node, ast.Attribute) else node.id) == "default_backend"
    ]
    assert hits == [], f"jax.default_backend() outside {sorted(CHOOSERS)}: {hits}"


def test_no_strategy_isinstance_outside_the_choosers():
    strategies = strategy_classes()
    hits = [
        f"{rel}:{node.lineno}"
        for rel, tree in library_sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and len(node.args) == 2
        and _names(node.args[1]) & strategies
    ]
    assert hits == [], f"strategy isinstance checks outside {sorted(CHOOSERS)}: {hits}"
