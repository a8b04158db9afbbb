"""Wall time of one V4 CSA layer: csa_eqx vs the naive dense-mask baseline vs HF transformers.

All three run the SAME weights: a random transformers ``DeepseekV4Attention`` (torch eager,
float32) is loaded into ``csa_eqx`` with ``csa_eqx.hf.load_v4_attention``; the naive baseline
(``benchmarks/naive_baseline.py``) reuses the csa_eqx parameters. Layer: hidden 256, 4 heads x
64, indexer 64 heads x 128, top-k 512, m = 4, window 128, B = 1, S = 4096. Repetitions are
interleaved (one of each implementation per round) so the ratios share the machine's load.

It also reports the indexer's achieved FLOP/s (selection stage alone) as a fraction of this
machine's float32 GEMM throughput (a ``jnp.dot`` of two square matrices) in the same run.

    python -m benchmarks.layer_speed [--seq 4096] [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from csa_eqx import Visibility, entry_layout

from . import harness
from .harness import forward
from .naive_baseline import naive_v4_csa


def hf_and_ours(config, seed: int = 0):
    """``(torch layer, HF config, csa_eqx layer)`` for a V4 layer ``config``: a random
    transformers ``DeepseekV4Attention`` and the same weights loaded into csa_eqx."""
    from csa_eqx.hf import load_v4_attention
    from csa_eqx.testing import hf_v4_config, random_hf_v4_layer, state_dict_numpy

    hf_config = hf_v4_config(config)
    torch_layer = random_hf_v4_layer(hf_config, seed)
    return torch_layer, hf_config, load_v4_attention(state_dict_numpy(torch_layer), hf_config, 0)


def jax_layer_programs(layer, x) -> dict[str, tuple[Callable, tuple]]:
    """``{name: (function, arguments)}`` of the JAX runs timed side by side: csa_eqx and the
    naive baseline, fwd and fwd+bwd (gradient w.r.t. the layer's arrays and ``x``), and
    csa_eqx's selection stage alone; jit and compile them with ``harness``."""
    return {
        "csa_eqx fwd": (forward, (layer, x)),
        "naive fwd": (naive_v4_csa, (layer, x)),
        "csa_eqx fwd+bwd": (harness.fwd_bwd(forward), (layer, x)),
        "naive fwd+bwd": (harness.fwd_bwd(naive_v4_csa), (layer, x)),
        "selection stage": (selection_stage, (layer, x)),
    }


def selection_stage(layer, x):
    """The indexer's selection stage of ``layer(x)`` (compressor, queries, scores, top-k)."""
    b, s, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    segment = jnp.zeros((b, s), jnp.int32)
    qr, _, _ = layer.block.project_qkv(x, positions)
    layout = entry_layout(segment, layer.config.compress_rate)
    keys = layer.index_compressor(x, positions, layout)
    visibility = Visibility(positions, segment, layout)
    ex, indexer = layer.execution, layer.indexer
    problem = indexer.problem(x, qr, positions, keys, visibility, ex, layer.formats)
    return indexer.select(problem, ex)


FLOP_ROWS = (
    ("with_projections", "all matmuls of the stage (visible-pair scoring + projections)"),
    ("visible", "scoring of the visible pairs only"),
    ("all_pairs", "scoring of all S x T pairs (a dense count; block skipping never computes them)"),
)


def indexer_flops(b: int, s: int, c) -> dict[str, float]:
    """FLOPs of the selection stage for a layer config ``c``: scoring (q.k: 2*d per head and
    pair; weighting: 2 per head and pair) over the causally visible pairs (query i sees
    floor((i+1)/m) entries) and over all ``S x T`` pairs, and the visible scoring plus the
    stage's projections (query latent, indexer queries and head weights, and the indexer's
    compressor: values and gates of 2*d channels each)."""
    heads, dim, m = c.index_n_heads, c.index_head_dim, c.compress_rate
    per_pair = 2 * heads * dim + 2 * heads
    visible = b * int(np.sum((np.arange(s) + 1) // m)) * per_pair
    hidden, q_lora = c.hidden_size, c.q_lora_rank
    projections = 2 * b * s * (hidden * q_lora + q_lora * heads * dim + hidden * heads)
    projections += 2 * b * s * hidden * 4 * dim
    return dict(
        visible=visible,
        all_pairs=b * s * (s // m) * per_pair,
        with_projections=visible + projections,
    )


def output_check(torch_layer, hf_config, layer, x) -> dict:
    """Same function, checked once outside the timing against HF (float32, on the CPU): the
    rows whose top-k set equals HF's (float summation order can swap near-tied picks) and
    the output error on those rows."""
    from csa_eqx.testing import run_hf_v4

    want, hf_sel, _ = run_hf_v4(torch_layer, hf_config, np.asarray(x, np.float32))
    got, aux = jax.jit(lambda m, x: m(x, return_aux=True))(layer, x)
    got, sel = np.asarray(got, np.float32), np.sort(np.asarray(aux["selection"]), -1)
    k = hf_sel.shape[-1]
    same = (np.sort(hf_sel, -1) == sel[..., sel.shape[-1] - k :]).all(-1)
    same &= (sel[..., : sel.shape[-1] - k] == -1).all(-1)
    err = np.abs(got - want).max(-1) / np.abs(want).max()
    return dict(same_rows=float(same.mean()), err_same=float(err[same].max()), err=float(err.max()))


def measure(seq: int = 4096, reps: int = 5, quick: bool = False, with_hf: bool = True) -> dict:
    """All timings of one run; returns medians, minima and the derived ratios."""
    import torch

    from csa_eqx.testing import hf_v4_runner

    torch.set_num_threads(os.cpu_count() or 1)
    torch_layer, hf_config, layer = hf_and_ours(harness.speed_layer(quick))
    x_np = np.random.default_rng(0).normal(size=(1, seq, layer.config.hidden_size))
    x = jnp.asarray(x_np, jnp.float32)
    n = 512 if quick else 2048
    runs = {
        name: harness.blocking(jax.jit(fn), *args)
        for name, (fn, args) in jax_layer_programs(layer, x).items()
    }
    runs["f32 GEMM"] = harness.gemm(n, jnp.float32)
    check = None
    if with_hf:
        runs["HF eager fwd"], runs["HF eager fwd+bwd"] = hf_v4_runner(torch_layer, hf_config, x_np)
        check = output_check(torch_layer, hf_config, layer, x)
    stats = {k: harness.summary(v) for k, v in harness.interleaved(runs, reps, settle=1).items()}
    med = {k: v["median"] for k, v in stats.items()}
    low = {k: v["min"] for k, v in stats.items()}
    return dict(
        seq=seq,
        reps=reps,
        median=med,
        min=low,
        gemm_n=n,
        gemm_flops_per_s={k: 2 * n**3 / v["f32 GEMM"] for k, v in (("median", med), ("min", low))},
        indexer_flops=indexer_flops(1, seq, layer.config),
        hf_check=check,
        threads=torch.get_num_threads(),
    )


def markdown(r: dict) -> str:
    """The result as markdown tables (times, ratios, FLOP fraction)."""
    med, low = r["median"], r["min"]
    lines = [
        f"B = 1, S = {r['seq']}, float32, {r['reps']} interleaved rounds (each timed call right "
        "after an untimed call of the same function) after one warm-up "
        f"call each; torch threads = {r['threads']}, XLA CPU default threads.",
        "",
        "| implementation | fwd median (s) | fwd min (s) | fwd+bwd median (s) | fwd+bwd min (s) |",
        "|---|---|---|---|---|",
    ]
    names = [("csa_eqx", "csa_eqx"), ("naive", "naive dense-mask (JAX)")]
    if "HF eager fwd" in med:
        names.append(("HF eager", "HF transformers eager (torch)"))
    for key, label in names:
        f, fb = f"{key} fwd", f"{key} fwd+bwd"
        lines.append(f"| {label} | {med[f]:.3f} | {low[f]:.3f} | {med[fb]:.3f} | {low[fb]:.3f} |")
    lines += ["", "| speed-up of csa_eqx over | fwd (median / min) | fwd+bwd (median / min) |"]
    lines.append("|---|---|---|")
    for key, label in names[1:]:
        cells = [
            f"{med[f'{key} {p}'] / med[f'csa_eqx {p}']:.2f}x / "
            f"{low[f'{key} {p}'] / low[f'csa_eqx {p}']:.2f}x"
            for p in ("fwd", "fwd+bwd")
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    flops, gemm = r["indexer_flops"], r["gemm_flops_per_s"]
    lines += [
        "",
        f"Indexer throughput (selection stage alone: compressor, query projection, scoring, "
        f"streaming top-k): {med['selection stage']:.3f} s median, "
        f"{low['selection stage']:.3f} s min. f32 GEMM ({r['gemm_n']}x{r['gemm_n']} "
        f"`jnp.dot`): {gemm['median'] / 1e9:.1f} GFLOP/s median, {gemm['min'] / 1e9:.1f} "
        "GFLOP/s best.",
        "",
        "| FLOPs counted | GFLOP | achieved GFLOP/s (min time) | fraction of best f32 GEMM |",
        "|---|---|---|---|",
    ]
    for key, label in FLOP_ROWS:
        rate = flops[key] / low["selection stage"]
        lines.append(
            f"| {label} | {flops[key] / 1e9:.1f} | {rate / 1e9:.1f} | {rate / gemm['min']:.0%} |"
        )
    if "HF eager fwd" in med:
        c = r["hf_check"]
        fraction = flops["with_projections"] / low["selection stage"] / gemm["min"]
        scoring = flops["visible"] / low["selection stage"] / gemm["min"]
        speedup = med["HF eager fwd+bwd"] / med["csa_eqx fwd+bwd"]
        lines += [
            "",
            f"Target >= 3x faster than HF (fwd+bwd, median): **{speedup:.2f}x, "
            f"{'met' if speedup >= 3 else 'missed'}**. Target >= 50% of f32 GEMM, counting "
            f"every matmul of the stage: **{fraction:.0%}, {'met' if fraction >= 0.5 else 'missed'}"
            f"** (scoring of the visible pairs alone: {scoring:.0%}).",
            "",
            f"Output check (same weights and input): {c['same_rows']:.2%} of the query rows "
            f"select the same top-k set as HF; on them max |ours - HF| / max |HF| = "
            f"{c['err_same']:.1e} (all rows: {c['err']:.1e}; the other rows swap near-tied "
            "picks, float summation order differs between torch and XLA).",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny layer, for a smoke test")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers layer")
    args = parser.parse_args()
    print(harness.machine_markdown(harness.machine_info()))
    print(markdown(measure(args.seq, args.reps, args.quick, with_hf=not args.no_hf)))


if __name__ == "__main__":
    main()
