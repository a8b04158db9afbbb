"""One of two processes (4 CPU devices each) running on a global 8-device mesh.

Run by tests/test_sharding.py as ``python tests/multiprocess_worker.py PROCESS_ID PORT OUT``.
Each process writes ``OUT.<PROCESS_ID>.npz``:

- ``sel_<mesh>``: the sharded selection stage on an ``(8,)`` and a ``(2, 4)`` mesh (gathered,
  replicated, so each process holds all of it);
- the full CSA layer (row-sharded top-k) on the ``(2, 4)`` ``("data", "tensor")`` mesh, with
  batch-sharded inputs and replicated global weights: its output, selection and the
  gradients of ``sum(y · cotangent)`` with respect to ``x`` and two weight matrices. Each
  array holds only what this process's devices hold (``<name>_known`` marks it): the test
  checks that the two processes together cover everything and agree with one process;
- the same layer context-parallel on an ``(8,)`` ``("context",)`` mesh whose sequence spans
  both processes (``x`` sharded along the sequence: each process holds half of every row),
  as ``context_<name>``.
"""

import sys

import numpy as np

K = 5
MESHES = {"tensor8": ((8,), ("tensor",)), "data2_tensor4": ((2, 4), ("data", "tensor"))}
LAYER_OUTPUTS = ("y", "selection", "grad_x", "grad_q_a_proj", "grad_kv_proj")


def make_inputs():
    """Deterministic packed inputs (numpy), with many exact score ties."""
    import jax.numpy as jnp

    from csa_eqx import entry_layout

    r = np.random.default_rng(7)
    b, s, h, d = 2, 40, 4, 8
    seg = packed_segments(b, s)
    layout = [np.asarray(a) for a in entry_layout(jnp.asarray(seg), 4)]
    t = layout[0].shape[1]
    q = r.integers(-1, 2, (b, s, h, d)).astype(np.float32)
    w = r.normal(size=(b, s, h)).astype(np.float32)
    keys = r.integers(-1, 2, (b, t, d)).astype(np.float32)
    qi = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
    return q, w, keys, qi, seg, layout


def packed_segments(b: int, s: int) -> np.ndarray:
    seg = np.zeros((b, s), np.int32)
    seg[0, 17:] = 1
    seg[1, 9:] = 1
    seg[1, 30:] = 2
    return seg


def make_layer(sharded: bool, context: bool = False):
    """A tiny CSA layer (same weights whatever the options); ``sharded`` turns on the
    row-sharded top-k, ``context`` context parallelism. (``shard_indexer_acts`` fails with
    weights placed on an Explicit mesh, as multi-process runs need: see
    ``test_shard_indexer_acts_with_mesh_placed_weights``.)"""
    import jax

    from csa_eqx import Execution, V4Attention
    from csa_eqx.presets import tiny_v4

    config = tiny_v4("csa", sliding_window=8, index_topk=K)
    execution = Execution.from_options(indexer_sharded_topk=sharded, context_parallel=context)
    return V4Attention(config, key=jax.random.key(0), execution=execution)


def layer_inputs():
    """``x`` [2, 40, 64], packed segment ids and a cotangent for the gradient (numpy)."""
    r = np.random.default_rng(8)
    x = r.normal(size=(2, 40, 64)).astype(np.float32)
    cotangent = r.normal(size=x.shape).astype(np.float32)
    return x, packed_segments(2, 40), cotangent


def layer_results(layer, x, seg, cotangent) -> dict:
    """Output, selection and gradients of ``sum(y · cotangent)`` (jitted)."""
    import equinox as eqx
    import jax.numpy as jnp

    @eqx.filter_jit
    def run(layer, x, seg, cotangent):
        def objective(args):
            y, aux = args[0](args[1], segment_ids=seg, return_aux=True)
            return jnp.sum(y * cotangent), (y, aux["selection"])

        (_, (y, sel)), (g_layer, g_x) = eqx.filter_value_and_grad(objective, has_aux=True)(
            (layer, x)
        )
        return dict(
            y=y,
            selection=sel,
            grad_x=g_x,
            grad_q_a_proj=g_layer.block.q_a_proj,
            grad_kv_proj=g_layer.block.kv_proj,
        )

    return run(layer, x, seg, cotangent)


def local_part(a) -> tuple[np.ndarray, np.ndarray]:
    """This process's shards of a global array, placed in a global-shaped array, and the
    mask of the elements it holds."""
    out = np.zeros(a.shape, a.dtype)
    known = np.zeros(a.shape, bool)
    for shard in a.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
        known[shard.index] = True
    return out, known


def main(process_id: int, port: int, out: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from selection_helpers import sharded_selected

    from csa_eqx import EntryLayout

    assert jax.process_count() == 2 and jax.device_count() == 8
    results = {}

    def put(a, mesh, spec=None):
        spec = P() if spec is None else spec
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    q, w, keys, qi, seg, layout = make_inputs()
    for name, (shape, axes) in MESHES.items():
        mesh = jax.make_mesh(shape, axes)
        args = [put(a, mesh) for a in (q, w, keys, qi, seg)]
        args.append(EntryLayout(*(put(a, mesh) for a in layout)))
        with jax.set_mesh(mesh):
            sel = jax.jit(lambda *a: sharded_selected(*a, k=K))(*args)
        results[f"sel_{name}"] = np.asarray(sel.addressable_data(0))

    runs = [  # (prefix, mesh, input spec, layer options)
        ("", ((2, 4), ("data", "tensor")), P("data"), dict(sharded=True)),
        ("context_", ((8,), ("context",)), P(None, "context"), dict(sharded=False, context=True)),
    ]
    for prefix, mesh_shape, spec, options in runs:
        mesh = jax.make_mesh(*mesh_shape)
        x, seg, cotangent = (put(a, mesh, spec) for a in layer_inputs())
        assert not x.is_fully_addressable  # each process holds its own rows or tokens
        layer = jax.tree.map(
            lambda a, mesh=mesh: put(np.asarray(a), mesh) if isinstance(a, jax.Array) else a,
            make_layer(**options),
        )
        with jax.set_mesh(mesh):
            got = layer_results(layer, x, seg, cotangent)
        for name in LAYER_OUTPUTS:
            results[prefix + name], results[f"{prefix}{name}_known"] = local_part(got[name])
    np.savez(f"{out}.{process_id}.npz", **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
