"""Layers under JAX's 64-bit mode (``jax_enable_x64``, as users turn it on for gradient checks):
the Pallas kernels are 32-bit programs, traced so whatever the mode (``csa_eqx._dispatch``).

- A float32 layer's training step traces under x64 with the kernels forced (Mosaic's and
  Triton's, in interpret mode), each kernel 32-bit throughout: the program x64 off runs (it
  failed before: a kernel's loop carry or a ``lax.rem`` turned 64-bit).
- Lowered for a TPU under x64, the automatic path takes the Mosaic kernels for a float32 layer
  (it failed to trace before) and none for a float64 one (the XLA strategies: the kernels
  compute in 32 bits or fewer).
- A float64 layer with a kernel forced: a ``TypeError`` naming the kernel.
- A decode cache keeps its dtypes through ``extend``; float64 indexer scores are float32
  (the numpy formula's).
The XLA selections and indexer losses on float64 inputs, against the float64 formulas:
tests/test_streaming.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import scores_np
from jax.extend.core import jaxprs_in_params
from jaxpr_helpers import tpu_lowering, walk_avals, walk_eqns

import csa_eqx as ce
from csa_eqx.presets import tiny_v4, tiny_v32

V4 = tiny_v4("csa", hidden_size=48, q_lora_rank=24, sliding_window=6, index_topk=3)
V32 = tiny_v32(index_topk=3)
MOSAIC = dict(selection=ce.MosaicSelection(), attention=ce.MosaicAttention())
TRITON = dict(
    selection=ce.TritonSelection(), attention=ce.TritonAttention(), scorer=ce.TritonScorer()
)
# (config, Execution fields, indexer loss stage)
MEMBERS = {
    "mosaic/v32": (V32, MOSAIC, "dense"),
    "triton": (V4, TRITON, "dense"),
}


def layer_of(config, dtype=jnp.float32, **fields):
    cls = ce.V32Attention if config is V32 else ce.V4Attention
    return cls(config, key=jax.random.key(0), dtype=dtype).with_execution(ce.Execution(**fields))


def step(layer, x):
    """The loss (the outputs' mean square and the indexer loss), the outputs, the picks and the
    gradients of every weight."""

    def loss(m):
        y, aux = m(x, return_aux=True)
        return jnp.mean(y.astype(jnp.float32) ** 2) + aux["indexer_loss"], (y, aux["selection"])

    (value, (y, picks)), grads = jax.value_and_grad(loss, has_aux=True)(layer)
    return value, y, picks, jax.tree.leaves(grads)


def _bits(aval) -> int:
    return 8 * np.dtype(aval.dtype).itemsize


@pytest.mark.parametrize("name", MEMBERS)
def test_kernels_stay_32_bit_under_x64(name):
    """A float32 layer's training step with the kernels forced traces under x64 (it failed:
    a carry or a ``lax.rem`` turned 64-bit), and every Pallas call in it, forward and
    backward, takes, holds and gives 32-bit values only: the kernels x64 off run."""
    config, fields, stage = MEMBERS[name]
    layer = layer_of(config, indexer_loss=stage, **fields)
    x = jnp.zeros((2, 24, config.hidden_size))
    with jax.enable_x64(True):
        jaxpr = jax.make_jaxpr(step)(layer, x).jaxpr
    calls = [e for e in walk_eqns(jaxpr) if e.primitive.name == "pallas_call"]
    assert len(calls) >= 3  # the selection, the attention's forward and backward
    for call in calls:
        avals = [v.aval for v in (*call.invars, *call.outvars)]
        avals += [a for sub in jaxprs_in_params(call.params) for a in walk_avals(sub)]
        assert max(map(_bits, avals)) <= 32, call.params["name"]


def test_automatic_path_under_x64_on_a_tpu():
    """Lowered for a TPU under x64, a float32 V4 layer's training step runs the fused indexer
    and the attention's forward and backward as Mosaic calls; for a float64 layer the
    automatic choices there are XLA's (V4 and V3.2 alike)."""
    x = jax.random.normal(jax.random.key(1), (1, 32, V4.hidden_size))
    with jax.enable_x64(True):
        text = tpu_lowering(step, layer_of(V4, indexer_loss="sparse"), x).as_text()
        wide = {
            name: ce.Execution().describe(
                layer_of(cfg, jnp.float64), (1, 4096, cfg.hidden_size), "tpu", jnp.float64
            )
            for name, cfg in (("v4", V4), ("v32", V32))
        }
    kernels = set(re.findall(r"(indexer_topk_mosaic|mosaic_sparse_attention\w*)", text))
    assert kernels == {
        "indexer_topk_mosaic",
        "mosaic_sparse_attention",
        "mosaic_sparse_attention_bwd",
    }
    for described in wide.values():
        assert isinstance(described["attention"], ce.XlaAttention)
        assert isinstance(described["selection"], ce.DenseSelection | ce.StreamingSelection)
    tight = ce.Execution().describe(layer_of(V4), (1, 4096, V4.hidden_size), "tpu", jnp.float32)
    assert isinstance(tight["selection"], ce.MosaicSelection)  # the same sizes in 32 bits


@pytest.mark.parametrize(
    "fields, kernel",
    [
        (dict(selection=ce.MosaicSelection()), "indexer_topk_mosaic"),
        (dict(attention=ce.TritonAttention()), "sparse_attention"),
    ],
)
def test_a_kernel_refuses_a_float64_layer(fields, kernel):
    x = jnp.zeros((1, 16, V4.hidden_size))
    with jax.enable_x64(True):
        layer = layer_of(V4, jnp.float64, **fields)
        with pytest.raises(TypeError, match=f"'{kernel}[a-z_]*' computes in 32 bits or fewer"):
            jax.eval_shape(layer, x.astype(jnp.float64))


def test_decode_caches_keep_their_dtypes_under_x64():
    """A decode cache leaves ``extend`` in the dtypes it came in (under x64 the entry count
    turned 64-bit: a jitted decode loop traced twice, a ``lax.scan`` over steps failed)."""
    layers = [layer_of(tiny_v4(kind)) for kind in ("csa", "hca", "sliding")] + [layer_of(V32)]
    for layer in layers:
        cache = layer.init_cache(2, 16)
        x = jnp.zeros((2, 3, layer.config.hidden_size))
        with jax.enable_x64(True):
            _, new = jax.eval_shape(layer.extend, x, cache)
        assert [a.dtype for a in jax.tree.leaves(new)] == [a.dtype for a in jax.tree.leaves(cache)]


@pytest.mark.parametrize("head_chunk", [0, 2])
def test_float64_indexer_scores_are_float32(head_chunk):
    """``indexer_scores`` of float64 inputs: float32 scores as documented, head-chunked or not
    (the chunked sum's float32 carry took float64 chunks), the float64 formula's to float32
    rounding."""
    rng = np.random.default_rng(6)
    q, w, keys = (
        rng.normal(size=(1, 5, 4, 8)),
        rng.normal(size=(1, 5, 4)),
        rng.normal(size=(1, 7, 8)),
    )
    with jax.enable_x64(True):
        scores = ce.indexer_scores(*map(jnp.asarray, (q, w, keys)), head_chunk=head_chunk)
    assert scores.dtype == jnp.float32
    np.testing.assert_allclose(scores, scores_np(q, w, keys), rtol=1e-6, atol=1e-6)
