"""V4-Flash CSA's or V3.2 DSA's attention alone on a TPU (issue 54, item 1: "Row copies at the
isolated probe's cost"; item 4: tile skipping; docs/kernels.md, "What a gathered row costs",
"Tile skipping"): designs of ``MosaicAttention`` (``DESIGNS``: ``rows``, rows copied by vector
loads from a VMEM-resident table; ``auto``, the automatic choice; ``tiles``, the masked tiles
pass, skipping the tiles no query of a block picked; ``tiles-all`` and ``auto-all``, the same
without skipping), forward and forward + backward, on synthetic reads at released sizes
(``--layer``): ``v4``, B = 1, 64 heads x 512 (the values the keys' first features), ``k`` =
512 picks per query among the ``S / 4`` compressed entries it sees (an entry is seen once its
4 tokens are), a 128-token band, sinks; ``v32``, 128 heads (``--heads``: fewer, e.g. 32, one
of the layer's four head groups at 32k, whose 128 heads' arrays do not fit the chip's HBM),
576-wide latent keys whose first 512 features are the values, ``k`` = 2048 picks among the
tokens it sees, no band, no sinks; bfloat16. Two patterns of picks: ``uniform`` (uniform
among the visible entries, with repeats) and ``local`` (the most recent visible entries, 256
for V4 and 1024 for V3.2, and four heavy regions sharing the rest, the first at entry 0, as
trained indexers pick; what a query does not see yet is ``-1``).

Each program (design x pass; the patterns share them) is compiled first, with its compiled
memory and kernel calls recorded, then run once per pattern (a checksum of its outputs: sum
and sum of magnitudes of the output, or of each gradient, so that the designs can be compared),
then ``--rounds`` interleaved rounds of ``--calls`` calls each; median and min per result.
``--budget`` seconds: a program whose compile would not fit (the last one's time as the
estimate) and rounds past it are skipped, so ``timeout`` is rarely needed. Writes
``OUT/attention_rows.json`` after every step; one line per result. ``--quick``: tiny sizes in
Pallas' interpreter (a CPU smoke run; the numbers mean nothing).

    python -m benchmarks.attention_rows --out DIR [--layer v4] [--heads H] [--seqs 32768]
        [--patterns uniform local] [--designs rows auto] [--passes fwd fwdbwd] [--rounds 3]
        [--calls 2] [--budget 220] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

import csa_eqx as ce
from csa_eqx._attention import mosaic_plan

from .accelerator_table import Program, called_once, describe_error, jax_free_bytes, needed_bytes

DESIGNS = {  # in the order they compile, each pass's (forward first)
    "rows": ce.MosaicAttention(gather="rows", resident=True),
    "auto": ce.MosaicAttention(),
    "tiles": ce.MosaicAttention(gather="tiles"),
    "tiles-all": ce.MosaicAttention(gather="tiles", skip_tiles=False),  # every tile visited
    "auto-all": ce.MosaicAttention(skip_tiles=False),
}
PATTERNS = ("uniform", "local")
PASSES = ("fwd", "fwdbwd")
ARRAYS = ("q", "kv", "entries", "sinks", "weights")  # the programs' arguments, then the picks
GIB = 2**30


class Size(NamedTuple):
    heads: int
    width: int  # of the queries and keys
    picks: int
    window: int  # the band's (0: none, and no sinks)
    recent: int  # the local pattern's most recent entries; the rest: 4 heavy regions
    compress: int = 4  # tokens per entry (V4-Flash CSA: 4; V3.2: 1, its tokens)
    values: int = 0  # the values' width: the keys' first features (0: all of them)


LAYERS = {
    "v4": (Size(64, 512, 512, 128, 256), Size(16, 128, 16, 8, 8)),  # full, --quick
    "v32": (Size(128, 576, 2048, 0, 1024, 1, 512), Size(16, 144, 16, 0, 8, 1, 128)),
}


def picks_of(pattern: str, seq: int, size: Size, key) -> jax.Array:
    """int32 ``[1, S, k]``: each query's picks among the entries it sees (``-1``: none)."""
    entries, k = seq // size.compress, size.picks
    visible = ((jnp.arange(seq, dtype=jnp.int32) + 1) // size.compress)[:, None]
    col = jnp.arange(k, dtype=jnp.int32)[None, :]
    if pattern == "uniform":
        picks = jnp.floor(jax.random.uniform(key, (seq, k)) * visible).astype(jnp.int32)
    else:
        span = (k - size.recent) // 4
        starts = jax.random.randint(key, (4,), 0, max(entries - span, 1), jnp.int32)
        starts = starts.at[0].set(0)
        heavy = col - size.recent
        region = starts[jnp.clip(heavy // span, 0, 3)] + heavy % span
        picks = jnp.where(col < size.recent, visible - 1 - col, region)
    return jnp.where((picks >= 0) & (picks < visible), picks, -1)[None]


def inputs(seq: int, size: Size) -> dict:
    """bfloat16 queries ``[1, S, heads, width]``, band token rows ``[1, S, width]`` (V3.2: a
    row, unread), entries ``[1, S / compress, width]``; float32 sinks and the loss's weights
    ``[heads, value width]``."""
    keys = jax.random.split(jax.random.key(0), 5)
    normal = lambda k, *shape: jax.random.normal(k, shape, jnp.bfloat16)  # noqa: E731
    h, d = size.heads, size.width
    return dict(
        q=normal(keys[0], 1, seq, h, d),
        kv=normal(keys[1], 1, seq if size.window else 1, d),
        entries=normal(keys[2], 1, seq // size.compress, d),
        sinks=jax.random.normal(keys[3], (h,), jnp.float32),
        weights=jax.random.normal(keys[4], (h, size.values or d), jnp.float32),
    )


def reads_of(size: Size, q, kv, entries, picks) -> ce.Reads:
    """The picks among the entries (V3.2: their first ``values`` features the values) and V4's
    band."""
    gathered = (ce.GatheredRows(entries, picks, value_width=size.values or None),)
    if not size.window:
        return ce.Reads(gathered)
    segment = jnp.zeros(q.shape[:2], jnp.int32)
    return ce.Reads(gathered, band=ce.BandRows(kv, segment, size.window))


def attend(kernel, size: Size, q, kv, entries, sinks, picks):
    sinks = sinks if size.window else None
    reads = reads_of(size, q, kv, entries, picks)
    return kernel.attend(q, reads, sinks, size.width**-0.5, query_block=16)


def programs(kernel, size: Size) -> dict:
    """The forward (its output) and the forward + backward (the gradients of a weighted sum
    of the output with respect to the queries, the band rows and the entries)."""

    def fwd(q, kv, entries, sinks, weights, picks):
        del weights
        return attend(kernel, size, q, kv, entries, sinks, picks)

    def loss(q, kv, entries, sinks, weights, picks):
        out = attend(kernel, size, q, kv, entries, sinks, picks)
        return jnp.sum(out.astype(jnp.float32) * weights)

    return {"fwd": fwd, "fwdbwd": jax.grad(loss, argnums=(0, 1, 2))}


@jax.jit
def checksum(tree) -> list:
    """``[sum, sum of magnitudes]`` (float32) of each array of ``tree``."""
    return [
        jnp.stack([jnp.sum(a.astype(jnp.float32)), jnp.sum(jnp.abs(a.astype(jnp.float32)))])
        for a in jax.tree.leaves(tree)
    ]


def configuration(kernel, size: Size, args: tuple) -> str:
    """What the kernel chose: each read set's kind, its table's home, the chunk and tile."""

    def plan(q, kv, entries, sinks, weights, picks):
        del weights
        reads = reads_of(size, q, kv, entries, picks)
        static = mosaic_plan.plan(kernel, q, reads, bool(size.window), 1.0).static
        seen.extend([static.config, static.backward])
        return 0

    def kinds(c) -> str:
        return " + ".join(
            f"{type(r).__name__}({'resident' if c.tables[r.table].resident else 'hbm'}"
            f"{', skip' if getattr(r, 'skip', False) else ''})"
            for r in c.sources
        )

    seen: list = []
    jax.eval_shape(plan, *args)
    c, back = seen
    return (f"{kinds(c)} (backward: {kinds(back)}); {c.query_block} x {c.head_block}; "
            f"chunk {c.chunk}, tile {c.tile}")  # fmt: skip


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).parent)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


class Bench:
    def __init__(self, args, res: dict):
        self.args, self.res, self.start = args, res, time.perf_counter()
        self.path = args.out / "attention_rows.json"

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.start)

    def save(self) -> None:
        self.path.write_text(json.dumps(self.res, indent=1, default=str))

    def compile(self, seq: int, size: Size, args: tuple) -> dict:
        """Each design x pass compiled (while the budget allows); ``{(design, pass): Program}``;
        their records under ``res[seq]["programs"]``."""
        recs = self.res["seqs"][str(seq)]["programs"]
        out, seen = {}, {}  # pass -> its last compile's seconds
        for kind in self.args.passes:
            for name in self.args.designs:
                rec = recs[f"{name} {kind}"] = {}
                estimate = seen.get(kind, max(seen.values(), default=0.0))
                if self.left() < 1.2 * estimate:
                    rec["skipped"] = f"budget ({self.left():.0f} s left)"
                    continue
                t0 = time.perf_counter()
                try:
                    program = Program(programs(DESIGNS[name], size)[kind], args).compile()
                except Exception as err:  # noqa: BLE001 - recorded, the others go on
                    rec["error"] = describe_error(err)
                    continue
                finally:
                    seen[kind] = rec["compile_s"] = time.perf_counter() - t0
                    self.save()
                rec.update(memory=program.memory, kernel_calls=program.kernel_calls)
                rec["config"] = configuration(DESIGNS[name], size, args)
                need, free = needed_bytes(program.memory, resident=True), jax_free_bytes()
                if need > free:
                    rec["skipped"] = f"memory ({need / GIB:.2f} GiB > {free / GIB:.2f} free)"
                    continue
                out[name, kind] = program
                temp, took = program.memory["temp"] / GIB, seen[kind]
                print(f"S {seq} {name:9} {kind:6} compiled in {took:.1f} s, temp {temp:.3f} GiB: "
                      f"{rec['config']}", flush=True)  # fmt: skip
        return out

    def first_calls(self, seq: int, compiled: dict, arrays: dict, picks: dict) -> dict:
        """One call of each program on each pattern: its time and checksum; the runs."""
        results, runs = self.res["seqs"][str(seq)]["results"], {}
        for (name, kind), program in compiled.items():
            for pattern, idx in picks.items():
                rec = results[f"{pattern} {name} {kind}"] = {}
                args = (*(arrays[k] for k in ARRAYS), idx)
                run = program.caller(args)
                out = called_once(run, rec)
                if out is None:
                    continue
                rec["checksum"] = [[float(v) for v in s] for s in checksum(out)]
                del out
                runs[pattern, name, kind] = run
                self.save()
        return runs

    def rounds(self, seq: int, runs: dict) -> None:
        results = self.res["seqs"][str(seq)]["results"]
        per_round = sum(results[" ".join(k)]["first_s"] for k in runs) * self.args.calls
        for _ in range(self.args.rounds):
            if self.left() < per_round:
                self.res["seqs"][str(seq)]["rounds_skipped"] = f"budget ({self.left():.0f} s)"
                break
            for key, run in runs.items():
                for _ in range(self.args.calls):
                    t0 = time.perf_counter()
                    run()
                    results[" ".join(key)]["times_s"].append(time.perf_counter() - t0)
            self.save()
        for key in runs:
            rec = results[" ".join(key)]
            times = rec["times_s"] or [rec["first_s"]]
            rec["median_ms"], rec["min_ms"] = 1e3 * statistics.median(times), 1e3 * min(times)
            pattern, name, kind = key
            temp = self.res["seqs"][str(seq)]["programs"][f"{name} {kind}"]["memory"]["temp"]
            print(f"S {seq} {pattern:7} {name:9} {kind:6} median {rec['median_ms']:9.2f} ms "
                  f"min {rec['min_ms']:9.2f} ms  temp {temp / GIB:.3f} GiB  "
                  f"checksum {rec['checksum'][0][0]:.6g}", flush=True)  # fmt: skip
        self.save()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layer", choices=list(LAYERS), default="v4")
    p.add_argument("--heads", type=int, help="fewer heads than the layer's (V3.2 at 32k: 32)")
    p.add_argument("--seqs", type=int, nargs="+", default=[32768])
    p.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    p.add_argument("--designs", nargs="+", choices=list(DESIGNS), default=list(DESIGNS))
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--budget", type=float, default=220.0, help="seconds for everything")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    full, quick = LAYERS[args.layer]
    size, seqs = (quick, [64]) if args.quick else (full, args.seqs)
    if args.heads:
        size = size._replace(heads=args.heads)
    res: dict = dict(
        device=str(jax.devices()[0].device_kind), commit=commit(), quick=args.quick,
        layer=args.layer, size=size._asdict(), designs={n: repr(DESIGNS[n]) for n in args.designs},
        seqs={},
    )  # fmt: skip
    bench = Bench(args, res)
    for seq in seqs:
        res["seqs"][str(seq)] = dict(programs={}, results={})
        arrays = inputs(seq, size)
        keys = jax.random.split(jax.random.key(1), len(args.patterns))
        picks = {
            pat: picks_of(pat, seq, size, k) for pat, k in zip(args.patterns, keys, strict=True)
        }
        args_ = (*(arrays[k] for k in ARRAYS), next(iter(picks.values())))
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args_)
        compiled = bench.compile(seq, size, shapes)
        runs = bench.first_calls(seq, compiled, arrays, picks)
        bench.rounds(seq, runs)
        del arrays, picks, compiled, runs
    bench.save()
    print(f"wrote {bench.path} in {time.perf_counter() - bench.start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
