"""What differs between the supported JAX versions (``jax >= 0.10, < 0.13``), in one place.

- ``stacked_all_gather``: from JAX 0.11, the transpose of ``lax.all_gather`` (a
  ``psum_scatter``) fails to lower inside a ``shard_map`` whose mesh keeps an ``Explicit`` axis
  ("Length of sharding.spec (5) must be equal to aval's ndim (0)": its reducer's scalar keeps
  the array's sharding). There the gather gets a backward of ``psum`` and a slice instead.
"""

from functools import partial

import jax
from jaxtyping import Array

_PSUM_SCATTER_LOWERS_UNDER_EXPLICIT_AXES = jax.__version_info__ < (0, 11)


def stacked_all_gather(x: Array, axis_name: str) -> Array:
    """``lax.all_gather(x, axis_name)``: ``[N, *x.shape]``, device ``i``'s ``x`` at index ``i``;
    differentiable under a mesh with ``Explicit`` axes on every supported JAX."""
    if _PSUM_SCATTER_LOWERS_UNDER_EXPLICIT_AXES:
        return jax.lax.all_gather(x, axis_name)
    return _gather_with_psum_backward(x, axis_name)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_with_psum_backward(x: Array, axis_name: str) -> Array:
    return jax.lax.all_gather(x, axis_name)


def _gather_forward(x: Array, axis_name: str) -> tuple[Array, None]:
    return jax.lax.all_gather(x, axis_name), None


def _gather_backward(axis_name: str, _, cotangent: Array) -> tuple[Array]:
    """The sum over devices of each one's cotangent of this device's slot."""
    return (jax.lax.psum(cotangent, axis_name)[jax.lax.axis_index(axis_name)],)


_gather_with_psum_backward.defvjp(_gather_forward, _gather_backward)
