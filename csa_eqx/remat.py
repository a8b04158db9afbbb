"""Checkpoint names and remat-policy composition for the saved indexer selection (SPEC §5)."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["SELECTION_NAME", "tag_selection", "compose_selection_policy"]

SELECTION_NAME = "indexer_selection"


def tag_selection(selection: jax.Array, enabled: bool) -> jax.Array:
    """Name the final selection for remat policies when ``enabled`` (a no-op otherwise)."""
    return checkpoint_name(selection, SELECTION_NAME) if enabled else selection


def compose_selection_policy(policy: Callable | None = None) -> Callable:
    """A remat policy that saves the indexer selection and otherwise defers to ``policy``.

    ``policy=None`` means full rematerialisation (nothing else saved). Offload decisions of the
    wrapped policy (``save_and_offload_only_these_names``) are returned unchanged.
    """
    save_selection = jax.checkpoint_policies.save_only_these_names(SELECTION_NAME)

    def composed(prim, *args, **params):
        if save_selection(prim, *args, **params):
            return True
        return False if policy is None else policy(prim, *args, **params)

    return composed
