"""Per-device compiled memory of the indexer's selection stage vs the tensor-axis size.

V4-Flash indexer sizes (64 heads x 128, k = 512, m = 4) at S = 16384, so 4096 compressed
entries; query rows sharded over the tensor axis with ``csa_eqx.sharding.sharded_select_entries``
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

import contextlib  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import csa_eqx.streaming  # noqa: E402
from csa_eqx.compressor import EntryLayout  # noqa: E402
from csa_eqx.selection import select_entries  # noqa: E402
from csa_eqx.sharding import sharded_select_entries  # noqa: E402

B, S, H, D, K, M = 1, 16384, 64, 128, 512, 4
T = S // M
GIB = 2**30
COLUMNS = [("dense", 0), ("dense", 8), ("default", 0)]


def shapes(mesh=None):
    """Abstract inputs; with ``mesh``: rows split over ``tensor``, the rest replicated."""

    def sds(shape, dtype, spec=None):
        sharding = None if mesh is None else NamedSharding(mesh, spec or P())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    f32, i32 = jnp.float32, jnp.int32
    rows = P(None, "tensor")
    layout = EntryLayout(sds((B, T), i32), sds((B, T), i32), sds((B, T), jnp.bool_))
    return (
        sds((B, S, H, D), f32, rows),
        sds((B, S, H), f32, rows),
        sds((B, T, D), f32),
        sds((B, S), i32, rows),
        sds((B, S), i32, rows),
        layout,
    )


def temp_gib(select, args, path: str, head_chunk: int) -> float:
    fn = jax.jit(lambda *a: select(*a, K, head_chunk=head_chunk))
    dense = mock.patch.object(csa_eqx.streaming, "prefers_streaming", lambda *_: False)
    with dense if path == "dense" else contextlib.nullcontext():
        compiled = fn.lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / GIB


def main() -> None:
    print(f"B={B} S={S} heads={H} dim={D} k={K} m={M} entries={T}; per-device temp GiB")
    print("| tensor axis | " + " | ".join(f"{p} head_chunk={c}" for p, c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    row = [temp_gib(select_entries, shapes(), p, c) for p, c in COLUMNS]
    print("| unsharded | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    for tp in (1, 2, 4, 8):
        mesh = jax.make_mesh((tp,), ("tensor",), devices=jax.devices()[:tp])
        with jax.set_mesh(mesh):
            row = [temp_gib(sharded_select_entries, shapes(mesh), p, c) for p, c in COLUMNS]
        print(f"| {tp} | " + " | ".join(f"{v:.3f}" for v in row) + " |")


if __name__ == "__main__":
    main()
