"""The reference indexer shape alone (issue 54, item 7), for A/B runs of the fused indexer from
two trees: Q = K = ``--seq`` token keys, 32 heads x 128, k = 2048, bf16, causal, the automatic
selection (``MosaicSelection`` on a TPU), compiled, one first call, then ``--reps`` timed calls.
Writes ``OUT/anchor_<label>.json``: the tree's ``label``, the strategy, the compile and call
times, and a checksum of the picks (two trees that select alike print the same one).
``--quick``: a tiny shape, a CPU smoke run (interpreted).

    python -m benchmarks.anchor --out DIR --label NAME [--seq 32768] [--reps 5] \\
        [--head-group G] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

import csa_eqx as ce

from .accelerator_table import MODES, anchor_inputs, anchor_problem, anchor_select
from .chosen import automatic_selection, platform_execution


def checksum(picks: np.ndarray) -> int:
    """Each pick weighted by its place (picks that differ only in order differ here too)."""
    flat = picks.astype(np.int64).reshape(-1) + 1
    return int(np.sum(flat * (np.arange(flat.size) % 9973 + 1)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--label", required=True, help="the tree's name in the record")
    p.add_argument("--seq", type=int, help="tokens (default: the anchor's 32768)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--head-group", type=int, help="MosaicSelection's heads per matmul")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = dict(MODES["quick" if args.quick else "full"]["anchor"])
    shape["seq"] = args.seq or shape["seq"]
    q, w, keys = anchor_inputs(shape["seq"], shape["heads"], shape["dim"])
    execution = platform_execution(ce.Execution())
    strategy = automatic_selection(execution.selection, anchor_problem(q, w, keys))
    if args.head_group:
        strategy = eqx.tree_at(lambda s: s.head_group, strategy, args.head_group)
    select = jax.jit(anchor_select, static_argnums=(3, 4))
    start = time.perf_counter()
    compiled = select.lower(q, w, keys, shape["k"], strategy).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    picks = np.asarray(compiled(q, w, keys))
    first_s = time.perf_counter() - start
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, w, keys))
        times.append(time.perf_counter() - start)
    rec = dict(
        label=args.label,
        device=str(jax.devices()[0].device_kind),
        shape=shape,
        strategy=repr(strategy),
        compile_s=compile_s,
        first_s=first_s,
        times_s=times,
        median_ms=1e3 * float(np.median(times)),
        min_ms=1e3 * float(np.min(times)),
        picks_checksum=checksum(picks),
    )
    (args.out / f"anchor_{args.label}.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({k: rec[k] for k in ("label", "median_ms", "min_ms", "picks_checksum")}))


if __name__ == "__main__":
    main()
