"""V4 against V4.1: an attention-only stack of eight layers, compiled memory and CPU time.

Both stacks share small main dims (hidden 256, 4 heads x 64, full-width RoPE 64, window 128)
and keep each release's indexer (docs/v41.md, "V4 against V4.1"):

- **V4** (DeepSeek-V4-Flash's pattern): sliding, sliding, then CSA (m = 4) and HCA (m = 128)
  alternating; every CSA layer compresses and runs its own indexer (64 heads x 128, k = 512).
- **V4.1** (the released schedule's shape in eight layers): compress ratios
  ``0, 0, 2, 2, 2, 1, 1, 1``; KV sources 2 and 5, index sources 2, 5 and 6, candidate source 5
  (``Nb = 2048`` blocks of ``bc = 8``), indexer 32 heads x 128, k = 512. Roles: sliding,
  sliding, full, reuse, reuse, full with candidates, reindex, reuse.

Each layer's output is added to its input (``x + y``, no norm or MLP). Memory: XLA's temp bytes
of ``grad(sum(stack(x)))`` w.r.t. every parameter and ``x``, compiled for shapes only (nothing
runs), batch 1, float32, the automatic execution. Time: the forward and the forward + backward
at ``--time-seq`` tokens, compiled first, then ``--reps`` interleaved timed calls each (median).

``python -m benchmarks.v41_stack [--seqs 65536 131072 1048576] [--time-seq 4096] [--reps 3]``
prints markdown tables (``--seqs`` with no value: the timing only; ``--time-seq 0``: the memory
only).
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from csa_eqx import V4Attention, V41Attention, V41AttentionConfig, presets

from . import harness

# the main dims of the CPU pages' speed layer (hidden 256, 4 heads x 64, RoPE 64, window 128)
MAIN = {
    field: getattr(harness.speed_layer(), field)
    for field in (
        "hidden_size",
        "num_heads",
        "head_dim",
        "rope_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "sliding_window",
    )
}
V4_KINDS = ("sliding", "sliding", "csa", "hca", "csa", "hca", "csa", "hca")
V41_CONFIG = V41AttentionConfig(
    compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1),
    kv_source_layers=(2, 5),
    index_source_layers=(2, 5, 6),
    candidate_source_layer=5,
    candidate_topk_blocks=2048,
    candidate_block_size=8,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=512,
    **MAIN,
)


def v4_stack(key) -> list[V4Attention]:
    """The eight V4 layers (module docstring)."""
    keys = jax.random.split(key, len(V4_KINDS))
    return [
        V4Attention(presets.v4_flash(kind, **MAIN), key=k)
        for kind, k in zip(V4_KINDS, keys, strict=True)
    ]


def v41_stack(key) -> list[V41Attention]:
    """The eight V4.1 layers (module docstring)."""
    keys = jax.random.split(key, V41_CONFIG.num_layers)
    return [V41Attention(V41_CONFIG, i, key=k) for i, k in enumerate(keys)]


def run_v4(layers, x):
    """The V4 stack with residual adds."""
    for layer in layers:
        x = x + layer(x)
    return x


def run_v41(layers, x):
    """The V4.1 stack with residual adds; what a layer publishes goes to the next."""
    shared = None
    for layer in layers:
        y, shared = layer(x, shared)
        x = x + y
    return x


STACKS = {"V4": (v4_stack, run_v4), "V4.1": (v41_stack, run_v41)}


def stack_shapes(name: str, seq: int):
    """``(layers, x)`` as shapes only: the stack ``name`` and a float32 ``x[1, seq, 256]``."""
    build, _ = STACKS[name]
    layers = eqx.filter_eval_shape(build, jax.random.key(0))
    return layers, jax.ShapeDtypeStruct((1, seq, MAIN["hidden_size"]), jnp.float32)


def fwd_bwd(run):
    """``grad(sum(run(layers, x)))`` w.r.t. the layers' arrays and ``x``."""
    return jax.grad(lambda layers, x: jnp.sum(run(layers, x)), argnums=(0, 1))


def temp_bytes(name: str, seq: int) -> tuple[int, float]:
    """XLA temp bytes of the stack's fwd+bwd at ``seq`` tokens, and the compile's seconds."""
    start = time.perf_counter()
    temp = harness.temp_bytes(fwd_bwd(STACKS[name][1]), *stack_shapes(name, seq))
    return temp, time.perf_counter() - start


def timings(seq: int, reps: int) -> dict[str, dict[str, float]]:
    """Median seconds of the forward and the fwd+bwd of each stack at ``seq`` tokens (after a
    compile and a warm-up call), interleaved, and each program's compile seconds."""
    x = jax.random.normal(jax.random.key(1), (1, seq, MAIN["hidden_size"]), jnp.float32)
    runs, compiles = {}, {}
    for name, (build, run) in STACKS.items():
        layers = build(jax.random.key(0))
        for what, fn in (("forward", run), ("fwd+bwd", fwd_bwd(run))):
            start = time.perf_counter()
            compiled = harness.compile_for(fn, layers, x)
            compiles[(name, what)] = time.perf_counter() - start
            runs[(name, what)] = harness.blocking(compiled, layers, x)
    times = harness.interleaved(runs, reps)
    return {
        name: {
            **{
                what: harness.summary(times[(name, what)])["median"]
                for what in ("forward", "fwd+bwd")
            },
            **{f"compile {what}": compiles[(name, what)] for what in ("forward", "fwd+bwd")},
        }
        for name in STACKS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, nargs="*", default=[65536, 131072, 1048576])
    parser.add_argument("--time-seq", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(harness.machine_markdown(harness.machine_info()))
    rows = []
    for seq in args.seqs:  # none: the timing table only
        cells = [f"{seq:,}"]
        for name in STACKS:
            temp, secs = temp_bytes(name, seq)
            cells.append(f"{temp / harness.GIB:.2f} ({secs:.0f} s)")
        rows.append(cells)
        print(f"memory at {seq}: {cells}", flush=True)
    if rows:
        print("\nfwd+bwd temp memory, GiB (compile seconds):\n")
        print(harness.table(["S", *STACKS], rows))
    if not args.time_seq:  # 0: the memory table only
        return
    result = timings(args.time_seq, args.reps)
    header = ["stack", "forward (s)", "fwd+bwd (s)", "compile fwd (s)", "compile fwd+bwd (s)"]
    rows = [
        [
            name,
            *(f"{r[k]:.2f}" for k in ("forward", "fwd+bwd", "compile forward", "compile fwd+bwd")),
        ]
        for name, r in result.items()
    ]
    print(f"\nCPU time at S = {args.time_seq} (median of {args.reps}, interleaved):\n")
    print(harness.table(header, rows))


if __name__ == "__main__":
    main()
