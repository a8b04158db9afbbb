"""The attention kernel seam: every layer path reads through ``Execution.attention``, with
typed ``Reads``; ``sparse_attention`` is the reference kernel over the reads it describes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

import csa_eqx as ce
from csa_eqx import presets
from csa_eqx._attention.base import attention_query_block
from csa_eqx._tiles import sparse_query_block

CALLS: dict[str, list[tuple[str, ...]]] = {}

# the layers run jitted (the kernel records while the program is traced): eagerly, every
# primitive of a layer call would be compiled as a program of its own
forward = eqx.filter_jit(lambda m, x, **kw: m(x, **kw))
extend = eqx.filter_jit(lambda m, x, cache: m.extend(x, cache))


class RecordingAttention(ce.XlaAttention):
    """The reference kernel, recording (at trace time) which key sets each call reads."""

    tag: str = "recording"

    def attend(self, q, reads, sinks, scale, *, return_lse=False, query_block, numerics=None):
        kinds = ("gathered",) * len(reads.gathered)
        kinds += ("band",) * (reads.band is not None) + ("dense",) * (reads.dense is not None)
        if reads.dense is not None and reads.dense.picks is not None:
            kinds += ("picks",)
        CALLS.setdefault(self.tag, []).append(kinds)
        kw = dict(return_lse=return_lse, query_block=query_block, numerics=numerics)
        return super().attend(q, reads, sinks, scale, **kw)


def layers(kind: str, tag: str, **fields):
    """The same layer with the default execution and with a recording kernel."""
    execution = ce.Execution(attention=RecordingAttention(tag), **fields)
    if kind == "v32":
        config, cls = presets.tiny_v32(), ce.V32Attention
    else:
        config, cls = presets.tiny_v4(kind), ce.V4Attention
    base = cls(config, key=jax.random.key(0), execution=ce.Execution(**fields))
    return base, base.with_execution(execution)


PATHS = {  # (layer kind, execution fields): the key sets its forward reads
    "sliding": ("sliding", {}, ("band",)),
    "sliding-gathered": ("sliding", {"window": ce.GatheredWindow()}, ("gathered",)),
    "csa-gathered": ("csa", {"picks": ce.GatheredPicks()}, ("gathered", "band")),
    "csa-masked": ("csa", {"picks": ce.MaskedPicks()}, ("band", "dense", "picks")),
    "hca": ("hca", {}, ("band", "dense")),
    "v32-gathered": ("v32", {"picks": ce.GatheredPicks()}, ("gathered",)),
    "v32-masked": ("v32", {"picks": ce.MaskedPicks()}, ("dense", "picks")),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_every_layer_path_runs_the_executions_kernel(name):
    kind, fields, reads = PATHS[name]
    base, recording = layers(kind, name, **fields)
    x = jax.random.normal(jax.random.key(1), (2, 24, base.config.hidden_size))
    CALLS.pop(name, None)
    np.testing.assert_array_equal(forward(recording, x), forward(base, x))
    assert CALLS[name] == [reads]
    # extend: a prefill then one decoded token, each through the kernel, the forward's reads
    cache = recording.init_cache(2, 32)
    _, cache = extend(recording, x[:, :20], cache)
    y, _ = extend(recording, x[:, 20:21], cache)
    assert CALLS[name][1:] == [reads, reads]
    np.testing.assert_allclose(y, forward(base, x[:, :21])[:, 20:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["csa", "v32"])
def test_dense_warm_up_reads_every_entry_through_the_kernel(kind):
    name = f"{kind}-dense"
    base, recording = layers(kind, name, picks=ce.GatheredPicks())
    x = jax.random.normal(jax.random.key(2), (1, 16, base.config.hidden_size))
    CALLS.pop(name, None)
    y, aux = forward(recording, x, return_aux=True, indexer_loss="dense")
    ref, ref_aux = forward(base, x, return_aux=True, indexer_loss="dense")
    np.testing.assert_array_equal(y, ref)
    np.testing.assert_array_equal(aux["indexer_loss"], ref_aux["indexer_loss"])
    window = ("band",) if kind == "csa" else ()
    assert CALLS[name] == [window + ("dense",)]
    if kind == "csa":  # entry_attention: the window and every visible entry, as the warm-up
        eqx.filter_jit(lambda m, x: m.entry_attention(x))(recording, x)
        assert CALLS[name][1:] == [("band", "dense")]


def test_sparse_attention_is_the_reference_kernel_over_its_reads():
    """The functional form == XlaAttention over the Reads it describes (gathered rows, band
    with a history, dense entries), the automatic block included."""
    b, s, h, d, w = 2, 11, 3, 8, 4
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (b, s, h, d))
    kv = jax.random.normal(keys[1], (b, w - 1 + s, d))
    idx = jax.random.randint(keys[2], (b, s, 3), -1, w - 1 + s)
    seg = jnp.zeros((b, s), jnp.int32).at[:, 7:].set(1)
    history = jnp.array([[-1, 0, 0], [0, 0, 0]], jnp.int32)
    sinks = jax.random.normal(keys[3], (h,))
    out = ce.sparse_attention(
        q, kv, idx, sinks, 0.3, None, True, window=w, segment=seg, window_history=history
    )
    reads = ce.Reads((ce.GatheredRows(kv, idx),), band=ce.BandRows(kv, seg, w, history))
    block = attention_query_block(b, h, reads)
    assert block == min(sparse_query_block(b, h, d, 3), 4)
    ref = ce.XlaAttention().attend(q, reads, sinks, 0.3, return_lse=True, query_block=block)
    for got, want in zip(out, ref, strict=True):
        np.testing.assert_array_equal(got, want)
    # the same reads, the band read as its own table: equal up to rounding
    copy = ce.Reads((ce.GatheredRows(kv + 0.0, idx),), band=ce.BandRows(kv, seg, w, history))
    got = ce.XlaAttention().attend(q, copy, sinks, 0.3, return_lse=True, query_block=4)
    for g, want in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)


def test_reads_check_what_they_hold():
    kv = jnp.zeros((1, 5, 4))
    seg = jnp.zeros((1, 5), jnp.int32)
    with pytest.raises(ValueError, match="window_history must have window - 1 = 2 rows"):
        ce.BandRows(kv, seg, 3, jnp.zeros((1, 4), jnp.int32))
    band = ce.Reads(band=ce.BandRows(kv, seg, 3))
    with pytest.raises(ValueError, match="two band reads"):
        band.join(band)
    with pytest.raises(ValueError, match="at least one key set"):
        ce.XlaAttention().attend(jnp.zeros((1, 5, 2, 4)), ce.Reads(), None, 1.0, query_block=4)
    # the field's check (jaxtyping's, under the test suite's import hook, comes first)
    with pytest.raises((ValueError, TypeCheckError), match="attention"):
        ce.Execution(attention="xla")


def test_a_kernel_reaches_the_jitted_layer():
    """The kernel is part of the (static) execution: a jitted layer retraces for another."""
    base, recording = layers("hca", "jit")
    x = jnp.ones((1, 16, base.config.hidden_size))
    want = forward(base, x)
    CALLS.pop("jit", None)
    np.testing.assert_array_equal(forward(recording, x), want)  # traced again: it recorded
    assert CALLS["jit"] == [("band", "dense")]
