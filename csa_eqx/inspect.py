"""``csa-eqx inspect``: a layer's parameter shapes and counts, and XLA's memory estimate."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from .config import V4AttentionConfig, V32AttentionConfig
from .v4 import V4Attention
from .v32 import V32Attention

__all__ = ["PRESETS", "layer_for", "inspect_layer"]

PRESETS = {
    # DeepSeek-V4-Flash attention sizes (HF config defaults); HCA m = 128.
    "v4-flash": V4AttentionConfig(),
    "tiny": V4AttentionConfig(
        hidden_size=64,
        num_heads=4,
        head_dim=32,
        rope_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=8,
    ),
}
_V32 = {
    "v4-flash": V32AttentionConfig(),
    "tiny": V32AttentionConfig(
        hidden_size=64,
        num_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=8,
    ),
}


def layer_for(kind: str, preset: str, chunk: int = 0):
    """An abstract (shape-only) layer of ``kind`` at ``preset`` sizes."""
    if kind == "dsa":
        cfg = dataclasses.replace(_V32[preset], qk_head_chunk_size=chunk)
        return jax.eval_shape(lambda: V32Attention(cfg, key=jax.random.key(0)))
    base = PRESETS[preset]
    rate = {"sliding": 0, "csa": 4, "hca": 128 if preset == "v4-flash" else 8}[kind]
    cfg = dataclasses.replace(base, compress_rate=rate, qk_head_chunk_size=chunk)
    return jax.eval_shape(lambda: V4Attention(cfg, key=jax.random.key(0)))


def _bytes(n: int | float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def inspect_layer(kind: str, seq_len: int, preset: str = "v4-flash", chunk: int = 0) -> str:
    """A text report: parameters per leaf, totals, and compiled fwd / fwd+bwd memory (B = 1)."""
    layer = layer_for(kind, preset, chunk)
    lines = [
        f"{type(layer).__name__} ({kind}, preset {preset}, qk_head_chunk_size={chunk})",
        f"config: {layer.config}",
        "",
        "parameters:",
    ]
    params, static = eqx.partition(layer, lambda v: isinstance(v, jax.ShapeDtypeStruct))
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        lines.append(f"  {name:<48} {str(tuple(leaf.shape)):<20} {leaf.size:>12,}")
        total += leaf.size
    lines.append(f"  {'total':<48} {'':<20} {total:>12,}  ({_bytes(4 * total)} in float32)")
    x = jax.ShapeDtypeStruct((1, seq_len, layer.config.hidden_size), jnp.float32)

    def fwd(p, x):
        return eqx.combine(p, static)(x)

    def fwd_bwd(p, x):
        return jax.grad(lambda p: jnp.sum(fwd(p, x)))(p)

    lines += ["", f"XLA compiled memory at S={seq_len}, B=1 (compile only, this backend):"]
    for label, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        mem = jax.jit(fn).lower(params, x).compile().memory_analysis()
        lines.append(
            f"  {label:<18} temp {_bytes(mem.temp_size_in_bytes)}, "
            f"arguments {_bytes(mem.argument_size_in_bytes)}, "
            f"outputs {_bytes(mem.output_size_in_bytes)}"
        )
    return "\n".join(lines)
