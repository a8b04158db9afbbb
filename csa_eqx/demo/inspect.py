"""``csa-eqx inspect``: a layer's parameter shapes and counts, and XLA's memory estimate."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import Execution, V4Attention, V32Attention, presets

__all__ = ["PRESETS", "layer_for", "inspect_layer"]

# preset name -> (V4 layer of a kind, V3.2 DSA layer); the full-size V4 presets pair with
# DeepSeek-V3.2's own sizes for ``dsa`` (V4 has no DSA layer)
PRESETS = {
    "v4-flash": (presets.v4_flash, presets.v32),
    "v4-pro": (presets.v4_pro, presets.v32),
    "tiny": (presets.tiny_v4, presets.tiny_v32),
}


def layer_for(kind: str, preset: str, chunk: int = 0):
    """An abstract (shape-only) layer of ``kind`` (``sliding`` / ``csa`` / ``hca`` / ``dsa``)
    at ``preset`` sizes, with ``qk_head_chunk_size=chunk``."""
    v4, v32 = PRESETS[preset]
    execution = Execution(qk_head_chunk_size=chunk)
    if kind == "dsa":
        cfg = v32()
        return jax.eval_shape(lambda: V32Attention(cfg, key=jax.random.key(0), execution=execution))
    cfg = v4(kind)
    return jax.eval_shape(lambda: V4Attention(cfg, key=jax.random.key(0), execution=execution))


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
