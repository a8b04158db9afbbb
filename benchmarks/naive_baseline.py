"""A naive dense-mask V4 CSA layer forward, written only as a benchmark baseline.

It does what public implementations do: materialise the per-head indexer scores
``[B, H_I, S, T]``, mask them with a dense ``[S, T]`` causal mask, sort, then build a dense
``[S, S + T]`` attention mask (sliding window plus the selected entries) and run full attention
``[B, H, S, S + T]``. It reuses a ``csa_eqx.V4Attention``'s parameters (no packing), so it
computes the same function; ``python -m benchmarks.naive_baseline`` checks that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from csa_eqx import Execution, V4Attention, entry_layout, presets
from csa_eqx._ops import linear, rms_norm
from csa_eqx._rope import apply_rope_interleaved

__all__ = ["naive_v4_csa"]


def _naive_selection(layer: V4Attention, x: Array, qr: Array, positions: Array, layout) -> Array:
    """Indexer top-k from the full ``[B, H_I, S, T]`` score tensor and a dense causal mask."""
    c, ix = layer.config, layer.indexer
    keys = layer.index_compressor(x, positions, layout)
    q = ix.queries(qr, positions)
    w = ix.head_weights(x) * c.index_head_dim**-0.5
    per_head = jax.nn.relu(jnp.einsum("bshd,btd->bhst", q, keys))  # [B, H_I, S, T]
    scores = jnp.einsum("bhst,bsh->bst", per_head, w)
    s, t = scores.shape[1:]
    causal = (jnp.arange(t) * c.compress_rate + c.compress_rate - 1)[None, :] <= jnp.arange(s)[
        :, None
    ]
    scores = jnp.where(causal, jnp.where(scores == 0, 0.0, scores), -jnp.inf)
    _, idx = jax.lax.top_k(scores, min(c.index_topk, t))
    return jnp.where(jnp.take_along_axis(jnp.broadcast_to(causal, scores.shape), idx, -1), idx, -1)


def naive_v4_csa(
    layer: V4Attention, x: Float[Array, "batch seq hidden"]
) -> Float[Array, "batch seq hidden"]:
    """The CSA layer's forward through dense score tensors and dense masks."""
    c = layer.config
    b, s, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    qr = rms_norm(linear(x, layer.block.q_a_proj), layer.block.q_a_norm, c.rms_norm_eps)
    q = linear(qr, layer.block.q_b_proj).reshape(b, s, c.num_heads, c.head_dim)
    q = apply_rope_interleaved(
        rms_norm(q, None, c.rms_norm_eps), positions[..., None], layer.block.inv_freq
    )
    kv = rms_norm(linear(x, layer.block.kv_proj), layer.block.kv_norm, c.rms_norm_eps)
    kv = apply_rope_interleaved(kv, positions, layer.block.inv_freq)

    layout = entry_layout(jnp.zeros((b, s), jnp.int32), c.compress_rate)
    entries = layer.compressor(x, positions, layout)
    selection = _naive_selection(layer, x, qr, positions, layout)
    t = entries.shape[1]
    picked = jnp.zeros((b, s, t + 1), bool)  # column t absorbs the -1 sentinels
    rows = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
    picked = picked.at[(*rows, jnp.where(selection >= 0, selection, t))].set(True)[..., :t]
    lag = jnp.arange(s)[:, None] - jnp.arange(s)[None, :]
    window = (lag >= 0) & (lag < c.sliding_window)
    mask = jnp.concatenate([jnp.broadcast_to(window, (b, s, s)), picked], axis=-1)  # [B,S,S+T]

    keys = jnp.concatenate([kv, entries.astype(kv.dtype)], axis=1)
    logits = jnp.einsum("bshd,bnd->bhsn", q, keys) * c.head_dim**-0.5
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    sink = jnp.broadcast_to(layer.block.sinks[None, :, None, None], (b, c.num_heads, s, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    o = jnp.einsum("bhsn,bnd->bshd", probs, keys)
    o = apply_rope_interleaved(o, -positions[..., None], layer.block.inv_freq)
    o = o.reshape(b, s, c.o_groups, -1)
    w_a = layer.block.o_a_proj.reshape(c.o_groups, c.o_lora_rank, -1)
    return linear(jnp.einsum("bsgi,goi->bsgo", o, w_a).reshape(b, s, -1), layer.block.o_b_proj)


def main() -> None:
    """Check the baseline against ``csa_eqx.V4Attention`` (dense and forced-streaming paths)."""
    base = presets.tiny_v4("csa", sliding_window=8, index_topk=6)
    x = jax.random.normal(jax.random.key(1), (2, 77, base.hidden_size))
    for blocks in ({}, {"indexer_key_block": 5, "query_block": 16}):
        execution = Execution.from_options(**blocks)
        layer = V4Attention(base, key=jax.random.key(0), execution=execution)
        want = jax.jit(lambda m, x: m(x))(layer, x)
        got = jax.jit(naive_v4_csa)(layer, x)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        print(f"naive dense-mask vs csa_eqx.V4Attention {blocks}: max rel. error {err:.2e}")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(want))))


if __name__ == "__main__":
    main()
