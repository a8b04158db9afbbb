"""Regenerate every benchmark table and plot: ``OUT/benchmarks.md`` and ``OUT/img/*.png``.

``csa-eqx bench [--out docs] [--quick]`` calls :func:`main`. The full run takes ~15-25 minutes
on a 2-core CPU (mostly XLA compiles of the naive baseline and HF's eager layer); ``--quick``
uses tiny sizes and only checks that everything runs (its numbers mean nothing).

The run is CPU only: compile-time memory numbers come from XLA's CPU backend, and the
selection-memory table needs 8 simulated CPU devices, which must be requested before JAX
starts its backend (importing this module does that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import jax  # XLA_FLAGS (set by selection_memory) is read when the backend starts

from . import selection_memory  # sets JAX_PLATFORMS=cpu and 8 host devices (before jax starts)

with contextlib.suppress(RuntimeError):  # a backend that is already running keeps its devices
    jax.config.update("jax_num_cpu_devices", 8)

from csa_eqx import V4AttentionConfig  # noqa: E402

from . import (  # noqa: E402
    decode_latency,
    harness,
    indexer_chunk_memory,
    layer_memory,
    layer_speed,
    remat_timing,
)
from .harness import table  # noqa: E402
from .naive_baseline import naive_v4_csa  # noqa: E402

GIB = harness.GIB
KINDS = decode_latency.KINDS


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each benchmark measures in a full or a quick run."""

    layer_config: V4AttentionConfig
    layer_seqs: tuple[int, ...]
    chunk_seqs: tuple[int, ...]
    selection_seq: int
    tensor_axes: tuple[int, ...]
    remat_seq: int
    remat_topk: int
    remat_reps: int
    speed_seq: int
    speed_reps: int
    contexts: tuple[int, ...]
    decode_reps: int


FULL = Sizes(
    layer_config=harness.speed_layer(),
    layer_seqs=(4096, 8192, 16384, 32768, 65536),
    chunk_seqs=(2048, 4096, 8192, 16384),
    selection_seq=16384,
    tensor_axes=(1, 2, 4, 8),
    remat_seq=2048,
    remat_topk=64,
    remat_reps=15,
    speed_seq=4096,
    speed_reps=5,
    contexts=(1024, 4096, 16384, 65536),
    decode_reps=20,
)
QUICK = Sizes(
    layer_config=harness.speed_layer(quick=True),
    layer_seqs=(128,),
    chunk_seqs=(256,),
    selection_seq=512,
    tensor_axes=(1, 2),
    remat_seq=128,
    remat_topk=8,
    remat_reps=1,
    speed_seq=128,
    speed_reps=1,
    contexts=(256,),
    decode_reps=2,
)


