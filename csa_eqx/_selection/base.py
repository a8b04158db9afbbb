"""The selection family's base (docs/concepts.md, "The lightning indexer"): ``SelectionProblem``
says what each query may read and how good it is, ``AbstractSelection`` answers "which ``k``
entries does each query read?". The strategies live one per module of this folder
(``dense.py``, ``streaming.py``, ``gathered.py``, ``triton.py``, ``sharded.py``); ``auto.py``
chooses. The indexer loss answers the same problem (``csa_eqx._loss``).
"""

import abc
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
from equinox import AbstractVar
from jaxtyping import Array, Float, Int

from .._layout import Visibility
from .._scorer.base import AbstractScorer, XlaScorer
from .._tiles import _CPU_TILES, TileSizes

__all__ = ["SelectionProblem", "AbstractSelection", "AbstractSplitSelection"]


_REFERENCE = XlaScorer()


class SelectionProblem(NamedTuple):
    """Everything a selection strategy needs: "what may each query read, and how good is it".

    **Arguments:**

    - ``project``: maps per-token ``rows`` to the indexer queries ``[B, S, H, d]`` and head
        weights ``[B, S, H]`` (float32, ``H^-1/2`` included). It must act row by row, so a
        strategy may call it on any block of rows (streaming never forms the whole
        ``[B, S, H, d]`` queries). Must be hashable (a lambda, not a bound Module method).
    - ``rows``: per-token inputs of ``project``, each ``[B, S, ...]``.
    - ``keys``: the entries' indexer keys ``[B, T, d]``.
    - ``visibility``: which entries each query may pick: a ``Visibility`` (query indices /
        segments and the entries' layout) or a ``CandidateVisibility`` (V4.1's pre-filter
        on top of one; docs/v41.md, "Candidates").
    - ``head_chunk``: indexer heads scored at once (0 = all; must divide ``H``).
    - ``score_dtype``: the dtype scores are rounded to (``None``: float32; see
        ``csa_eqx.indexer_scores``), as the layer's numerics say.
    - ``scorer``: the scoring kernel (``AbstractScorer``; default ``XlaScorer()``, the
        reference), as ``Execution.scorer`` says.
    - ``tiles``: the backend's tile sizes (``TileSizes``; default the CPU sizes), as
        ``Execution.tiles`` resolves them.
    """

    project: Callable[..., tuple[Array, Array]]
    rows: tuple[Array, ...]
    keys: Float[Array, "batch entries dim"]
    visibility: Visibility  # or a csa_eqx.CandidateVisibility
    head_chunk: int = 0
    score_dtype: str | None = None
    scorer: AbstractScorer = _REFERENCE
    tiles: TileSizes = _CPU_TILES

    @classmethod
    def from_queries(
        cls,
        q: Float[Array, "batch seq heads dim"],
        weights: Float[Array, "batch seq heads"],
        keys,
        visibility,
        head_chunk=0,
        score_dtype=None,
        scorer=_REFERENCE,
        tiles=_CPU_TILES,
    ) -> "SelectionProblem":
        """A problem whose queries and head weights are already projected.

        **Arguments:**

        - ``q``: float ``[B, S, H, d]`` indexer queries; ``weights``: float ``[B, S, H]``.
        - ``keys``, ``visibility``, ``head_chunk``, ``score_dtype``, ``scorer``, ``tiles``: the
            class's fields (declared there, with these defaults).

        **Returns:** the ``SelectionProblem`` (its ``project`` is the identity).
        """
        return cls(
            _identity, (q, weights), keys, visibility, head_chunk, score_dtype, scorer, tiles
        )

    def with_queries(
        self, q: Float[Array, "batch seq heads dim"], weights: Float[Array, "batch seq heads"]
    ) -> "SelectionProblem":
        """**Arguments:** projected queries ``[B, S, H, d]`` and weights ``[B, S, H]``.

        **Returns:** this problem over them (its ``project`` the identity), all else kept.
        """
        return self._replace(project=_identity, rows=(q, weights))

    def sizes(self) -> tuple[int, int, int, int]:
        """**Returns:** ``(batch, seq, entries, heads scored at once)`` (no computation)."""
        b, s, h, _ = jax.eval_shape(self.project, *self.rows)[0].shape
        return b, s, self.keys.shape[1], self.head_chunk or h

    def queries(self) -> tuple[Array, Array]:
        """**Returns:** the whole float ``[B, S, H, d]`` queries and ``[B, S, H]`` weights."""
        return self.project(*self.rows)

    def scores(
        self,
        q: Float[Array, "batch seq heads dim"],
        weights: Float[Array, "batch seq heads"],
        keys: Float[Array, "batch entries dim"],
    ) -> Float[Array, "batch seq entries"]:
        """**Arguments:** queries ``[B, S, H, d]``, weights ``[B, S, H]`` (any block of the
        problem's rows) and keys ``[B, T', d]`` (any block of its entries).

        **Returns:** their float32 scores ``[B, S, T']`` by the problem's ``scorer``, with its
        ``head_chunk`` and ``score_dtype``.
        """
        return self.scorer.scores(
            q, weights, keys, head_chunk=self.head_chunk, score_dtype=self.score_dtype
        )

    def gathered_scores(
        self,
        q: Float[Array, "batch seq heads dim"],
        weights: Float[Array, "batch seq heads"],
        keys: Float[Array, "batch seq picks dim"],
    ) -> Float[Array, "batch seq picks"]:
        """**Arguments:** queries and weights as for ``scores`` and each query's own keys
        ``[B, S, n, d]``.

        **Returns:** their float32 scores ``[B, S, n]`` (``AbstractScorer.gathered_scores``,
        with the problem's ``head_chunk`` and ``score_dtype``).
        """
        return self.scorer.gathered_scores(
            q, weights, keys, head_chunk=self.head_chunk, score_dtype=self.score_dtype
        )


def _identity(q: Array, w: Array) -> tuple[Array, Array]:
    return q, w


class AbstractSelection(eqx.Module):
    """How the indexer's top-k is computed. Every strategy returns the same selection bitwise:
    the ``k`` best entries per query that ``problem.visibility`` lets it pick (ties to the
    lower index), in increasing index order, ``-1`` past the visible count. A strategy scores
    through ``problem.scores`` (the problem's scorer), sizes its tiles by ``problem.tiles``
    and asks the visibility only through its calls (``mask``, ``rows``, ``tile``, ``slots``,
    ...), so a V4.1 consumer's pre-filter needs no path of its own."""

    @abc.abstractmethod
    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        """**Arguments:** the ``problem`` and ``k > 0`` picks per query.

        **Returns:** int32 ``[B, S, k]`` entry indices, ``-1`` = none.
        """


class AbstractSplitSelection(AbstractSelection):
    """A selection that runs another strategy (``inner``) on parts of the query rows and joins
    their answers (``ShardedSelection``: the rows split over a mesh axis); ``split`` runs any
    per-row computation of the problem that way."""

    inner: AbstractVar[AbstractSelection]

    @abc.abstractmethod
    def split(self, problem: SelectionProblem, run: Callable) -> tuple[Array, ...]:
        """**Arguments:** the ``problem`` and ``run(part) -> tuple of [B, S', n]`` arrays of a
        part of its rows.

        **Returns:** ``run``'s arrays over every row, ``[B, S, n]`` each."""

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        return self.split(problem, lambda part: (self.inner.select(part, k),))[0]
