"""On a TPU (skipped elsewhere): the Mosaic fused indexer, compiled by Mosaic through the public
strategy (``MosaicSelection``), and the TPU-shaped XLA fallback select what a CPU reference
selects: scores formed on the CPU device in float32 (``indexer_scores``), then ``select_topk``.
Run on the chip as::

    JAX_PLATFORMS=tpu,cpu python -m pytest -q tests/test_tpu_selection.py

Random normal inputs at the benchmark's and the reference shape's sizes, bf16 and float32, V4
compressed entries (m = 4) and V3.2 token keys, packed documents and sequences that are no
multiple of the blocks. On the chip the scores' contraction order differs from the CPU's
(float32 rounding), so the selections are compared where that cannot decide them: on 3 x 64
query rows per batch row, a row is **untied** when its ``k``-th and ``(k + 1)``-th best
reference scores differ by more than ``TIE`` times its largest score (or it sees at most
``k`` entries); an untied row's picks must be the reference's exactly, and every row's picks
must be a valid top-k within that tolerance (visible, distinct, increasing, as many as the row
sees up to ``k``, none scored below the ``k``-th best by more than the tolerance).

The randomised sweep of ``test_mosaic_selection.py`` (tests/mosaic_sweep.py, issue 57: d = 128,
bf16 scores, head chunks) runs here too at the blocks a TPU takes, 40 drawn examples a setting:
its integer inputs' scores are exact in float32, so the picks must be the brute force's bitwise.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mosaic_sweep import check_selection, selection_data, sweep_settings
from test_mosaic_selection import SELECTION_SWEEP

import csa_eqx as ce
from csa_eqx._backend import backend_tiles

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "tpu",
    reason="needs a TPU: JAX_PLATFORMS=tpu,cpu python -m pytest -q tests/test_tpu_selection.py",
)

TIE = 2e-5  # relative to a row's largest |score|: far above float32 contraction-order rounding
ROWS = 64  # checked query rows at the start, middle and end of each batch row


class Case:
    """A selection problem on the chip: ``batch`` rows of ``seq`` queries, ``heads x 128``
    indexer heads, entries of ``m`` tokens (``m = 1``: V3.2 token keys), ``k`` picks, inputs
    in ``dtype``; ``documents``: where each batch row's packed documents start."""

    def __init__(self, batch, seq, heads, m, k, dtype, documents=((0,),)):
        self.batch, self.seq, self.heads, self.m, self.k = batch, seq, heads, m, k
        self.dtype = jnp.dtype(dtype)
        kq, kw, kk = jax.random.split(jax.random.key(seq + heads + k), 3)
        self.q = jax.random.normal(kq, (batch, seq, heads, 128), jnp.float32).astype(dtype)
        self.w = jax.random.normal(kw, (batch, seq, heads), jnp.float32) * heads**-0.5
        entries = -(-seq // m)
        self.keys = jax.random.normal(kk, (batch, entries, 128), jnp.float32).astype(dtype)
        segment = np.zeros((batch, seq), np.int32)
        for b, starts in enumerate(documents):
            for start in starts[1:]:
                segment[b, start:] += 1
        index = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
        self.vis = ce.Visibility(
            jnp.asarray(index), jnp.asarray(segment), ce.entry_layout(jnp.asarray(segment), m)
        )

    def __repr__(self):
        return f"B={self.batch} S={self.seq} H={self.heads} m={self.m} k={self.k} {self.dtype.name}"

    def problem(self, q, w, keys, vis):
        return ce.SelectionProblem.from_queries(q, w, keys, vis, tiles=backend_tiles())

    def run(self, strategy):
        """``strategy``'s picks of the whole problem, compiled for the chip, as numpy."""

        def select(q, w, keys, vis):
            return strategy.select(self.problem(q, w, keys, vis), self.k)

        picks = jax.jit(select)(self.q, self.w, self.keys, self.vis)
        return np.asarray(jax.device_get(picks))

    def rows(self) -> np.ndarray:
        n = min(ROWS, self.seq // 3)
        mid = self.seq // 2
        return np.concatenate([np.arange(n), mid + np.arange(n), self.seq - n + np.arange(n)])

    def reference(self):
        """On the CPU device: the checked rows' float32 scores, visibility and ``select_topk``
        picks, as numpy."""
        cpu = jax.devices("cpu")[0]
        rows = self.rows()
        f32 = jnp.float32
        q = jax.device_put(jnp.asarray(self.q[:, rows], f32), cpu)
        w = jax.device_put(self.w[:, rows], cpu)
        keys = jax.device_put(jnp.asarray(self.keys, f32), cpu)
        vis = jax.device_put(self.vis.rows(0, self.seq), cpu)
        qi, qs = vis.query_index[:, rows], vis.query_segment[:, rows]

        @jax.jit
        def scored(q, w, keys, qi, qs, layout):
            scores = ce.indexer_scores(q, w, keys, head_chunk=math.gcd(8, q.shape[2]))
            visible = ce.entry_visibility(qi, qs, layout)
            return scores, visible, ce.select_topk(scores, visible, self.k)

        out = scored(q, w, keys, qi, qs, vis.layout)
        return tuple(np.asarray(a) for a in out)


def check(case: Case, picks: np.ndarray, what: str) -> None:
    """``picks [B, S, k]`` against the CPU reference (see the module docstring)."""
    scores, visible, want = case.reference()
    rows = case.rows()
    k = case.k
    untied = equal = 0
    problems = []
    for b in range(case.batch):
        for r, row in enumerate(rows):
            got = picks[b, row]
            where = f"{what} {case!r}: batch {b} query {row}"
            seen = np.nonzero(visible[b, r])[0]
            n = min(k, len(seen))
            chosen = got[got >= 0]
            valid = (
                len(chosen) == n
                and (got[n:] == -1).all()
                and (np.diff(chosen) > 0).all()
                and np.isin(chosen, seen).all()
            )
            if not valid:
                problems.append(f"{where}: {len(chosen)} picks of {n} expected, not a valid set")
                continue
            row_scores = np.where(visible[b, r], scores[b, r], -np.inf)
            ranked = np.sort(row_scores[seen])[::-1]
            tol = TIE * max(float(np.max(np.abs(row_scores[seen]), initial=0.0)), 1e-30)
            if n and row_scores[chosen].min() < ranked[n - 1] - tol:
                low = row_scores[chosen].min()
                problems.append(f"{where}: a pick scores {low}, the k-th best {ranked[n - 1]}")
            is_untied = len(seen) <= k or ranked[k - 1] - ranked[k] > tol
            same = np.array_equal(got, want[b, r])
            untied += is_untied
            equal += same
            if is_untied and not same:
                extra = np.setdiff1d(chosen, want[b, r])[:5]
                problems.append(f"{where}: untied row differs (extra picks {extra.tolist()})")
    checked = case.batch * len(rows)
    assert not problems, f"{len(problems)} of {checked} rows wrong:\n" + "\n".join(problems[:20])
    assert untied >= checked // 2, f"{what} {case!r}: only {untied} of {checked} rows untied"


CASES = {  # Case's arguments; built (on the chip) by the tests that use them
    # the benchmark layer's indexer at 16k (V4 CSA, 64 heads, k 512, m 4)
    "v4-bf16": (1, 16384, 64, 4, 512, jnp.bfloat16),
    # float32 at HIGHEST, two batch rows, three packed documents in one, a ragged length
    "v4-f32-packed": (2, 4000, 64, 4, 512, jnp.float32, ((0, 1000, 2500), (0,))),
    # V3.2 token keys, k 2048, packed documents, a ragged length
    "v32-bf16-packed": (2, 5000, 32, 1, 2048, jnp.bfloat16, ((0,), (0, 3001))),
    "v32-f32": (1, 2048, 16, 1, 256, jnp.float32),
    # the reference shape (Q = K = 32768 token keys, 32 x 128, k 2048)
    "anchor-bf16": (1, 32768, 32, 1, 2048, jnp.bfloat16),
}


@functools.cache
def case_of(name: str) -> Case:
    return Case(*CASES[name])


@pytest.mark.parametrize("name", list(CASES))
def test_mosaic_kernel_selects_as_the_cpu_reference(name):
    case = case_of(name)
    check(case, case.run(ce.MosaicSelection()), "MosaicSelection")


@pytest.mark.parametrize("name", ["v4-bf16", "v4-f32-packed"])
def test_xla_fallback_selects_as_the_cpu_reference(name):
    """The XLA path the automatic choice falls back to (``AutoSelection.choose`` with the
    TPU's tiles: the streaming top-k by ``lax.top_k``, the head sum at ``HIGHEST``)."""
    case = case_of(name)
    chosen = []

    def fallback(q, w, keys, vis):
        p = case.problem(q, w, keys, vis)
        chosen.append(ce.AutoSelection().choose(*p.sizes(), p.tiles))
        return w

    jax.eval_shape(fallback, case.q, case.w, case.keys, case.vis)
    assert isinstance(chosen[0], ce.StreamingSelection), f"the XLA fallback is {chosen[0]!r}"
    assert backend_tiles().select == "top_k", f"the TPU's tiles are {backend_tiles()!r}"
    check(case, case.run(chosen[0]), "XLA fallback")


def test_the_automatic_choice_is_the_kernel():
    """On the chip ``AutoSelection`` (the ``Execution`` default) takes ``MosaicSelection``,
    and runs it: its picks are the forced kernel's, bitwise."""
    case = case_of("v32-f32")
    chosen = []

    def strategy(q, w, keys, vis):
        chosen.append(ce.AutoSelection().strategy(case.problem(q, w, keys, vis)))
        return w

    jax.eval_shape(strategy, case.q, case.w, case.keys, case.vis)
    assert chosen[0] == ce.MosaicSelection(), f"AutoSelection chose {chosen[0]!r} on the TPU"
    assert isinstance(ce.Execution().selection, ce.AutoSelection)
    np.testing.assert_array_equal(
        case.run(ce.AutoSelection()), case.run(ce.MosaicSelection()), err_msg="auto != kernel"
    )


# The CPU sweep's settings (test_mosaic_selection.py's ``SELECTION_SWEEP``) at the blocks a TPU
# takes (query blocks of 16, key tiles of 128 lanes or the automatic 512): the same draws,
# the picks bitwise the brute force's (the inputs' scores are exact in float32).
CHIP_SELECTION_SWEEP = {
    name: dataclasses.replace(
        setting,
        kernel=dataclasses.replace(
            setting.kernel,
            query_block=max(setting.kernel.query_block, 16),
            key_block=max(setting.kernel.key_block, 128),
        ),
        t=max(setting.t, 300),
    )
    for name, setting in SELECTION_SWEEP.items()
}


@pytest.mark.parametrize("name", list(CHIP_SELECTION_SWEEP))
@sweep_settings(40)
@given(data=st.data())
def test_randomised_sweep_on_the_chip(name, data):
    setting = CHIP_SELECTION_SWEEP[name]
    check_selection(setting, selection_data(data.draw, setting))
