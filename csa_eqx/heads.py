"""Head parallelism: a layer's attention heads split over a mesh axis (docs/scaling.md, "Head
parallelism").

``HeadParallel`` runs a layer's forward inside ``jax.shard_map`` over the tensor axis (and over
the data axis when the mesh has one that divides the batch; the other mesh axes stay with the
compiler). Each device holds the weights of ``num_heads / T`` query heads (V4: its rows of the
query projection, its sinks, its groups of the grouped output projection and the matching
input columns of the last output projection; V3.2: its rows of the query and key/value
up-projections and its input columns of the output projection), so its output is a partial
sum of the layer's; the partial outputs are summed over the axis (an all-reduce). Everything
the heads share (the query latent, V4's shared key/value or V3.2's MLA latent, the compressed
entries, the indexer and its top-k) is computed on every device from replicated weights, so
the selection is the single-device one bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from .loss import AttentionTarget
from .sharding import MeshLike, _place, mesh_with_axis

__all__ = ["HeadParallel", "HeadSplit", "all_heads", "split_specs", "sum_partials"]


class HeadParallel(eqx.Module):
    """Run a layer's forward with its attention heads split over the mesh axis ``axis``.

    Arguments:
        axis: the mesh axis the heads are split over; the mesh must have it and its size must
            divide the layer's head counts (``num_heads``; V4: ``o_groups`` too).
        data_axis: the mesh axis the batch is split over, when the mesh has it and its size
            divides the batch (otherwise the batch is replicated over it).
        mesh: the mesh (``None``: the one set with ``jax.set_mesh``).
    """

    axis: str = "tensor"
    data_axis: str = "data"
    mesh: MeshLike | None = None

    def __check_init__(self):
        for name, value in (("tensor_axis", self.axis), ("data_axis", self.data_axis)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty mesh axis name (got {value!r})")
        if self.axis == self.data_axis:
            raise ValueError(f"tensor_axis and data_axis must differ (both are {self.axis!r})")

    def check(self, mesh: MeshLike, heads: dict[str, int]) -> None:
        """``ValueError`` unless the axis' size divides every head count of ``heads`` (by
        config field name)."""
        devices = mesh.shape[self.axis]
        for name, count in heads.items():
            if count % devices:
                raise ValueError(
                    f"head_parallel: mesh axis {self.axis!r} has {devices} devices, which does "
                    f"not divide {name}={count}"
                )

    def apply(
        self,
        body: Callable,
        params,
        specs,
        heads: dict[str, int],
        x: Float[Array, "batch seq hidden"],
        ints: tuple[Int[Array, "batch seq"], ...],
        *,
        selects: bool,
        sums: int = 0,
    ) -> tuple[Float[Array, "batch seq hidden"], Int[Array, "batch seq k"] | None, tuple]:
        """``body(params, x, *ints)`` (a forward over this device's heads, returning ``(y
        partial sum, selection or None, sums)`` with ``sums`` a tuple of per-device float32
        scalars) run head-parallel.

        Arguments:
            body: the layer's forward over the heads its ``params`` hold.
            params: the layer's arrays.
            specs: a ``PartitionSpec`` per array of ``params`` (``self.axis`` on the head
                dimension of the per-head weights, ``P()`` for the shared ones).
            heads: the head counts the axis size must divide, by config field name.
            x, ints: the layer's inputs ``[B, S, ...]`` (hidden states; integer rows).
            selects: whether ``body`` returns a selection.
            sums: how many scalars ``body`` returns to be summed over the devices.

        Returns:
            ``(y, selection, sums)`` as the single-device forward returns them, with the
            ``sums`` summed over the devices.
        """
        mesh = mesh_with_axis(self.axis, "head_parallel", self.mesh)
        self.check(mesh, heads)
        axis, data = self.axis, self.data_axis
        b = x.shape[0]
        dp = data if data in mesh.axis_names and b % mesh.shape[data] == 0 else None
        rows = P(dp)
        in_specs = (specs, rows, (rows,) * len(ints))
        args = jax.tree.map(lambda a, s: _place(a, mesh, s), (params, x, ints), in_specs)

        def local(params, x, ints):
            y, selection, shard_sums = body(params, x, *ints)
            out = (y[None],) + ((selection,) if selects else ())
            return out + tuple(jnp.reshape(a, (1,)) for a in shard_sums)

        # check_vma=False: the selection's loops start their carries from constants, which the
        # varying-manual-axes check rejects. The partial outputs leave mapped over the axis and
        # are summed outside, so the transpose hands each device the output's cotangent once
        # and sums the replicated weights' cotangents (each device's share of the heads).
        out_specs = (P(axis, dp),) + ((rows,) if selects else ())
        out_specs += (P((axis, dp) if dp else axis),) * sums
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=frozenset({axis, dp} - {None}),
            check_vma=False,
        )(*args)
        y = sum_partials(out[0], x.dtype)
        selection = out[1] if selects else None
        return y, selection, tuple(jnp.sum(a) for a in out[len(out) - sums :])


class HeadSplit(NamedTuple):
    """Head parallelism inside another strategy's ``shard_map`` (context parallelism): the
    mesh ``axis`` and a ``PartitionSpec`` per array of the layer's ``params``."""

    axis: str
    specs: object


def sum_partials(partials: Float[Array, "devices batch *rest"], dtype) -> Array:
    """The devices' partial outputs (stacked on axis 0) summed in float32, in ``dtype``."""
    return jnp.sum(partials, axis=0, dtype=jnp.float32).astype(dtype)


def all_heads(target: AttentionTarget, axis: str) -> AttentionTarget:
    """Inside the ``shard_map``: the indexer loss' attention target over every head (the
    devices' query heads and log normalisers all-gathered over ``axis``; no gradient flows
    through a target)."""
    gather = partial(jax.lax.all_gather, axis_name=axis, axis=2, tiled=True)
    return target._replace(q=gather(target.q), log_normalizer=gather(target.log_normalizer))


def split_specs(split: dict[str, P]) -> Callable:
    """Arguments: the per-head weights, by attribute name, with their ``PartitionSpec``.

    Returns: a function from a layer's arrays (``eqx.partition(layer, eqx.is_array)[0]``) to a
    ``PartitionSpec`` per array: ``split``'s for those weights, ``P()`` (replicated) for the
    rest.
    """

    def specs(params):
        whole = jax.tree.map(lambda _: P(), params)
        return eqx.tree_at(
            lambda p: [getattr(p, name) for name in split], whole, list(split.values())
        )

    return specs
