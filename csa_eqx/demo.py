"""``make demo`` placeholder: build one CSA layer at a modest size and run it."""

from __future__ import annotations

import time

import equinox as eqx
import jax
import jax.numpy as jnp

from .config import V4AttentionConfig
from .v4 import V4Attention


def main() -> None:
    cfg = V4AttentionConfig(
        hidden_size=256,
        num_heads=8,
        head_dim=64,
        rope_dim=16,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=64,
        compress_rate=4,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=64,
    )
    layer = V4Attention(cfg, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 2048, cfg.hidden_size))
    run = eqx.filter_jit(lambda m, x: m(x, return_aux=True))
    y, aux = run(layer, x)
    y.block_until_ready()
    start = time.perf_counter()
    y, aux = run(layer, x)
    y.block_until_ready()
    sel = aux["selection"]
    print(
        f"CSA layer on {x.shape}: output {y.shape}, {time.perf_counter() - start:.3f}s/call, "
        f"finite={bool(jnp.isfinite(y).all())}"
    )
    print(f"query 2047 selected entries {sorted(sel[0, -1].tolist())[:8]}… of {2048 // 4}")


if __name__ == "__main__":
    main()
