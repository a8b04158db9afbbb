"""The documentation builds with ``mkdocs build --strict`` (broken links, missing API objects and
docstring warnings all fail), every code block of README.md and the docs pages runs (or says
why not) and prints what the page says it prints, and the examples compute what they claim."""

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import NamedTuple

import equinox as eqx
import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the API reference is generated from the docstrings, not just headings
    layers = (site / "api" / "layers" / "index.html").read_text()
    assert 'id="csa_eqx.V4Attention.__call__"' in layers
    assert "segment_ids" in layers
    sharding = (site / "api" / "sharding" / "index.html").read_text()
    assert 'id="csa_eqx.ShardedSelection"' in sharding
    execution = (site / "api" / "execution" / "index.html").read_text()
    assert 'id="csa_eqx.AutoSelection"' in execution
    for page in ("concepts", "memory", "multihost", "hf", "benchmarks"):
        assert (site / page / "index.html").exists(), page
    assert 'class="mermaid"' in (site / "concepts" / "index.html").read_text()


# Fenced blocks (docs/testing.md, "The docs test"): every ```python block of README.md and
# docs/**/*.md runs, in page order, in one namespace per page (in a fresh working directory);
# a ```text block right after an `<!-- output -->` marker must equal what the python block
# before it printed; any block right after `<!-- not run: REASON -->` is skipped for that
# stated reason; every other block with a shell language must carry such a marker; ```text and
# ```mermaid blocks are output and diagrams, not code.
FENCE = re.compile(r"^([ ]*)```([\w+-]*)[^\n]*\n(.*?)^\1```[ ]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(not run|output)\s*:?\s*(.*?)\s*-->\s*$", re.S)
SHELL = {"bash", "sh", "shell", "console"}
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if "site" not in p.parts
)


class Block(NamedTuple):
    lang: str
    body: str
    line: int
    marker: str | None  # "not run" / "output" / None
    reason: str


def blocks(page: str) -> list[Block]:
    """The fenced blocks of ``page`` with the marker (and reason) right before each."""
    text = (ROOT / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip()
        marker = MARKER.search(before[-400:])
        kind, reason = (marker.group(1), marker.group(2)) if marker else (None, "")
        body = textwrap.dedent(m.group(3))
        out.append(Block(m.group(2), body, text.count("\n", 0, m.start()) + 1, kind, reason))
    return out


_RUNS: dict[str, dict] = {}


def run_page(page: str) -> dict:
    """Run the python blocks of ``page`` (as the module docstring says) once per test process;
    **Returns:** the namespace, and ``"__outputs__"``: each block's printed text by line."""
    if page in _RUNS:
        return _RUNS[page]
    namespace: dict = {"__name__": "__docs__"}
    outputs = {}
    cwd = os.getcwd()
    os.chdir(tempfile.mkdtemp(prefix="docs-"))
    try:
        for block in blocks(page):
            if block.lang != "python" or block.marker == "not run":
                continue
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(block.body, f"{page}:{block.line}", "exec"), namespace)
            outputs[block.line] = printed.getvalue()
    finally:
        os.chdir(cwd)
    namespace["__outputs__"] = outputs
    _RUNS[page] = namespace
    return namespace


def run_python_blocks(page: str) -> dict:
    """The namespace of ``docs/<page>``'s python blocks, run once (``run_page``)."""
    return run_page(f"docs/{page}")


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs_or_says_why_not(page):
    """Every fenced block of the page is run (python), checked (an output block against what
    the block before it printed), a diagram or output text, or skipped with a stated reason."""
    found = blocks(page)
    for block in found:
        where = f"{page}:{block.line} ({block.lang or 'no language'})"
        assert block.lang, f"{where}: a fenced block needs a language (python, text, bash, ...)"
        if block.marker == "not run":
            assert block.reason, f"{where}: '<!-- not run -->' must state its reason"
        elif block.lang in SHELL:
            raise AssertionError(f"{where}: a shell block must be run or say why not")
    if not any(b.lang == "python" and b.marker != "not run" for b in found):
        return
    outputs = run_page(page)["__outputs__"]
    last = None
    for block in found:
        if block.lang == "python" and block.marker != "not run":
            last = block
        if block.marker == "output":
            assert last is not None, f"{page}:{block.line}: an output block follows no python"
            assert outputs[last.line].strip() == block.body.strip(), (
                f"{page}:{block.line}: the block at line {last.line} printed\n{outputs[last.line]}"
            )
    jax.clear_caches()


