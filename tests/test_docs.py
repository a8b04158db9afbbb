"""The documentation builds with ``mkdocs build --strict`` (broken links, missing API objects and
docstring warnings all fail), and the self-contained examples in the docs run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import numpy as np

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


def run_python_blocks(page: str) -> dict:
    """Run the Python blocks of ``docs/<page>`` in order, in one namespace, as written."""
    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, page
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, f"docs/{page}", "exec"), namespace)
    return namespace


def test_home_page_examples_run():
    ns = run_python_blocks("index.md")
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
