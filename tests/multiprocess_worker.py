"""One of two processes (4 CPU devices each) running the sharded selection on a global mesh.

Run by tests/test_sharding.py as ``python tests/multiprocess_worker.py PROCESS_ID PORT OUT``;
process 0 writes the gathered selections to ``OUT`` (an .npz file).
"""

import sys

import numpy as np

K = 5
MESHES = {"tensor8": ((8,), ("tensor",)), "data2_tensor4": ((2, 4), ("data", "tensor"))}


def make_inputs():
    """Deterministic packed inputs (numpy), with many exact score ties."""
    import jax.numpy as jnp

    from csa_eqx.compressor import entry_layout

    r = np.random.default_rng(7)
    b, s, h, d = 2, 40, 4, 8
    seg = np.zeros((b, s), np.int32)
    seg[0, 17:] = 1
    seg[1, 9:] = 1
    seg[1, 30:] = 2
    layout = [np.asarray(a) for a in entry_layout(jnp.asarray(seg), 4)]
    t = layout[0].shape[1]
    q = r.integers(-1, 2, (b, s, h, d)).astype(np.float32)
    w = r.normal(size=(b, s, h)).astype(np.float32)
    keys = r.integers(-1, 2, (b, t, d)).astype(np.float32)
    qi = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
    return q, w, keys, qi, seg, layout


def main(process_id: int, port: int, out: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from selection_helpers import sharded_selected

    from csa_eqx.compressor import EntryLayout

    assert jax.process_count() == 2 and jax.device_count() == 8
    q, w, keys, qi, seg, layout = make_inputs()
    results = {}
    for name, (shape, axes) in MESHES.items():
        mesh = jax.make_mesh(shape, axes)
        rep = NamedSharding(mesh, P())

        def put(a, rep=rep):
            return jax.make_array_from_callback(a.shape, rep, lambda idx, a=a: a[idx])

        args = [put(a) for a in (q, w, keys, qi, seg)] + [EntryLayout(*map(put, layout))]
        with jax.set_mesh(mesh):
            sel = jax.jit(lambda *a: sharded_selected(*a, k=K))(*args)
        results[name] = np.asarray(sel.addressable_data(0))
    if process_id == 0:
        np.savez(out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
