"""The execution seams hold (issue: architecture steps 2 and 4): every execution-path choice
lives in a family's chooser (its ``auto.py``) or ``Execution`` (``_execution.py``), every
backend question in ``_backend.py``. Read from the source with ``ast``: no module elsewhere asks
for the backend, and none tests a value against a strategy class."""

import ast
import inspect
from pathlib import Path

import equinox as eqx

import csa_eqx

PACKAGE_ROOT = Path(csa_eqx.__file__).resolve().parent
CHOOSERS = {"auto.py", "_execution.py", "_backend.py"}
BACKEND = "_backend.py"  # the one module that asks jax.default_backend()


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


def test_only_the_backend_module_asks_for_the_backend():
    hits = [
        f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno}"
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if path.name != BACKEND and path.relative_to(PACKAGE_ROOT).parts[0] != "demo"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute | ast.Name)
        and (node.attr if isinstance(node, ast.Attribute) else node.id) == "default_backend"
    ]
    assert hits == [], f"jax.default_backend() outside {BACKEND}: {hits}"


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


# --- presence-dispatch: a strategy never asks whether an optional input is there ------------

# the selection and indexer-loss strategies (the pre-filter's own module, candidates.py, is not one)
STRATEGY_MODULES = tuple(
    f"_selection/{name}.py"
    for name in (
        "base",
        "dense",
        "streaming",
        "gathered",
        "triton",
        "mosaic",
        "row_chunks",
        "sharded",
    )
) + ("_loss/",)
VISIBILITIES = {"Visibility", "CandidateVisibility"}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` of a name / attribute chain ('' for anything else)."""
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _presence_tests(test: ast.AST) -> list[str]:
    """The ``x is None`` / ``x is not None`` comparisons of a condition whose ``x`` names a
    candidate filter (``...candidates``, ``candidate_*``)."""
    hits = []
    for node in ast.walk(test):
        if not isinstance(node, ast.Compare) or len(node.ops) != 1:
            continue
        if not isinstance(node.ops[0], ast.Is | ast.IsNot):
            continue
        sides = (node.left, node.comparators[0])
        if any(isinstance(s, ast.Constant) and s.value is None for s in sides):
            named = " ".join(_dotted(s) for s in sides)
            if "candidate" in named:
                hits.append(named.strip())
    return hits


def presence_dispatches(tree: ast.AST, strategy_module: bool) -> list[str]:
    """Path choices on whether V4.1's candidate filter is present, in one module's ``tree``:

    - a branch (``if``, conditional expression) on ``... candidates is (not) None`` whose body
      does more than raise (a check that refuses bad wiring is not a path choice);
    - ``isinstance`` against a visibility class outside such a refusal (which visibility a
      problem has is the choosers' business; a strategy may refuse one it cannot serve);
    - in a selection or loss strategy module (``strategy_module``), any access to a
      ``.candidates`` / ``.candidate_block_size`` attribute: the filter reaches a strategy only
      through the visibility's calls.
    """
    hits, refusals = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp):
            body = node.body if isinstance(node, ast.If) else [node.body]
            if all(isinstance(b, ast.Raise) for b in body):  # a refusal: its test is a check
                refusals.update(id(n) for n in ast.walk(node.test))
            else:
                hits += [f"{node.lineno}: branch on {h}" for h in _presence_tests(node.test)]
    for node in ast.walk(tree):
        if id(node) in refusals:
            continue
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
            and _names(node.args[1]) & VISIBILITIES
        ):
            hits.append(f"{node.lineno}: isinstance against a visibility")
        elif (
            strategy_module
            and isinstance(node, ast.Attribute)
            and node.attr in ("candidates", "candidate_block_size")
        ):
            hits.append(f"{node.lineno}: .{node.attr} in a strategy")
    return hits


def test_no_presence_dispatch_outside_the_choosers():
    hits = [
        f"{rel}:{hit}"
        for rel, tree in library_sources().items()
        for hit in presence_dispatches(tree, rel.startswith(STRATEGY_MODULES))
    ]
    assert hits == [], f"candidate presence-dispatch outside {sorted(CHOOSERS)}: {hits}"


def test_the_presence_guard_catches_a_deliberate_dispatch():
    """The guard is not vacuous: the dispatch the candidate filter used to need in every
    strategy (and its visibility form) is caught, a refusing check is not."""
    dense = (PACKAGE_ROOT / "_selection" / "dense.py").read_text()
    dispatch = dense.replace(
        "scores = problem.scores(*problem.queries(), problem.keys)\n",
        "scores = problem.scores(*problem.queries(), problem.keys)\n"
        "        if problem.visibility.candidates is not None:\n"
        "            scores = scores + 0\n",
        1,
    )
    assert dispatch != dense
    assert presence_dispatches(ast.parse(dense), True) == []
    caught = presence_dispatches(ast.parse(dispatch), True)
    assert any("branch on problem.visibility.candidates" in h for h in caught), caught
    assert any(".candidates in a strategy" in h for h in caught), caught
    layer = "def f(shared, v):\n    if isinstance(v, CandidateVisibility):\n        return 1\n"
    assert presence_dispatches(ast.parse(layer), False) == ["2: isinstance against a visibility"]
    check = "def f(shared):\n    if shared.candidates is None:\n        raise ValueError\n"
    assert presence_dispatches(ast.parse(check), False) == []
    refusal = "def f(v):\n    if not isinstance(v, Visibility):\n        raise TypeError\n"
    assert presence_dispatches(ast.parse(refusal), True) == []
