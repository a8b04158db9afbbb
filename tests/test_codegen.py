"""XLA's default CPU code generation gives the suite's results. ``make test`` compiles at LLVM
``-O0`` (docs/testing.md, "Code generation"), so a child process at XLA's default flags runs the
battery of ``tests/codegen_worker.py`` (a tiny V4 CSA layer: output, selection, every
gradient; the row-sharded top-k on exact ties) and this process runs it at
the suite's flags: the same selections bitwise, sharded equal to unsharded in the child, and
every float within the suite's 1e-5 of the largest value (measured: 6e-7)."""

import subprocess
import sys
from pathlib import Path

import codegen_worker
import numpy as np
from child_env import child_env

CODEGEN_FLAGS = (
    "--xla_backend_optimization_level",
    "--xla_cpu_parallel_codegen_split_count",
    "--xla_cpu_use_fusion_emitters",
)


def default_codegen_env() -> dict[str, str]:
    """This run's environment with XLA's code-generation flags and the compilation cache
    left out (the child compiles every program at the defaults)."""
    env = child_env(JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(
        f for f in env["XLA_FLAGS"].split() if not f.startswith(CODEGEN_FLAGS)
    )
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def test_default_codegen_gives_the_suites_results(tmp_path):
    path = tmp_path / "default.npz"
    worker = Path(codegen_worker.__file__)
    run = subprocess.run(
        [sys.executable, str(worker), str(path)],
        env=default_codegen_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    theirs, ours = np.load(path), codegen_worker.results()
    assert sorted(theirs.files) == sorted(ours)
    np.testing.assert_array_equal(theirs["topk/sharded"], theirs["topk/unsharded"])
    worst = 0.0
    for name, want in ours.items():
        got = theirs[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if np.issubdtype(want.dtype, np.integer):
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            scale = max(float(np.max(np.abs(want))), 1e-30)
            worst = max(worst, float(np.max(np.abs(got - want))) / scale)
    print(f"largest deviation: {worst:.1e} of the largest value")
    assert worst <= 1e-5
