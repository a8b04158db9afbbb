"""Test set-up: 8 simulated CPU devices and float32 reference numerics; ``--torch-free`` selects
the tests that need neither torch nor transformers (the ``hf`` extra)."""

import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU thread pool has max(cores, devices) threads, too few for devices that wait in two
# collectives at once (``csa_eqx.demo.cli._simulated_devices``); the child processes inherit it
os.environ.setdefault("PJRT_NPROC", "32")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402

# Modules that import torch / transformers (mostly through csa_eqx.testing) when they load:
# every test in them carries the ``torch`` marker. A test elsewhere that needs torch says so
# with ``@pytest.mark.torch``. A module missing here fails to import in a ``--torch-free`` run
# on an interpreter without torch, so the list cannot silently shrink the torch-free set.
TORCH_MODULES = frozenset(
    {
        "test_chunking.py",
        "test_decode_hf.py",
        "test_deepseek_reference.py",
        "test_hf_loading.py",
        "test_loss.py",
        "test_loss_v32.py",
        "test_released_checkpoint.py",
        "test_v32.py",
        "test_v4_parity.py",
    }
)


def pytest_addoption(parser):
    parser.addoption(
        "--torch-free",
        action="store_true",
        help="run only the tests that need no torch: leave out the modules of TORCH_MODULES "
        "(not collected) and deselect the tests marked `torch`; the summary lists both",
    )


def pytest_ignore_collect(collection_path, config):
    if config.getoption("torch_free") and collection_path.name in TORCH_MODULES:
        return True
    return None


# Modules that `make test` runs in one half only (it names the half in CSA_EQX_TEST_HALF; a
# pytest run without it runs them all): the application-level modules, whose results the JAX
# version does not change beyond what the library's own modules test on both. The JAX-facing
# ones (docs, notebooks, the CLI, the trainer's fault handling) on the newest JAX; the
# benchmarks (they time HF's layer with torch) and the seed sweep on 3.11. docs/testing.md,
# "Modules run once".
ONE_HALF = {
    "test_docs.py": "py312",
    "test_notebooks.py": "py312",
    "test_cli.py": "py312",
    "test_train_faults.py": "py312",
    "test_benchmarks.py": "py311",
    "test_demo_seeds.py": "py311",
    # every strategy under every transformation at once (slow: kernels in interpret mode), on
    # the TPU's JAX; the JAX-version-sensitive parts (check_vma, custom_vmap) also run in both
    # halves through tests/test_docs.py (py312) and the library's own sharded modules
    "test_conformance_transforms.py": "py311",
}


# Every other module's tests `make test` deals between the halves, one unit at a time in
# collection order within each module: the first unit on 3.11, the second on 3.12, and so on.
# A unit is one test (each case of a parametrised test counts as one), or, where the module
# names a parameter or a fixture in ``DEALT_TOGETHER``, every test with the same value of that
# parameter or using that fixture: they share a result the module computes once (a conformance
# member's one program, a single-device reference), which dealt apart each half computed again.
# Every test runs once, on one JAX; every module runs on both. A test that needs torch runs on
# 3.11 (the 3.12 half has no torch), outside the count; one marked ``xla_fusion_emitters``
# (XLA's default CPU emitters, which the 3.11 half's code generation leaves out) on 3.12.
# docs/testing.md, "Tests dealt between the halves".
HALVES = ("py311", "py312")


def _unit(item) -> object:
    """The unit ``item`` is dealt in: its module's first ``DEALT_TOGETHER`` name that is one
    of its parameters (with the value) or fixtures, else the test alone."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    for name in getattr(item.module, "DEALT_TOGETHER", ()):
        if name in params:
            return name, str(params[name])
        if name in item.fixturenames:
            return name
    return item.nodeid


def _dealt_halves(items) -> dict:
    """``{nodeid: half}`` for the tests of the modules outside ``ONE_HALF``."""
    dealt, units = {}, {}
    for item in items:
        module = item.path.name
        if module in ONE_HALF:
            continue
        if _needs_torch(item):
            dealt[item.nodeid] = HALVES[0]
            continue
        if item.get_closest_marker("xla_fusion_emitters"):
            dealt[item.nodeid] = HALVES[1]
            continue
        seen = units.setdefault(module, {})
        i = seen.setdefault(_unit(item), len(seen))
        dealt[item.nodeid] = HALVES[i % 2]
    return dealt


def _needs_torch(item) -> bool:
    return item.path.name in TORCH_MODULES or item.get_closest_marker("torch") is not None


def _other_half(item, half: str | None, dealt: dict) -> bool:
    if half is None:
        return False
    return ONE_HALF.get(item.path.name, dealt.get(item.nodeid, half)) != half


# Each module's share of a run (seconds of test time on the 2-core machine, measured: a
# fresh-clone `bash .ci/run` of c7c4d4d: the 3.11 half, then the 3.12 half's own modules;
# `python tools/test_timing.py build/test/py311.xml build/test/py312.xml --write-weights
# tests/module_seconds.json`
# refreshes them from a run's JUnit XML). `make test` hands whole modules to its two workers
# in this order, slowest first (xdist's `--no-loadscope-reorder` keeps the collection order),
# so that no long module starts last and runs alone while the other worker idles. A module
# missing from the file comes after the listed ones, in collection order.
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")


def _module_order(items) -> None:
    seconds = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}
    items.sort(key=lambda item: -seconds.get(item.path.name, 0.0))  # stable within a module


def pytest_collection_modifyitems(config, items):
    _module_order(items)
    half = os.environ.get("CSA_EQX_TEST_HALF")
    dealt = _dealt_halves(items)
    elsewhere = [item for item in items if _other_half(item, half, dealt)]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if not _other_half(item, half, dealt)]
    for item in items:
        if item.path.name in TORCH_MODULES:
            item.add_marker(pytest.mark.torch)
    if config.getoption("torch_free"):
        needs_torch = [item for item in items if item.get_closest_marker("torch")]
        if needs_torch:
            config.hook.pytest_deselected(items=needs_torch)
            items[:] = [item for item in items if not item.get_closest_marker("torch")]


def pytest_terminal_summary(terminalreporter, config):
    half = os.environ.get("CSA_EQX_TEST_HALF")
    if half is not None:
        elsewhere = sorted(name for name, where in ONE_HALF.items() if where != half)
        terminalreporter.write_line(
            f"CSA_EQX_TEST_HALF={half}: deselected here, run in the other half: "
            + ", ".join(elsewhere)
            + "; and every other test of the other modules (the tests dealt between the halves)"
        )
    if config.getoption("torch_free"):
        terminalreporter.write_line(
            f"--torch-free: {len(TORCH_MODULES)} modules not collected (they import torch): "
            + ", ".join(sorted(TORCH_MODULES))
            + "; the tests marked `torch` elsewhere are deselected"
        )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each module's compiled programs when it ends: a long run otherwise keeps every
    executable of the suite alive in one process."""
    yield
    jax.clear_caches()
