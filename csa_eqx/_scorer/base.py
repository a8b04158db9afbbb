"""The lightning indexer's scores ``I[t, s] = d^-1/2 Σ_h w[t, h] ReLU(q[t, h] · k[s])``
(docs/concepts.md, "The lightning indexer"): the function, the kernel seam and its reference.

Scores are float32. With ``head_chunk > 0`` the heads are processed ``head_chunk`` at a time in
a ``lax.scan`` whose body is rematerialised, so the ``[B, H, S, T]`` per-head tensor never
exists in the forward or the backward pass; only the float32 ``[B, S, T]`` accumulator does.

Every selection strategy and the indexer loss score through the ``SelectionProblem``'s scorer
(``Execution.scorer``, an ``AbstractScorer``), so a new kernel (a Pallas kernel, a quantised
scorer) is one new subclass in its own module (``blocked.py`` is one); ``XlaScorer``,
``indexer_scores`` over all keys at once, is the reference.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._ops import varying_like

__all__ = [
    "indexer_scores",
    "sum_head_chunks",
    "AbstractScorer",
    "XlaScorer",
]


def _rounded(x: Array, dtype) -> Array:
    """``x`` (float32) rounded to ``dtype``'s precision, kept in float32, also under ``jit``: a
    ``reduce_precision``, as ``csa_eqx._ops.round_to`` (a cast and its upcast into a sum is
    what XLA removes; the scorer imports nothing of the package, to stay at its bottom)."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _score_heads(q: Array, w: Array, k: Array, score_dtype=None) -> Array:
    # Both contractions at HIGHEST precision: float32 operands in float32 on a TPU (whose
    # default takes bf16 passes), IEEE float32 on a GPU (not TF32); bf16 operands and the CPU
    # are unchanged (tests/test_top_k_select.py).
    acc, highest = jnp.promote_types(q.dtype, jnp.float32), jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bshd,btd->bsht", q, k, preferred_element_type=acc, precision=highest)
    if score_dtype is None:
        return jnp.einsum("bsht,bsh->bst", jax.nn.relu(logits), w.astype(acc), precision=highest)
    # as a bf16 einsum does: each head's logit and weighted logit rounded, the sum in float32
    rounded = jax.nn.relu(_rounded(logits, score_dtype))
    terms = _rounded(rounded * _rounded(w.astype(acc), score_dtype)[:, :, :, None], score_dtype)
    return jnp.sum(terms, axis=2)


