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
import os
import platform
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import csa_eqx as ce
from csa_eqx.cache import cache_bytes

SMALL_V4 = ce.V4AttentionConfig(
    hidden_size=256,
    num_heads=8,
    head_dim=64,
    rope_dim=16,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=64,
    sliding_window=128,
    compress_rate=4,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=128,
)
SMALL_V32 = ce.V32AttentionConfig(
    hidden_size=256,
    num_heads=8,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=512,
)
RATES = {"sliding": 0, "csa": 4, "hca": 128}


def layer_for(kind: str, v4: ce.V4AttentionConfig, v32: ce.V32AttentionConfig, abstract=False):
    if kind == "dsa":
        build = lambda: ce.V32Attention(v32, key=jax.random.key(0))  # noqa: E731
    else:
        cfg = dataclasses.replace(v4, compress_rate=RATES[kind])
        build = lambda: ce.V4Attention(cfg, key=jax.random.key(0))  # noqa: E731
    return eqx.filter_eval_shape(build) if abstract else build()


def filled(cache, context: int, key):
    """``cache`` as if ``context`` tokens of one segment had been written (random buffers)."""
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
        if cache.entry_end.shape[1]:
            m = cache.max_length // cache.entry_end.shape[1]
            j = jnp.arange(cache.entry_end.shape[1])
            fields["entry_end"] = jnp.where(j < context // m, j * m + m - 1, -1)[None].repeat(b, 0)
            fields["entry_segment"] = jnp.where(j < context // m, 0, -1)[None].repeat(b, 0)
            fields["entry_count"] = jnp.full((b,), context // m, jnp.int32)
    return dataclasses.replace(cache, **fields)


@eqx.filter_jit(donate="all-except-first")
def step(fixed, cache):
    """One decode step; donates the cache (not ``fixed = (layer, x)``)."""
    layer, x = fixed
    return layer.extend(x, cache)


def latency(kind: str, context: int, batch: int, repeats: int) -> float:
    """Median seconds of one decode step after ``context`` tokens."""
    layer = layer_for(kind, SMALL_V4, SMALL_V32)
    cache = filled(layer.init_cache(batch, context + 8), context, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (batch, 1, SMALL_V4.hidden_size))
    for _ in range(2):  # compile + warm up (steps advance the cache by one token each)
        y, cache = step((layer, x), cache)
    jax.block_until_ready(y)
    times = []
    for _ in range(repeats):
        if int(cache.length[0]) >= context + 8:
            break
        t0 = time.perf_counter()
        y, cache = step((layer, x), cache)
        jax.block_until_ready(y)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def hf_bytes(
    kind: str, v4: ce.V4AttentionConfig, v32: ce.V32AttentionConfig, tokens: int, itemsize: int
) -> int:
    """What HF's DynamicCache layer holds after ``tokens`` tokens (``DynamicSlidingWindowLayer``:
    the last ``sliding_window - 1`` kv rows, K and V sharing storage; ``DeepseekV4HCACache`` /
    ``DeepseekV4CSACache``: plus compressed entries, the < m pending (C, Z) tokens and, for CSA,
    the indexer's entries and both overlap a-halves; V3.2: latent and indexer key per token).
    Pending tokens are counted at their maximum (m - 1)."""
    if kind == "dsa":
        return tokens * (v32.kv_lora_rank + v32.qk_rope_head_dim + v32.index_head_dim) * itemsize
    d, m = v4.head_dim, RATES[kind]
    n = (min(tokens, v4.sliding_window - 1)) * d
    if kind == "hca":
        n += tokens // m * d + (m - 1) * 2 * d
    if kind == "csa":
        di = v4.index_head_dim
        n += tokens // m * (d + di) + (m - 1) * 2 * (2 * d + 2 * di) + m * (d + di) * 2
    return n * itemsize


def cache_table(tokens: tuple[int, ...] = (4096, 65536, 1 << 20)) -> list[str]:
    """Bytes per token per layer type (bf16 buffers) at V4-Flash (and V3.2) layer sizes."""
    v4, v32 = ce.V4AttentionConfig(), ce.V32AttentionConfig()  # defaults = V4-Flash / V3.2 sizes
    lines = [
        "| layer | ours: fixed bytes | ours: bytes/token | HF DynamicCache bytes/token "
        + "".join(f"| ours @{t} tok | HF @{t} tok " for t in tokens)
        + "|",
        "|---" * (4 + 2 * len(tokens)) + "|",
    ]
    for kind in ("sliding", "csa", "hca", "dsa"):
        layer = layer_for(kind, v4, v32, abstract=True)
        sizes = {}
        for t in (1 << 16, 1 << 17) + tokens:
            cache = jax.eval_shape(lambda t=t, layer=layer: layer.init_cache(1, t, jnp.bfloat16))
            sizes[t] = cache_bytes(cache)
        per_token = (sizes[1 << 17] - sizes[1 << 16]) / (1 << 16)
        fixed = sizes[1 << 16] - per_token * (1 << 16)
        hf_per = (hf_bytes(kind, v4, v32, 1 << 17, 2) - hf_bytes(kind, v4, v32, 1 << 16, 2)) / (
            1 << 16
        )
        row = f"| {kind} | {fixed:,.0f} | {per_token:.2f} | {hf_per:.2f} "
        row += "".join(
            f"| {sizes[t] / 2**20:,.2f} MiB | {hf_bytes(kind, v4, v32, t, 2) / 2**20:,.2f} MiB "
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
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}"
    )
    print(f"\n## Decode step latency (ms, median of {args.repeats}, batch {args.batch})\n")
    print(
        "small dims: V4 hidden 256, 8 heads x 64, window 128, CSA m=4 top-k 128, HCA m=128; "
        "V3.2 kv_lora 128, top-k 512\n"
    )
    print("| context |" + "".join(f" {k} |" for k in ("sliding", "csa", "hca", "dsa")))
    print("|---" * 5 + "|")
    for context in args.contexts:
        row = [
            latency(kind, context, args.batch, args.repeats) * 1e3
            for kind in ("sliding", "csa", "hca", "dsa")
        ]
        print(f"| {context} |" + "".join(f" {t:.2f} |" for t in row), flush=True)
    print("\n## Cache bytes per layer (bf16 buffers, int32 bookkeeping), V4-Flash / V3.2 sizes\n")
    print("\n".join(cache_table()))


if __name__ == "__main__":
    main()
