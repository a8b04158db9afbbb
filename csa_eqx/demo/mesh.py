"""The demo's ``data × tensor`` device mesh and batch placement (shared by training, evaluation
and plots)."""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["make_mesh", "shard_batch"]


def make_mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
    """A ``data × tensor`` mesh over the local devices (``(0, 0)``: tensor 2 when possible)."""
    n = jax.local_device_count()
    data, tensor = shape
    if (data, tensor) == (0, 0):
        tensor = 2 if n % 2 == 0 else 1
        data = n // tensor
    if data * tensor != n:
        raise ValueError(f"mesh {data}x{tensor} does not use the {n} local devices")
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(auto, auto))


def shard_batch(x: np.ndarray, mesh: jax.sharding.Mesh) -> jax.Array:
    """``x`` on ``mesh`` with its batch split over ``data`` (replicated when it does not
    divide)."""
    spec = jax.sharding.PartitionSpec("data") if x.shape[0] % mesh.shape["data"] == 0 else None
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec or jax.sharding.PartitionSpec()))
