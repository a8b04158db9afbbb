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
the selection is the single-device one bitwise, and so is the state a layer carries to the
next (V4.1's published entries, selections and candidates), which goes in and out replicated
over the axis.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from .._mesh import MeshLike, batch_axis, check_axes, each, mesh_with_axis, run_sharded
from .._numerics.fp8_weight import Fp8Weight
from .._rows import Rows
from .base import AbstractPlacement, Body, Carried, Hidden, untagged

__all__ = ["HeadParallel", "split_specs", "sum_partials"]


class HeadParallel(AbstractPlacement):
    """Run a layer's forward with its attention heads split over the mesh axis ``axis``.

    **Arguments:**

    - ``axis``: the mesh axis the heads are split over; the mesh must have it and its size must
        divide the layer's head counts (``num_heads``; V4: ``o_groups`` too).
    - ``data_axis``: the mesh axis the batch is split over, when the mesh has it, an enclosing
        placement has not split it already and its size divides the batch (otherwise the
        batch is replicated over it).
    - ``mesh``: the mesh (``None``: the one set with ``jax.set_mesh``).
    """

    axis: str = "tensor"
    data_axis: str = "data"
    mesh: MeshLike | None = None

    def __check_init__(self):
        check_axes("HeadParallel.axis", self.axis, self.data_axis)

    def check_composes(self, context: AbstractPlacement | None, indexer_heads_axis) -> None:
        """``ValueError`` unless an execution's ``context`` axis (a ``ContextParallel`` or
        ``None``) and ``indexer_heads_axis`` compose with these heads."""
        if context is not None and context.axis == self.axis:
            raise ValueError(
                "heads needs a HeadParallel.axis other than the ContextParallel.axis "
                f"{self.axis!r} (got {self.axis!r})"
            )
        if indexer_heads_axis is not None:  # the indexer's heads would take the heads' axis
            raise ValueError(
                "heads is not composable with indexer_heads_axis yet: set one of them to None "
                f"(got {indexer_heads_axis!r})"
            )

    def check(self, mesh: MeshLike, heads: dict[str, int]) -> None:
        """``ValueError`` unless the axis' size divides every head count of ``heads`` (by
        config field name)."""
        devices = mesh.shape[self.axis]
        for name, count in heads.items():
            if count % devices:
                raise ValueError(
                    f"Execution.heads: mesh axis {self.axis!r} has {devices} devices, which "
                    f"does not divide {name}={count}"
                )

    def run(self, body: Body, layer: eqx.Module, x: Hidden, rows: Rows, carried: Carried):
        """The body over this device's heads (``layer.head_specs(axis)`` says which arrays
        are split), its ``y`` a partial sum over them, summed over the axis here; per-head
        arrays reach every head through ``rows.all_heads``. The ``carried`` state goes in and
        comes out whole on every device (split over the batch only): the body computes it from
        what the heads share, equal on every device. See ``AbstractPlacement.run``."""
        mesh = mesh_with_axis(self.axis, "Execution.heads", self.mesh)
        axis = self.axis
        dp = batch_axis(mesh, self.data_axis, x.shape[0])
        layer = untagged(layer)  # inside a caller's shard_map: its selection unnamed
        param_specs = self.param_specs(layer, mesh)
        params, static = eqx.partition(layer, eqx.is_array)
        ints, fns = eqx.partition(rows, eqx.is_array)
        batch = P(dp)
        in_specs = (param_specs, batch, each(ints, batch), each(carried, batch))

        def local(params, x, ints, carried):
            rows = eqx.combine(ints, fns)._replace(all_heads=partial(_all_heads, axis_name=axis))
            y, selection, sums, carried = body(eqx.combine(params, static), x, rows, carried)
            return y[None], selection, tuple(jnp.reshape(a, (1,)) for a in sums), carried

        # the partial outputs leave stacked over the axis and are summed outside, so the
        # transpose hands each device the output's cotangent once and sums the replicated
        # weights' cotangents (each device's share of the heads); the carried state leaves
        # unmapped over the axis (equal on every device), so the transpose hands each device
        # 1 / T of its cotangent
        out_specs = (P(axis, dp), batch, P((axis, dp) if dp else axis), batch)
        args = (params, x, ints, carried)
        y, selection, sums, carried = run_sharded(
            local, mesh, in_specs, out_specs, {axis, dp}, *args
        )
        return sum_partials(y, x.dtype), selection, tuple(jnp.sum(a) for a in sums), carried

    def param_specs(self, layer: eqx.Module, mesh: MeshLike):
        """**Returns:** a ``PartitionSpec`` for each array of ``layer``: its heads split over
        ``axis`` (``layer.head_specs``), the rest replicated; a ``ValueError`` where the axis'
        size does not divide the head counts or a split ``Fp8Weight``'s tiles."""
        specs, counts = layer.head_specs(self.axis)
        self.check(mesh, counts)
        params = eqx.partition(layer, eqx.is_array)[0]
        param_specs = specs(params)
        _check_tiles(params, param_specs, mesh.shape[self.axis])
        return param_specs

    def run_split(self, body: Body, layer: eqx.Module, x: Hidden, rows: Rows, carried: Carried):
        """``run`` inside a ``shard_map`` already manual over ``axis`` whose ``layer`` holds
        this device's heads (split by ``param_specs``: ``ContextParallel`` around these heads
        takes the axis into its own ``shard_map``, one over both axes). The partial outputs
        and sums are summed over the axis here (``psum``, in float32 as ``sum_partials``)."""
        axis = self.axis
        rows = rows._replace(all_heads=partial(_all_heads, axis_name=axis))
        y, selection, sums, carried = body(layer, x, rows, carried)
        y = jax.lax.psum(y.astype(jnp.float32), axis).astype(x.dtype)
        return y, selection, tuple(jax.lax.psum(a, axis) for a in sums), carried


def _all_heads(a: Array, axis: int, *, axis_name: str) -> Array:
    """Inside the ``shard_map``: ``a``'s heads (on ``axis``) all-gathered over ``axis_name``."""
    return jax.lax.all_gather(a, axis_name, axis=axis, tiled=True)


def sum_partials(partials: Float[Array, "devices batch *rest"], dtype) -> Array:
    """The devices' partial outputs (stacked on axis 0) summed in float32, in ``dtype``."""
    return jnp.sum(partials, axis=0, dtype=jnp.float32).astype(dtype)


def split_specs(split: dict[str, P]) -> Callable:
    """**Arguments:** the per-head weights, by attribute path (``"block.q_b_proj"``), with their
    ``PartitionSpec``.

    **Returns:** a function from a layer's arrays (``eqx.partition(layer, eqx.is_array)[0]``) to a
    ``PartitionSpec`` per array: ``split``'s for those weights (for an ``Fp8Weight``, its values
    and its tile scales alike), ``P()`` (replicated) for the rest.
    """

    def specs(params):
        whole = each(params, P())
        new = [each(_at(params, path), spec) for path, spec in split.items()]
        return eqx.tree_at(lambda p: [_at(p, path) for path in split], whole, new)

    return specs


def _check_tiles(params, specs, devices: int) -> None:
    """``ValueError`` unless every split ``Fp8Weight`` of ``params`` gives each of ``devices``
    whole tiles of its values and scales along each split axis."""

    def check(path, weight, spec):
        if not isinstance(weight, Fp8Weight):
            return
        for axis, name in enumerate(spec.values):
            size, tile = weight.shape[axis], weight.block[axis]
            if name is not None and size % (devices * tile):
                what = ("rows", "columns")[axis]
                raise ValueError(
                    f"head parallelism splits the {what} of {jax.tree_util.keystr(path)} (an "
                    f"Fp8Weight {weight.shape} in {weight.block[0]}x{weight.block[1]} tiles) over "
                    f"{devices} devices: each needs whole tiles ({size} {what} are not a "
                    f"multiple of {devices} x {tile}); use fewer devices or dequantise it "
                    "(ExactNumerics)"
                )

    jax.tree_util.tree_map_with_path(
        check, params, specs, is_leaf=lambda x: isinstance(x, Fp8Weight)
    )


def _at(tree, path: str):
    for name in path.split("."):
        tree = getattr(tree, name)
    return tree
