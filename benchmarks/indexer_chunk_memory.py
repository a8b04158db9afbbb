"""XLA temp memory of head-chunked indexer scoring (and the KL target), compile only.

Compiles fwd+bwd of ``indexer_scores -> scalar`` at V4-Flash indexer sizes (64 heads x 128,
T = S / 4 compressed entries, B = 1) for unchunked and ``head_chunk`` 1 / 4 / 16, reads
``compiled.memory_analysis().temp_size_in_bytes`` and checks that each chunked run saves at least
``(1 - c / H)`` of the float32 ``[B, H, S, T]`` score tensor against the unchunked one. With
``--kl`` it does the same for ``indexer_kl_loss`` (target over the 64 main heads x 512, dense
warm-up candidates). Nothing is executed, so it runs on any host::

    python -m benchmarks.indexer_chunk_memory [--kl] [--seq 2048 4096 8192 16384]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from csa_eqx import indexer_kl_loss, indexer_scores, presets

from . import harness

_FLASH = presets.v4_flash("csa")
HEADS, INDEX_DIM = _FLASH.index_n_heads, _FLASH.index_head_dim
MAIN_DIM, RATE = _FLASH.head_dim, _FLASH.compress_rate
CHUNKS = (0, 1, 4, 16)
GIB = harness.GIB


def visible(s: int, t: int) -> jax.Array:
    return (jnp.arange(t)[None, :] < ((jnp.arange(s) + 1) // RATE)[:, None])[None]


def scoring_step(chunk: int):
    """Gradient of a scalar of the scores w.r.t. queries, weights and keys."""

    def loss(q, w, k):
        scores = indexer_scores(q, w, k, head_chunk=chunk)
        vis = visible(q.shape[1], k.shape[1])
        return jnp.sum(jax.nn.logsumexp(jnp.where(vis, scores, -1e30), axis=-1))

    return jax.grad(loss, argnums=(0, 1, 2))


def scoring_args(s: int):
    f32 = jnp.float32
    return (
        jax.ShapeDtypeStruct((1, s, HEADS, INDEX_DIM), f32),
        jax.ShapeDtypeStruct((1, s, HEADS), f32),
        jax.ShapeDtypeStruct((1, s // RATE, INDEX_DIM), f32),
    )


def kl_step(chunk: int):
    """Gradient of the KL loss w.r.t. the indexer scores (the target is detached)."""

    def loss(scores, q, keys, lse):
        cand = visible(q.shape[1], keys.shape[1])
        return indexer_kl_loss(q, keys, lse, scores, cand, MAIN_DIM**-0.5, head_chunk=chunk)

    return jax.grad(loss)


def kl_args(s: int):
    f32, t = jnp.float32, s // RATE
    return (
        jax.ShapeDtypeStruct((1, s, t), f32),
        jax.ShapeDtypeStruct((1, s, HEADS, MAIN_DIM), f32),
        jax.ShapeDtypeStruct((1, t, MAIN_DIM), f32),
        jax.ShapeDtypeStruct((1, s, HEADS), f32),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--kl", action="store_true", help="measure the KL target instead")
    opts = parser.parse_args()
    step, make_args = (kl_step, kl_args) if opts.kl else (scoring_step, scoring_args)
    what = "indexer_kl_loss (grad wrt scores)" if opts.kl else "indexer_scores fwd+bwd"
    print(f"{what}, B=1, H={HEADS}, T=S/{RATE}; XLA temp GiB on {jax.devices()[0].platform}")
    print("| S | [B,H,S,T] f32 | unchunked | " + " | ".join(f"c={c}" for c in CHUNKS[1:]) + " |")
    print("|---" * (len(CHUNKS) + 2) + "|")
    failures = []
    for s in opts.seq:
        score_tensor = 4 * HEADS * s * (s // RATE)
        temps = {c: harness.temp_bytes(step(c), *make_args(s)) for c in CHUNKS}
        cells = [f"{temps[c] / GIB:.3f}" for c in CHUNKS]
        print(f"| {s} | {score_tensor / GIB:.3f} | " + " | ".join(cells) + " |", flush=True)
        for c in CHUNKS[1:]:
            saved, needed = temps[0] - temps[c], (1 - c / HEADS) * score_tensor
            if saved < needed:
                failures.append(f"S={s} c={c}: saved {saved / GIB:.3f} < {needed / GIB:.3f} GiB")
    if failures:
        raise SystemExit("claim fails:\n" + "\n".join(failures))
    print("claim holds: unchunked - chunked >= (1 - c/H) x [B,H,S,T] f32 at every S and c")


if __name__ == "__main__":
    main()
