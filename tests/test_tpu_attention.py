"""``MosaicAttention`` compiled by Mosaic and run on a TPU, against ``XlaAttention`` run on the
CPU in float32 on the same inputs: outputs, ``lse`` and the gradients of the queries, the
tables and the sinks, on V4-Flash CSA reads (64 heads x 512: picks among compressed entries
and a 128-token window over two packed documents, sinks), the same reads with the benchmark
layer's 4 heads x 64, and V3.2 DSA reads (128 heads over a 576-wide latent whose first 512
features are the values), for the automatic configuration (the one ``AutoAttention`` takes on a
TPU at these short lengths: tiles for prefill, row DMAs or, for the few-head layer, rows copied
from a resident table for decoding) and forced designs (rows copied by vector loads from a
resident table, as V4-Flash prefill past 16k takes them; gradients added in HBM; a rows
backward read as tiles). Tolerances, relative to the reference's largest magnitude: bfloat16
inputs 3e-2, float32 under ``jax.default_matmul_precision("highest")`` 2e-4. The randomised
sweep of ``test_mosaic_attention.py`` (tests/mosaic_sweep.py, issue 57) runs here too, compiled
by Mosaic: its settings with row chunks of 128, 40 drawn examples each, against the numpy
formula (and its ``jnp`` autodiff on the CPU device).

Collected everywhere; skipped unless a TPU is present. Run on a TPU machine (both backends,
the CPU's for the reference)::

    JAX_PLATFORMS=tpu,cpu python -m pytest -q tests/test_tpu_attention.py
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mosaic_sweep import attention_data, check_attention, sweep_settings
from test_mosaic_attention import SWEEP

import csa_eqx as ce
from csa_eqx import MosaicAttention

pytestmark = pytest.mark.skipif(
    not any(d.platform == "tpu" for d in jax.devices()),
    reason="needs a TPU: JAX_PLATFORMS=tpu,cpu python -m pytest -q tests/test_tpu_attention.py",
)

TOLERANCE = {"bfloat16": 3e-2, "float32": 2e-4}


@dataclasses.dataclass(frozen=True)
class Problem:
    """Released head sizes at a short sequence: ``queries`` (the last of ``tokens``: decoding
    when fewer), ``entries`` the picks are among, ``picks`` per query."""

    name: str
    heads: int
    width: int  # the keys' (and V4's values')
    values: int  # V3.2: the keys' first ``values`` features; 0: the keys
    queries: int
    entries: int
    picks: int
    window: int  # 0: no band

    def inputs(self, dtype, seed: int = 0) -> dict:
        """numpy arrays: queries, window token rows (two packed documents), entries, sinks,
        each query's picks (uniform among the entries it sees, with repeats; ``-1`` where it
        sees fewer than ``picks``), segments and a cotangent of the output."""
        r = np.random.default_rng(seed)
        s, t, k = self.queries, self.entries, self.picks
        visible = t - s + 1 + np.arange(s)  # the last query sees every entry
        picks = np.floor(r.random((s, k)) * visible[:, None]).astype(np.int32)
        picks = np.where(np.arange(k) < visible[:, None], picks, -1)[None]
        normal = lambda *shape: r.normal(size=shape).astype(dtype)  # noqa: E731
        segment = (np.arange(s) >= s // 3).astype(np.int32)[None]
        out_width = self.values or self.width
        return dict(
            q=normal(1, s, self.heads, self.width),
            kv=normal(1, s, self.width),
            entries=normal(1, t, self.width),
            sinks=normal(self.heads).astype(np.float32),
            picks=picks,
            segment=segment,
            cotangent=normal(1, s, self.heads, out_width).astype(np.float32),
        )


V4 = Problem("v4_flash_csa", 64, 512, 0, 2048, 1024, 512, 128)
V4_DECODE = Problem("v4_flash_csa_decode", 64, 512, 0, 1, 8192, 512, 128)
V32 = Problem("v32_dsa", 128, 576, 512, 1024, 4096, 1024, 0)
# V4's reads with the benchmark layer's 4 heads x 64: 64 queries a step, unpadded query-side arrays
FEW = Problem("few_heads", 4, 64, 0, 2048, 1024, 512, 128)
FEW_DECODE = Problem("few_heads_decode", 4, 64, 0, 1, 8192, 512, 128)


def loss_and_grads(kernel, problem: Problem, arrays: dict):
    """The gradient of ``sum(out * cotangent) + 0.1 * sum(finite lse)`` with respect to the
    queries, the window rows, the entries and the sinks, and ``(out, lse)``."""

    def loss(floats, ints):
        if problem.values:
            gathered = ce.GatheredRows(floats["entries"], ints["picks"], value_width=problem.values)
            reads, sinks = ce.Reads((gathered,)), None
        else:
            band = ce.BandRows(floats["kv"], ints["segment"], problem.window)
            reads = ce.Reads((ce.GatheredRows(floats["entries"], ints["picks"]),), band=band)
            sinks = floats["sinks"]
        out, lse = kernel.attend(floats["q"], reads, sinks, 0.05, return_lse=True, query_block=64)
        total = jnp.sum(out.astype(jnp.float32) * ints["cotangent"])
        return total + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    floats = {name: arrays[name] for name in ("q", "kv", "entries", "sinks")}
    ints = {name: arrays[name] for name in ("picks", "segment", "cotangent")}
    return jax.jit(jax.grad(loss, has_aux=True))(floats, ints)


def compare(kernel, problem: Problem, dtype: str):
    """The kernel on the TPU against ``XlaAttention`` on the CPU (float32, from the same
    values), within ``TOLERANCE[dtype]`` of the reference's largest magnitude."""
    tpu, cpu = jax.devices("tpu")[0], jax.devices("cpu")[0]
    given = problem.inputs(np.dtype(jnp.dtype(dtype)))
    reference = {
        k: v.astype(np.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v
        for k, v in given.items()
    }
    precision = jax.default_matmul_precision("highest") if dtype == "float32" else None
    with precision or contextlib.nullcontext():
        grads, (out, lse) = loss_and_grads(kernel, problem, jax.device_put(given, tpu))
        want_grads, (want_out, want_lse) = loss_and_grads(
            ce.XlaAttention(), problem, jax.device_put(reference, cpu)
        )
    tol = TOLERANCE[dtype]
    got = dict(out=out, lse=lse, **{f"d{k}": v for k, v in grads.items()})
    want = dict(out=want_out, lse=want_lse, **{f"d{k}": v for k, v in want_grads.items()})
    for name, ref in want.items():
        ref, res = np.asarray(ref, np.float64), np.asarray(got[name], np.float64)
        where = f"{problem.name} {dtype} {kernel}: {name}"
        assert res.shape == ref.shape, where
        np.testing.assert_array_equal(np.isfinite(res), np.isfinite(ref), err_msg=where)
        finite = np.isfinite(ref)
        scale = np.max(np.abs(ref[finite]), initial=0.0) or 1.0
        err = np.max(np.abs(res[finite] - ref[finite]), initial=0.0)
        assert err <= tol * scale, f"{where}: max error {err:.3g} > {tol} x {scale:.3g}"


AUTOMATIC = MosaicAttention()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("problem", [V4, V32, V4_DECODE, FEW, FEW_DECODE], ids=lambda p: p.name)
def test_the_automatic_kernel_on_the_chip(problem, dtype):
    """``AutoAttention``'s kernel on a TPU: tiles for the prefills (V3.2 in two head blocks),
    row DMAs for V4-Flash's decoding and rows copied from a resident table for the few-head
    layer's (its table loads faster than its row DMAs); for 4 heads x 64, 64 queries a step
    with the query-side arrays unpadded in HBM and the band's gradient table in VMEM."""
    compare(AUTOMATIC, problem, dtype)


FORCED = {
    "rows-resident": (MosaicAttention(gather="rows", resident=True), V4),
    "tiles-hbm-gradients": (MosaicAttention(gather="tiles", gradients="hbm"), V32),
    "rows-backward-as-tiles": (MosaicAttention(gather="rows", gradients="hbm"), V4),
    # V3.2's automatic choice from 16k: rows copied from a resident table, the backward's tiles
    "rows-resident-backward-as-tiles": (
        MosaicAttention(gather="rows", resident=True, gradients="hbm"),
        V32,
    ),
    # at 16k: rows copied both ways, the gradient table in VMEM (under a raised limit there)
    "rows-resident-v32": (
        MosaicAttention(gather="rows", resident=True, gradients="vmem", vmem_limit_bytes=124 << 20),
        V32,
    ),
}


@pytest.mark.parametrize("design", list(FORCED))
def test_forced_designs_on_the_chip(design):
    """Rows copied by vector loads from a resident table (as row DMAs within VMEM its first
    chip run failed Mosaic's verifier), gradients added tile by tile in HBM, a rows source's
    backward read as tiles (its forward's rows by DMA, or copied from a resident table: V3.2's
    automatic choice at 32k), V3.2's rows copied both ways (its automatic choice at 16k):
    bfloat16."""
    kernel, problem = FORCED[design]
    compare(kernel, problem, "bfloat16")


# The CPU sweep's settings (tests/mosaic_sweep.py, test_mosaic_attention.py's ``SWEEP``) compiled
# by Mosaic: row chunks of 128 (the least a TPU takes), the chip's tolerances; the same draws.
CHIP_SWEEP = {
    name: dataclasses.replace(
        setting,
        kernel=dataclasses.replace(
            setting.kernel, key_block=128 if setting.kernel.key_block else 0
        ),
        tolerance=TOLERANCE[setting.dtype],
    )
    for name, setting in SWEEP.items()
}


@pytest.mark.parametrize("name", list(CHIP_SWEEP))
@sweep_settings(40)
@given(data=st.data())
def test_randomised_sweep_on_the_chip(name, data):
    """Outputs, ``lse`` and every gradient against the numpy formula and its ``jnp`` autodiff
    on the CPU device, on drawn data: boundary and repeated picks, documents, non-finite
    queries, keys and values."""
    setting = CHIP_SWEEP[name]
    precision = jax.default_matmul_precision("highest") if setting.dtype == "float32" else None
    with precision or contextlib.nullcontext():
        check_attention(setting, attention_data(data.draw, setting), jax.devices("cpu")[0])