def plot(path: Path, title: str, xlabel: str, ylabel: str, series: dict, logy=True) -> None:
    """One line plot (log2 x axis) of ``series = {label: (xs, ys)}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def layer_memory_section(sz: Sizes, img: Path) -> str:
    variants = {"csa_eqx": layer_speed.forward, "naive dense-mask": naive_v4_csa}
    temps: dict[str, list[float]] = {v: [] for v in variants}
    rows = []
    for seq in sz.layer_seqs:
        row = [str(seq)]
        for name, forward in variants.items():
            temp = layer_memory.fwd_bwd_temp_bytes(sz.layer_config, forward, seq)[0] / GIB
            growth = f" (x{temp / temps[name][-1]:.2f})" if temps[name] else ""
            temps[name].append(temp)
            row.append(f"{temp:.3f}{growth}")
        rows.append(row)
    plot(
        img / "layer_memory.png",
        "V4 CSA layer fwd+bwd, XLA temp memory",
        "sequence length S",
        "GiB",
        {v: (sz.layer_seqs, t) for v, t in temps.items()},
    )
    ours = dict(zip(sz.layer_seqs, temps["csa_eqx"], strict=True))
    growth = [b / a for a, b in zip(temps["csa_eqx"], temps["csa_eqx"][1:], strict=False)]
    verdict = ""
    if 16384 in ours:
        verdict = (
            f"Targets (issue 5): <= 1 GiB at S = 16k: **{ours[16384]:.3f} GiB, "
            f"{'met' if ours[16384] <= 1 else 'missed'}**; <= 2.2x per doubling of S: "
            f"**max x{max(growth):.2f}, {'met' if max(growth) <= 2.2 else 'missed'}**."
        )
    c = sz.layer_config
    return "\n\n".join(
        [
            f"Layer: hidden {c.hidden_size}, {c.num_heads} heads x {c.head_dim}, q_lora_rank "
            f"{c.q_lora_rank}, window {c.sliding_window}, m = {c.compress_rate}, indexer "
            f"{c.index_n_heads} heads x {c.index_head_dim}, top-k {c.index_topk}; float32, "
            "B = 1, default config (no block sizes set). Compiled: `jax.grad(sum(layer(x)))` "
            "w.r.t. all parameters and x; `memory_analysis().temp_size_in_bytes`, nothing "
            "runs. (xN) = growth per doubling of S.",
            table(["S", "csa_eqx (GiB)", "naive dense-mask (GiB)"], rows),
            verdict,
            "![layer memory](img/layer_memory.png)",
        ]
    ).replace("\n\n\n\n", "\n\n")


def chunk_memory_section(sz: Sizes, img: Path) -> str:
    m = indexer_chunk_memory
    parts = []
    for title, step, make_args, png in (
        ("indexer scores fwd+bwd", m.scoring_step, m.scoring_args, "indexer_chunk_memory.png"),
        ("KL target (grad w.r.t. scores)", m.kl_step, m.kl_args, "kl_chunk_memory.png"),
    ):
        temps = {c: [] for c in m.CHUNKS}
        rows = []
        holds = True
        for s in sz.chunk_seqs:
            score = 4 * m.HEADS * s * (s // m.RATE) / GIB
            for c in m.CHUNKS:
                temps[c].append(harness.temp_bytes(step(c), *make_args(s)) / GIB)
            for c in m.CHUNKS[1:]:
                holds &= temps[0][-1] - temps[c][-1] >= (1 - c / m.HEADS) * score
            rows.append([s, f"{score:.3f}"] + [f"{temps[c][-1]:.3f}" for c in m.CHUNKS])
        header = ["S", "[B,H,S,T] f32", "unchunked"] + [f"chunk {c}" for c in m.CHUNKS[1:]]
        label = {0: "unchunked"} | {c: f"chunk {c}" for c in m.CHUNKS[1:]}
        plot(
            img / png,
            f"{title}, XLA temp memory",
            "sequence length S",
            "GiB",
            {label[c]: (sz.chunk_seqs, t) for c, t in temps.items()},
        )
        claim = "holds" if holds else "**fails**"
        parts += [
            f"**{title}** (GiB). Claim unchunked - chunked >= (1 - c/H) x [B,H,S,T] f32 at "
            f"every S and c: {claim}.",
            table(header, rows),
            f"![{title}](img/{png})",
        ]
    return "\n\n".join(parts)


def selection_memory_section(sz: Sizes, img: Path) -> str:
    sm = selection_memory
    s = sz.selection_seq
    columns = [f"{p} head_chunk={c}" for p, c in sm.COLUMNS]
    axes = [tp for tp in sz.tensor_axes if tp <= jax.device_count()]
    gib = sm.rows(s, axes)
    plot(
        img / "selection_memory.png",
        f"selection stage per-device temp memory, S = {s}",
        "tensor-axis size",
        "GiB per device",
        {col: (axes, [gib[tp][i] for tp in axes]) for i, col in enumerate(columns)},
    )
    return "\n\n".join(
        [
            f"B = {sm.B}, S = {s}, indexer {sm.H} heads x {sm.D}, k = {sm.K}, m = {sm.M} "
            f"({s // sm.M} entries), float32; per-device GiB of the partitioned program "
            "(`csa_eqx.ShardedSelection`, query rows over the tensor axis). "
            '"dense" forces the materialised-score path (`DenseSelection`); "default" is what '
            "`AutoSelection` picks at this size (the streaming top-k).",
            sm.markdown(gib),
            "![selection memory](img/selection_memory.png)",
        ]
    )


def remat_section(sz: Sizes) -> str:
    times = remat_timing.measure(sz.remat_seq, sz.remat_topk, sz.remat_reps)
    stats = {label: harness.summary(t) for label, t in times.items()}
    rows = [[label, f"{s['median']:.4f}", f"{s['min']:.4f}"] for label, s in stats.items()]
    rec, sav = stats["selection recomputed"], stats["selection saved"]
    return "\n\n".join(
        [
            f"Checkpointed fwd+bwd (`jax.checkpoint(policy=compose_selection_policy(None))`), "
            f"small V4 CSA layer (hidden 512, 8 heads x 64, indexer 16 x 64, m = 4), B = 1, "
            f"S = {sz.remat_seq}, k = {sz.remat_topk}; {sz.remat_reps} interleaved rounds.",
            table(["variant", "median (s)", "min (s)"], rows),
            f"Ratio recomputed / saved: {rec['median'] / sav['median']:.3f}x "
            f"(median), {rec['min'] / sav['min']:.3f}x (min).",
        ]
    )


def decode_section(sz: Sizes, img: Path) -> str:
    ms = {k: [] for k in KINDS}
    rows = []
    for context in sz.contexts:
        for kind in KINDS:
            ms[kind].append(decode_latency.latency(kind, context, 1, sz.decode_reps) * 1e3)
        rows.append([context] + [f"{ms[k][-1]:.2f}" for k in KINDS])
    cache = decode_latency.cache_table()
    per = {r.split("|")[1].strip(): float(r.split("|")[3]) for r in cache[2:]}
    plot(
        img / "decode_latency.png",
        "decode step latency (small dims)",
        "context length",
        "ms per step (median)",
        {k: (sz.contexts, v) for k, v in ms.items()},
        logy=False,
    )
    return "\n\n".join(
        [
            f"Decode step latency (ms, median of {sz.decode_reps}, batch 1): one jitted, "
            "cache-donating `layer.extend(x[B,1,D], cache)` on a cache that already holds "
            "`context` tokens. Small dims: V4 hidden 256, 8 heads x 64, window 128, CSA m = 4 "
            "top-k 128, HCA m = 128; V3.2 (`dsa`) kv_lora 128, top-k 512.",
            table(["context", *KINDS], rows),
            "![decode latency](img/decode_latency.png)",
            "Cache bytes per layer at V4-Flash / V3.2 sizes (bf16 buffers, int32 "
            "bookkeeping; from `init_cache` shapes via `jax.eval_shape`, nothing allocated), "
            "next to what transformers' `DynamicCache` holds for the same layer (by formula, "
            "pending tokens counted at their maximum m - 1):",
            "\n".join(cache),
            f"Per-token cache of one layer relative to V3.2's: CSA {per['csa'] / per['dsa']:.1%}, "
            f"HCA {per['hca'] / per['dsa']:.2%}, sliding 0 (bounded by the window). V4's "
            "published whole-model ratios depend on the model's mix of layer types and are not "
            "available in this workspace, so they are not quoted.",
        ]
    )


PREAMBLE = """# Benchmarks