def test_readme_links_resolve():
    """README.md is not part of the site (whose links ``mkdocs build --strict`` checks): each of
    its relative links names a file of the checkout and, with ``#anchor``, one of that page's
    headings (the site's anchors: python-markdown's ``toc`` slugs)."""
    from markdown.extensions.toc import slugify

    links = re.findall(r"\]\((?!https?:)([^)#]*)(?:#([^)]*))?\)", (ROOT / "README.md").read_text())
    assert len(links) > 5
    for path, anchor in links:
        page = ROOT / (path or "README.md")
        assert page.exists(), f"README.md links {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+?)\s*$", page.read_text(), re.M)
            assert anchor in {slugify(h, "-") for h in headings}, f"README.md: {path}#{anchor}"


def test_home_page_examples_run():
    ns = run_page("docs/index.md")
    assert ns["y"].shape == (2, 32, 64)
    selection = np.asarray(ns["aux"]["selection"])
    assert selection.shape == (2, 32, 4)
    assert np.all((selection[0, -1] >= 0) & (selection[0, -1] < 32 // 4))


def test_decoding_example_matches_full_forward():
    ns = run_python_blocks("concepts.md")
    np.testing.assert_allclose(ns["y_incremental"], ns["y_full"], rtol=1e-5, atol=1e-5)


def test_execution_example_runs():
    import csa_eqx as ce

    ns = run_python_blocks("api/execution.md")
    assert isinstance(ns["layer"].execution.selection, ce.ShardedSelection)
    assert isinstance(ns["faster"].execution.selection, ce.AutoSelection)


def test_reliability_table_names_existing_tests():
    """Every test that docs/reliability.md cites exists, so the table cannot drift."""
    import ast

    text = (ROOT / "docs" / "reliability.md").read_text()
    cited = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text))
    assert len(cited) > 40
    defined: dict[str, set[str]] = {}
    for path, name in sorted(cited):
        if path not in defined:
            tree = ast.parse((ROOT / path).read_text())
            defined[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in defined[path], f"docs/reliability.md cites {path}::{name}, which is gone"


def test_scaling_examples_run():
    """docs/scaling.md's examples run on the 8 simulated devices, and its V3.2 example (data x
    context x tensor) and head-parallel V4 example (data x tensor) give the single-device
    layer's selection and output."""
    import csa_eqx as ce

    ns = run_python_blocks("scaling.md")
    assert ns["y"].shape == (1, 256, 64)
    # the single-device references run jitted (eagerly, every primitive compiles on its own)
    run = eqx.filter_jit(lambda m, x, **kw: m(x, return_aux=True, **kw))
    single = ns["v32"].with_execution(ce.Execution())
    x = np.asarray(ns["x32"])
    want_y, want_aux = run(single, x, segment_ids=ns["segments32"])
    np.testing.assert_array_equal(
        np.asarray(ns["aux32"]["selection"]), np.asarray(want_aux["selection"])
    )
    np.testing.assert_allclose(np.asarray(ns["y32"]), want_y, rtol=1e-5, atol=1e-5)
    single = ns["hp_layer"].with_execution(ce.Execution())  # the head-parallel example
    want_y, want_aux = run(single, ns["x_hp"])
    np.testing.assert_array_equal(ns["aux_hp"]["selection"], want_aux["selection"])
    np.testing.assert_allclose(np.asarray(ns["y_hp"]), want_y, rtol=1e-5, atol=1e-5)


def test_v41_examples_run():
    """docs/v41.md's stack runs: the by-hand calls give the stack's layer-2 output, and the
    stack under context x head parallelism (4 x 2 devices) the single-device outputs."""
    ns = run_python_blocks("v41.md")
    np.testing.assert_allclose(ns["y2"], ns["ys"][2], rtol=1e-6, atol=1e-6)
    assert len(ns["ys_sharded"]) == len(ns["ys"]) == 6
    for got, want in zip(ns["ys_sharded"], ns["ys"], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_training_recipe_trains():
    """docs/training.md's three stages lower the task loss, keep the KL loss finite and, in the
    indexer-only stage, change the indexer's parameters alone (its printed gradient claims are
    checked as the page's output)."""
    ns = run_page("docs/training.md")
    history = ns["history"]
    assert [h[0] for h in history] == ["dense"] * 8 + ["indexer-only"] * 4 + ["sparse"] * 8
    assert history[-1][1] < history[0][1]
    assert all(np.isfinite(h[2]) for h in history)
    frozen = [h[1] for h in history if h[0] == "indexer-only"]
    assert max(frozen) - min(frozen) < 1e-6  # the task loss does not move with the rest frozen
