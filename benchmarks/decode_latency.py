"""Decode-step latency vs context length per layer type, and cache bytes per token.

Latency: one jitted, cache-donating ``extend`` step (``x [B, 1, D]``) on a cache whose
bookkeeping says ``context`` tokens are already there (buffers filled with random values; the
step's cost does not depend on them), small model dims. Cache sizes: from the buffer shapes of
``init_cache`` at V4-Flash / V3.2 layer sizes (``jax.eval_shape``: nothing is allocated), next to
what HF transformers' ``DynamicCache`` keeps for the same layer.

    python -m benchmarks.decode_latency [--contexts 1024 4096 16384 65536] [--repeats 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import csa_eqx as ce
from csa_eqx import presets
from csa_eqx._decode.cache import cache_bytes

from . import harness

KINDS = ("sliding", "csa", "hca", "dsa")  # dsa: V3.2


def layer_config(kind: str, small: bool = True):
    """The layer of ``kind``: small dims (``harness.small_v4`` / ``small_v32``) for the
    latency, V4-Flash / V3.2 sizes (``csa_eqx.presets``) for the cache bytes."""
    if kind == "dsa":
        return harness.small_v32() if small else presets.v32()
    return harness.small_v4(kind) if small else presets.v4_flash(kind)


def build(config, abstract: bool = False):
    """The layer of ``config`` (V4 or V3.2); ``abstract``: shapes only (``filter_eval_shape``)."""
    cls = ce.V32Attention if isinstance(config, ce.V32AttentionConfig) else ce.V4Attention
    make = lambda: cls(config, key=jax.random.key(0))  # noqa: E731
    return eqx.filter_eval_shape(make) if abstract else make()


def filled(cache, context: int, key, rate: int = 0):
    """``cache`` as if ``context`` tokens of one segment had been written (random buffers);
    ``rate``: the V4 layer's compress rate (its entries close every ``rate`` tokens)."""
    leaves, tree = jax.tree.flatten(cache)
    keys = jax.random.split(key, len(leaves))
    leaves = [
        jax.random.normal(k, v.shape, v.dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v
        for k, v in zip(keys, leaves, strict=True)
    ]
    cache = jax.tree.unflatten(tree, leaves)
    b = cache.length.shape[0]
    n = jnp.full((b,), context, jnp.int32)
    fields = dict(length=n, position=jnp.copy(n))  # distinct buffers: the step donates them
    if isinstance(cache, ce.V32Cache):
        slots = jnp.arange(cache.token_segment.shape[1])
        fields["token_segment"] = jnp.where(slots < context, 0, -1)[None].repeat(b, 0)
    else:
        fields["window_segment"] = jnp.zeros_like(cache.window_segment)
        if rate:
            j, n_entries = jnp.arange(cache.entry_end.shape[1]), context // rate
            end = jnp.where(j < n_entries, j * rate + rate - 1, -1)
            fields["entry_end"] = end[None].repeat(b, 0)
            fields["entry_segment"] = jnp.where(j < n_entries, 0, -1)[None].repeat(b, 0)
            fields["entry_count"] = jnp.full((b,), n_entries, jnp.int32)
    return dataclasses.replace(cache, **fields)


@eqx.filter_jit(donate="all-except-first")
def step(fixed, cache):
    """One decode step; donates the cache (not ``fixed = (layer, x)``)."""
    layer, x = fixed
    return layer.extend(x, cache)


def latency(kind: str, context: int, batch: int, repeats: int) -> float:
    """Median seconds of one decode step after ``context`` tokens."""
    layer = build(layer_config(kind))
    warm_up = 2  # compile + warm up; every step advances the cache by one token
    room = context + warm_up + repeats
    rate = getattr(layer.config, "compress_rate", 0)
    cache = filled(layer.init_cache(batch, room), context, jax.random.key(1), rate)
    x = jax.random.normal(jax.random.key(2), (batch, 1, layer.config.hidden_size))
    for _ in range(warm_up):
        y, cache = step((layer, x), cache)
    jax.block_until_ready(y)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y, cache = step((layer, x), cache)
        jax.block_until_ready(y)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def hf_bytes(config, tokens: int, itemsize: int) -> int:
    """What HF's DynamicCache layer holds after ``tokens`` tokens (``DynamicSlidingWindowLayer``:
    the last ``sliding_window - 1`` kv rows, K and V sharing storage; ``DeepseekV4HCACache`` /
    ``DeepseekV4CSACache``: plus compressed entries, the < m pending (C, Z) tokens and, for CSA,
    the indexer's entries and both overlap a-halves; V3.2: latent and indexer key per token).
    Pending tokens are counted at their maximum (m - 1)."""
    c = config
    if isinstance(c, ce.V32AttentionConfig):
        return tokens * (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim) * itemsize
    d, m = c.head_dim, c.compress_rate
    n = (min(tokens, c.sliding_window - 1)) * d
    if m == presets.COMPRESS_RATES["hca"]:
        n += tokens // m * d + (m - 1) * 2 * d
    if m == presets.COMPRESS_RATES["csa"]:
        di = c.index_head_dim
        n += tokens // m * (d + di) + (m - 1) * 2 * (2 * d + 2 * di) + m * (d + di) * 2
    return n * itemsize


def cache_table(tokens: tuple[int, ...] = (4096, 65536, 1 << 20)) -> list[str]:
    """Bytes per token per layer type (bf16 buffers) at V4-Flash (and V3.2) layer sizes."""
    lines = [
        "| layer | ours: fixed bytes | ours: bytes/token | HF DynamicCache bytes/token "
        + "".join(f"| ours @{t} tok | HF @{t} tok " for t in tokens)
        + "|",
        "|---" * (4 + 2 * len(tokens)) + "|",
    ]
    for kind in KINDS:
        config = layer_config(kind, small=False)
        layer = build(config, abstract=True)
        sizes = {}
        for t in (1 << 16, 1 << 17) + tokens:
            cache = jax.eval_shape(lambda t=t, layer=layer: layer.init_cache(1, t, jnp.bfloat16))
            sizes[t] = cache_bytes(cache)
        per_token = (sizes[1 << 17] - sizes[1 << 16]) / (1 << 16)
        fixed = sizes[1 << 16] - per_token * (1 << 16)
        hf_per = (hf_bytes(config, 1 << 17, 2) - hf_bytes(config, 1 << 16, 2)) / (1 << 16)
        row = f"| {kind} | {fixed:,.0f} | {per_token:.2f} | {hf_per:.2f} "
        row += "".join(
            f"| {sizes[t] / 2**20:,.2f} MiB | {hf_bytes(config, t, 2) / 2**20:,.2f} MiB "
            for t in tokens
        )
        lines.append(row + "|")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(harness.machine_markdown(harness.machine_info()))
    print(f"\n## Decode step latency (ms, median of {args.repeats}, batch {args.batch})\n")
    print(
        "small dims: V4 hidden 256, 8 heads x 64, window 128, CSA m=4 top-k 128, HCA m=128; "
        "V3.2 kv_lora 128, top-k 512\n"
    )
    rows = [
        [context] + [f"{latency(k, context, args.batch, args.repeats) * 1e3:.2f}" for k in KINDS]
        for context in args.contexts
    ]
    print(harness.table(["context", *KINDS], rows))
    print("\n## Cache bytes per layer (bf16 buffers, int32 bookkeeping), V4-Flash / V3.2 sizes\n")
    print("\n".join(cache_table()))


if __name__ == "__main__":
    main()