Generated by `csa-eqx bench` (`benchmarks/run_all.py`, from the repository root); every table
and plot on this page comes from one run of that command.{quick} Each benchmark can also be run
alone (`python -m benchmarks.<name>`); the command is given in each section.

## How to read these numbers

- **Compile-time numbers are deterministic**: the memory tables are XLA's
  `compiled.memory_analysis().temp_size_in_bytes` of programs that are compiled but never run
  (XLA CPU backend), so any sequence length fits and reruns give the same bytes. Cache sizes
  come from buffer shapes (`jax.eval_shape`).
- **Timings are noisy**: they were taken on a small shared machine (2 CPU cores, other jobs
  running at the same time). Every speed comparison is measured *in one process with the
  variants interleaved* (one call of each per round), and both the median and the minimum are
  reported; read ratios, not absolute seconds.
- **GPU numbers** (an H200, fp32 and bf16) are on their own page, [Benchmarks (GPU)](
  benchmarks_gpu.md), made by `python -m benchmarks.accelerator_table` on a lent machine (it
  makes the TPU page `benchmarks_tpu.md` too, "On a TPU" there): this command runs where it is
  started (here, the CPU).
- **V4 against V4.1** (an eight-layer attention-only stack each: compiled memory, CPU time) is
  in [DeepSeek-V4.1](v41.md), made by `python -m benchmarks.v41_stack`.

