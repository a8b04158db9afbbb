"""The environment of a test's child process (a ``csa-eqx`` run, a notebook kernel, a
``jax.distributed`` worker): this run's own, XLA's code-generation flags included (``make
test`` sets them per interpreter, docs/testing.md), without the simulated-device count that
tests/conftest.py adds, so that the child chooses its own devices."""

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_env(**overrides: str) -> dict[str, str]:
    """``os.environ`` with ``DEVICE_COUNT_FLAG`` dropped from ``XLA_FLAGS``, then
    ``overrides``."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = " ".join(f for f in flags if not f.startswith(DEVICE_COUNT_FLAG + "="))
    return {**os.environ, "XLA_FLAGS": kept, **overrides}