def sum_head_chunks(fn: Callable[..., Array], head_chunk: int, shape, *per_head: Array) -> Array:
    """``Σ_c fn(*chunk_c)`` over chunks of ``head_chunk`` heads (axis 2 of every ``per_head``
    array), float32, in a ``lax.scan`` with a rematerialised body.

    Heads are sliced in place: a head-major copy of the queries can be as large as the score
    tensor itself at V4 sizes, which would defeat the point of chunking.
    """
    heads = per_head[0].shape[2]
    if heads % head_chunk:
        raise ValueError(f"head_chunk={head_chunk} must divide the {heads} heads")

    def body(acc, i):
        chunk = (jax.lax.dynamic_slice_in_dim(a, i * head_chunk, head_chunk, 2) for a in per_head)
        return acc + fn(*chunk).astype(acc.dtype), None  # float32 for float64 inputs too

    init = varying_like(jnp.zeros(shape, jnp.float32), per_head)
    return jax.lax.scan(jax.checkpoint(body), init, jnp.arange(heads // head_chunk))[0]


def indexer_scores(
    q: Float[Array, "batch seq heads dim"],
    weights: Float[Array, "batch seq heads"],
    keys: Float[Array, "batch entries dim"],
    *,
    head_chunk: int = 0,
    score_dtype=None,
) -> Float[Array, "batch seq entries"]:
    """Float32 indexer scores of every query against every key, no masking
    (docs/concepts.md, "The lightning indexer").

    **Arguments:**

    - ``q``: indexer queries ``[B, S, H, d]``.
    - ``weights``: per-head weights ``[B, S, H]`` *including* the ``H^-1/2`` factor; the
        ``d^-1/2`` factor is applied here.
    - ``keys``: ``[B, T, d]``, one per entry (shared by all heads).
    - ``head_chunk``: heads scored at once in a rematerialised scan (0 = all); must divide ``H``.
    - ``score_dtype``: ``None`` (float32 throughout), or a dtype such as ``"bfloat16"``: each
        head's logit, its weight ``w·d^-1/2`` and their product are rounded to it, the head
        sum is taken in float32 and rounded to it (DeepSeek-V4's bf16 scorer).

    **Returns:**

    float32 ``[B, S, T]``: ``d^-1/2 Σ_h w[t,h] ReLU(q[t,h] · k[s])``.
    """
    h, d = q.shape[2], q.shape[3]
    if head_chunk and h % head_chunk:
        raise ValueError(f"head_chunk={head_chunk} must divide the {h} indexer heads")
    w = weights.astype(jnp.float32) * d**-0.5

    def score(q, w):
        return _score_heads(q, w, keys, score_dtype)

    if not head_chunk:
        scores = score(q, w).astype(jnp.float32)  # as documented, for float64 inputs too
    else:
        shape = (q.shape[0], q.shape[1], keys.shape[1])
        scores = sum_head_chunks(score, head_chunk, shape, q, w)
    if score_dtype is None:
        return scores
    return _rounded(scores.astype(jnp.float32), score_dtype)


class AbstractScorer(eqx.Module):
    """How the indexer's scores are computed. Every scorer gives the scores of
    ``csa_eqx.indexer_scores`` (float32, ``head_chunk`` and ``score_dtype`` as there; up to
    float32 rounding of the contraction order), so selections are bitwise equal across
    scorers wherever their scores are (ties to the lower index); it must be differentiable in
    ``q``, ``weights`` and ``keys`` (the indexer loss trains through it).
    """

    @abc.abstractmethod
    def scores(
        self,
        q: Float[Array, "batch seq heads dim"],
        weights: Float[Array, "batch seq heads"],
        keys: Float[Array, "batch entries dim"],
        *,
        head_chunk: int = 0,
        score_dtype: str | None = None,
    ) -> Float[Array, "batch seq entries"]:
        """Scores of every query against every key, no masking.

        **Arguments:**

        - ``q``: indexer queries ``[B, S, H, d]``.
        - ``weights``: head weights ``[B, S, H]`` including ``H^-1/2`` (``d^-1/2`` is applied
            here).
        - ``keys``: ``[B, T, d]``, shared by all heads.
        - ``head_chunk``: heads scored at once (0 = all); must divide ``H``.
        - ``score_dtype``: ``None`` (float32) or the dtype the scores are rounded to, as
            ``csa_eqx.indexer_scores`` rounds them.

        **Returns:**

        float32 ``[B, S, T]``.
        """

    def gathered_scores(
        self,
        q,
        weights,
        keys: Float[Array, "batch seq picks dim"],
        *,
        head_chunk=0,
        score_dtype=None,
    ) -> Float[Array, "batch seq picks"]:
        """Scores of each query against its own keys (the sparse stage of the indexer loss,
        V4.1's selection within candidates; float32). By default ``scores`` mapped over the
        queries; a kernel may override it.

        **Arguments:**

        - ``q``, ``weights``, ``head_chunk``, ``score_dtype``: as for ``scores`` (declared
            there).
        - ``keys``: ``[B, S, k, d]``, each query's gathered keys.

        **Returns:**

        float32 ``[B, S, k]``.
        """

        def one(q, w, k):  # a single query row: [1, 1, H, d], [1, 1, H], [1, k, d]
            kw = dict(head_chunk=head_chunk, score_dtype=score_dtype)
            return self.scores(q[None, None], w[None, None], k[None], **kw)[0, 0]

        return jax.vmap(jax.vmap(one))(q, weights, keys)


class XlaScorer(AbstractScorer):
    """The reference scorer: ``csa_eqx.indexer_scores`` over all keys at once (per-head
    logits ``[B, S, heads at once, T]``, then the weighted head sum).

    **Arguments:** none.
    """

    def scores(self, q, weights, keys, *, head_chunk=0, score_dtype=None):
        return indexer_scores(q, weights, keys, head_chunk=head_chunk, score_dtype=score_dtype)
