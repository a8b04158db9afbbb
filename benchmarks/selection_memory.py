"""Per-device compiled memory of the indexer's selection stage vs the tensor-axis size.

V4-Flash indexer sizes (64 heads x 128, k = 512, m = 4) at S = 16384, so 4096 compressed
entries; query rows sharded over the tensor axis with ``csa_eqx.ShardedSelection``
on simulated CPU devices. Compile only (nothing runs): ``memory_analysis()`` of the
partitioned program is per device. Inputs arrive in the shard_map's layout (query rows already
split over the tensor axis, keys replicated), so the numbers are the stage's own temporaries.

Columns: the dense path (``[B, S, H, T]`` scores, or ``[B, S, T]`` plus one head chunk with
``head_chunk=8``; streaming switched off for the measurement) and the default path, which
streams key blocks at this size.

    python -m benchmarks.selection_memory
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import csa_eqx as ce  # noqa: E402
from csa_eqx import (
    EntryLayout,
    presets,  # noqa: E402
)

from . import harness  # noqa: E402

_FLASH = presets.v4_flash("csa")
H, D, K, M = _FLASH.index_n_heads, _FLASH.index_head_dim, _FLASH.index_topk, _FLASH.compress_rate
B, S = 1, 16384
COLUMNS = [("dense", 0), ("dense", 8), ("default", 0)]


def shapes(seq: int, mesh=None):
    """Abstract inputs at ``seq`` queries (``seq / m`` entries); with ``mesh``: query rows
    split over ``tensor``, the rest replicated."""

    def sds(shape, dtype, spec=None):
        sharding = None if mesh is None else NamedSharding(mesh, spec or P())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    f32, i32 = jnp.float32, jnp.int32
    rows, S, T = P(None, "tensor"), seq, seq // M
    layout = EntryLayout(sds((B, T), i32), sds((B, T), i32), sds((B, T), jnp.bool_))
    return (
        sds((B, S, H, D), f32, rows),
        sds((B, S, H), f32, rows),
        sds((B, T, D), f32),
        sds((B, S), i32, rows),
        sds((B, S), i32, rows),
        layout,
    )


def strategy(path: str, sharded: bool) -> ce.AbstractSelection:
    """``"dense"``: the materialised scores forced (``DenseSelection``); ``"default"``: the
    automatic choice; ``sharded``: either one per shard of query rows over ``"tensor"``."""
    inner = ce.DenseSelection() if path == "dense" else ce.AutoSelection()
    return ce.ShardedSelection(inner) if sharded else inner


def temp_gib(sharded: bool, args, path: str, head_chunk: int) -> float:
    """Per-device temp GiB of the selection strategy ``path`` (sharded or not) on ``args``."""
    select = strategy(path, sharded)

    def run(q, w, keys, query_index, segment, layout):
        visibility = ce.Visibility(query_index, segment, layout)
        problem = ce.SelectionProblem.from_queries(q, w, keys, visibility, head_chunk)
        return select.select(problem, K)

    return harness.temp_bytes(run, *args) / harness.GIB


def rows(seq: int, tensor_axes) -> dict[str | int, list[float]]:
    """Per-device temp GiB of each column at ``seq`` queries: ``"unsharded"``, then one row
    per tensor-axis size."""
    out: dict[str | int, list[float]] = {
        "unsharded": [temp_gib(False, shapes(seq), p, c) for p, c in COLUMNS]
    }
    for tp in tensor_axes:
        mesh = jax.make_mesh((tp,), ("tensor",), devices=jax.devices()[:tp])
        with jax.set_mesh(mesh):
            args = shapes(seq, mesh)
            out[tp] = [temp_gib(True, args, p, c) for p, c in COLUMNS]
    return out


def markdown(gib: dict[str | int, list[float]]) -> str:
    """``rows(...)`` as a markdown table."""
    header = ["tensor axis"] + [f"{p} head_chunk={c}" for p, c in COLUMNS]
    return harness.table(header, [[a] + [f"{v:.3f}" for v in row] for a, row in gib.items()])


def main() -> None:
    print(f"B={B} S={S} heads={H} dim={D} k={K} m={M} entries={S // M}; per-device temp GiB")
    print(markdown(rows(S, (1, 2, 4, 8))))


if __name__ == "__main__":
    main()
