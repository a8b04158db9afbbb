"""Checkpoint names and remat-policy composition for the saved indexer selection
(docs/memory.md, "Saving the selection for the backward pass")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive

__all__ = ["SELECTION_NAME", "tag_selection", "compose_selection_policy"]

SELECTION_NAME = "indexer_selection"


def tag_selection(selection: jax.Array, enabled: bool) -> jax.Array:
    """Name the final selection for remat policies when ``enabled`` (a no-op otherwise)."""
    return checkpoint_name(selection, SELECTION_NAME) if enabled else selection


@dataclasses.dataclass(frozen=True)
class _SaveSelection:
    """Save ``SELECTION_NAME`` (or offload it, if ``policy`` says so); defer otherwise.

    A frozen dataclass rather than a closure so that equal compositions compare equal (remat
    caches key on the policy).
    """

    policy: Callable | None

    def __call__(self, prim: Primitive, *args, **params):
        decision = False if self.policy is None else self.policy(prim, *args, **params)
        if prim.name == "name" and params.get("name") == SELECTION_NAME:
            offloaded = isinstance(decision, jax.ad_checkpoint.Offloadable)
            return decision if offloaded else True
        return decision


def compose_selection_policy(policy: Callable | None = None) -> Callable:
    """A remat policy that saves the indexer selection and otherwise defers to ``policy``.

    ``policy=None`` means full rematerialisation (nothing else saved). Every decision of the
    wrapped policy (save, recompute, ``Offloadable`` from ``save_and_offload_only_these_names``)
    is returned unchanged for other values; the selection itself is saved, or offloaded where
    the wrapped policy offloads that name.

    **Arguments:**

    - ``policy``: a ``jax.checkpoint`` policy, or ``None``.

    **Returns:**

    A policy for ``jax.checkpoint(..., policy=)`` / ``eqx.filter_checkpoint``; equal
    compositions compare equal.
    """
    return _SaveSelection(policy)
