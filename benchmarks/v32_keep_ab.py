"""A/B on a TPU (issue 54, item 3): V3.2 DSA at released sizes, fwd+bwd at ``--seq`` (32k: 4
head groups), its first head groups keeping their kernel's output and ``lse`` for the backward
(``csa_eqx._layers.v32.KEEP``, the default: one group at 32k) against every group's forward
recomputed in the backward (``KEEP = 0``, main before issue 54). Each variant compiled
(``KEEP`` is read while tracing), its compiled memory recorded and run only where it fits the
device's free memory, then a first call each and ``--reps`` rounds of one call per variant,
alternating. Writes ``OUT/v32_keep_ab.json``: per variant ``keep`` (groups that keep),
``memory`` (XLA's, bytes), ``kernel_calls``, ``first_s`` and ``times_s``; ``--quick``: the tiny
V3.2 layer with ``MosaicAttention`` and 2 forced head groups (a CPU smoke run, interpreted).

    python -m benchmarks.v32_keep_ab --out DIR [--seq 32768] [--reps 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

import csa_eqx as ce
from csa_eqx import presets
from csa_eqx._layers import v32

from . import harness
from .accelerator_table import alternating_rounds, first_call, released_layer
from .harness import forward


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        config, seq = presets.tiny_v32(), 32
        execution = ce.Execution(attention=ce.MosaicAttention(8, 0, 8, 128, "tiles"))

        def build(key):
            return ce.V32Attention(config, key=key, dtype=jnp.bfloat16, execution=execution)

        v32.head_groups = lambda shape, width: 2  # noqa: ARG005 - forced, as the tests do
        keeps = {"recompute": 0, "keep": 1 << 40}
    else:
        config, build = released_layer("v32_dsa", "full")
        seq = args.seq
        keeps = {"recompute": 0, "keep": v32.KEEP}
    res: dict = dict(
        device=str(jax.devices()[0].device_kind), seq=seq, default_keep=v32.KEEP, variants={}
    )
    path = args.out / "v32_keep_ab.json"

    def save():
        path.write_text(json.dumps(res, indent=1, default=str))

    layer = eqx.filter_jit(build)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, seq, config.hidden_size), jnp.bfloat16)
    heads, width = config.num_heads, config.kv_lora_rank + config.qk_rope_head_dim
    groups = v32.head_groups((1, seq, heads, config.qk_nope_head_dim), width)
    runs = {}
    for name, keep in keeps.items():
        v32.KEEP = keep
        shape = (1, seq, heads, config.qk_nope_head_dim)
        rec = res["variants"][name] = dict(
            KEEP=keep, groups=groups, keep=v32.kept_parts(shape, groups, config.kv_lora_rank)
        )
        called = first_call(harness.fwd_bwd(forward), (layer, x), rec)
        if called is not None:
            runs[name] = called[0]
        save()
    alternating_rounds(runs, res["variants"], args.reps, save)
    print(json.dumps(res, indent=1, default=str), flush=True)


if __name__ == "__main__":
    main()