## Machine

{machine}
"""


def main(out: Path, quick: bool = False) -> int:
    """Run every benchmark and write ``out/benchmarks.md`` and ``out/img/*.png``."""
    sz = QUICK if quick else FULL
    out = Path(out)
    img = out / "img"
    img.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    sections = [
        PREAMBLE.format(
            quick="\n\n**This page was made with `--quick`: tiny sizes, a smoke test, "
            "not a measurement.**"
            if quick
            else "",
            machine=harness.machine_markdown(harness.machine_info()),
        )
    ]

    def add(title: str, command: str, body: str) -> None:
        sections.append(f"## {title}\n\nCommand: `{command}`\n\n{body}\n")
        print(
            f"[bench] {title}: done at {time.perf_counter() - start:.0f} s "
            f"({time.process_time():.0f} s CPU)",
            flush=True,
        )

    add(
        "Layer memory: csa_eqx vs a naive dense-mask layer (compile-time)",
        "python -m benchmarks.layer_memory --variants csa_eqx 'naive dense-mask'",
        layer_memory_section(sz, img),
    )
    speed = layer_speed.measure(sz.speed_seq, sz.speed_reps, quick=quick)
    add(
        "Layer wall time vs naive and HF transformers; indexer FLOP/s (timing)",
        "python -m benchmarks.layer_speed",
        layer_speed.__doc__.split("\n\n")[1].replace("\n", " ")
        + "\n\n"
        + layer_speed.markdown(speed),
    )
    add(
        "Head-chunked indexer memory (compile-time)",
        "python -m benchmarks.indexer_chunk_memory [--kl]",
        "V4-Flash indexer sizes (64 heads x 128, T = S/4, B = 1); fwd+bwd of the scores "
        "(loss: sum of logsumexp over visible scores), and the KL target's gradient "
        "(64 main heads x 512, dense warm-up candidates).\n\n" + chunk_memory_section(sz, img),
    )
    add(
        "Selection memory vs tensor-axis size (compile-time)",
        "python -m benchmarks.selection_memory",
        selection_memory_section(sz, img),
    )
    add(
        "Remat: selection saved vs recomputed (timing)",
        "python -m benchmarks.remat_timing",
        remat_section(sz),
    )
    add(
        "Decode latency (timing) and cache bytes per token (shapes)",
        "python -m benchmarks.decode_latency",
        decode_section(sz, img),
    )
    sections.append(
        f"Total run time: {time.perf_counter() - start:.0f} s; load average at the end: "
        f"{os.getloadavg()[0]:.1f}.\n"
    )
    (out / "benchmarks.md").write_text("\n".join(sections))
    print(f"wrote {out / 'benchmarks.md'} and {img}/", flush=True)
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    raise SystemExit(main(args.out, quick=args.quick))
