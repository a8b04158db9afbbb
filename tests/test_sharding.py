"""Row-sharded top-k (indexer_sharded_topk) and head-sharded indexer activations
(shard_indexer_acts) on 8 CPU devices, plus the same selection across 2 processes."""

import itertools
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import multiprocess_worker as mp_worker
import numpy as np
import pytest
from child_env import child_env
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from multiprocess_worker import MESHES, K, make_inputs
from selection_helpers import selected, sharded_selected
from test_remat import TOPK, count_prim, remat_layer

import csa_eqx as ce
from csa_eqx import EntryLayout, entry_layout
from csa_eqx.presets import tiny_v4, tiny_v32

MESH_SHAPES = [((8,), ("tensor",)), ((2, 4), ("data", "tensor"))]
ROOT = Path(__file__).resolve().parents[1]


def random_inputs(b, s, packed, ties, seed=0, h=4, d=8):
    r = np.random.default_rng(seed)
    seg = np.zeros((b, s), np.int32)
    if packed:
        seg[:, s // 3 :] = 1
        seg[:, 2 * s // 3 :] = 2
    layout = entry_layout(jnp.asarray(seg), 4)
    t = layout.end.shape[1]

    def draw(*shape):  # small integers: exact scores with many ties
        return r.integers(-1, 2, shape) if ties else r.normal(size=shape)

    q = jnp.asarray(draw(b, s, h, d), jnp.float32)
    w = jnp.asarray(r.normal(size=(b, s, h)), jnp.float32)
    keys = jnp.asarray(draw(b, t, d), jnp.float32)
    qi = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return q, w, keys, qi, jnp.asarray(seg), layout


def walk_eqns(jaxpr):
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    yield from walk_eqns(sub)


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=["tensor8", "data2_tensor4"])
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("s", [32, 13], ids=["rows_divide", "rows_padded"])
def test_sharded_selection_bitwise(mesh_shape, packed, s):
    mesh = jax.make_mesh(*mesh_shape)
    select = jax.jit(lambda *a: selected(*a, k=K))
    for ties, tiles in [(False, {}), (True, {}), (True, dict(head_chunk=2, key_block=2))]:
        sharded = jax.jit(lambda *a, tiles=tiles: sharded_selected(*a, k=K, **tiles))
        args = random_inputs(2, s, packed, ties)
        want = np.asarray(select(*args))
        with jax.set_mesh(mesh):
            got = sharded(*args)
        assert got.shape == (2, s, K)
        np.testing.assert_array_equal(np.asarray(got), want)
        assert (want == -1).any() and (want >= 0).any()


def test_explicit_mesh_argument_and_auto_axes():
    args = random_inputs(2, 24, True, True)
    want = np.asarray(selected(*args, k=K))
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    got = jax.jit(lambda *a: sharded_selected(*a, k=K, mesh=mesh))(*args)
    np.testing.assert_array_equal(np.asarray(got), want)
    auto = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(auto):
        select = partial(sharded_selected, k=K, tensor_axis="tp", data_axis="dp")
        got = jax.jit(select)(*args)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_shard_map_specs_and_decode():
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda *a: sharded_selected(*a, k=K))(
            *random_inputs(2, 16, False, False)
        )
        (smap,) = [e for e in walk_eqns(jaxpr) if e.primitive.name == "shard_map"]
        assert smap.params["in_specs"][:3] == (
            P("data", "tensor", None, None),
            P("data", "tensor", None),
            P("data", None, None),
        )
        # the shards' rows joined by the shard_map's output (typed varying over the axis under
        # check_vma), not by an all-gather inside
        assert smap.params["out_specs"] == (P("data", "tensor", None),)
        assert count_prim(smap.params["jaxpr"], TOPK) == 1
        assert count_prim(smap.params["jaxpr"], "all_gather") == 0
        # batch 1 does not divide the data axis: replicated batch, rows still sharded
        jaxpr = jax.make_jaxpr(lambda *a: sharded_selected(*a, k=K))(
            *random_inputs(1, 16, False, False)
        )
        (smap,) = [e for e in walk_eqns(jaxpr) if e.primitive.name == "shard_map"]
        assert smap.params["in_specs"][0] == P(None, "tensor", None, None)
        # one query row (decode): no shard_map at all
        args = random_inputs(2, 9, False, False)
        row = tuple(a[:, 8:9] for a in args[:2]) + (args[2],) + tuple(a[:, 8:9] for a in args[3:5])
        row = row + (args[5],)
        jaxpr = jax.make_jaxpr(lambda *a: sharded_selected(*a, k=K))(*row)
        assert count_prim(jaxpr, "shard_map") == 0
        got = jax.jit(lambda *a: sharded_selected(*a, k=K))(*row)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(selected(*args, k=K))[:, 8:9])


def test_missing_tensor_axis_is_a_clear_error():
    args = random_inputs(2, 8, False, False)
    with pytest.raises(ValueError, match="'tensor'.*\\('data',\\)"):
        sharded_selected(*args, k=K, mesh=jax.make_mesh((8,), ("data",)))
    with pytest.raises(ValueError, match="indexer_sharded_topk needs a mesh axis named 'tensor'"):
        sharded_selected(*args, k=K)  # no mesh set


def layer_inputs():
    x = jax.random.normal(jax.random.key(1), (2, 24, 48))
    seg = jnp.asarray(np.repeat([[0] * 10 + [1] * 14], 2, 0), jnp.int32)
    return x, seg


RUN_LAYER = jax.jit(lambda m, x, s: m(x, segment_ids=s, return_aux=True))


@pytest.mark.parametrize(
    "mesh_shape, packed, axis_type",
    [
        (MESH_SHAPES[0], False, AxisType.Explicit),
        (MESH_SHAPES[1], True, AxisType.Explicit),
        (MESH_SHAPES[1], True, AxisType.Auto),
    ],
    ids=["tensor8-unpacked-explicit", "data2_tensor4-packed-explicit", "data2_tensor4-packed-auto"],
)
def test_layer_flags_keep_outputs(mesh_shape, packed, axis_type):
    """V4 CSA layer with indexer_sharded_topk + shard_indexer_acts: the same selection
    (bitwise) and output as with both off. On the Auto mesh the batch of x is split over
    "data" (the layer's own ops do not take batch-sharded inputs on Explicit meshes)."""
    x, seg = layer_inputs()
    seg = seg if packed else None
    base = remat_layer()
    y0, aux0 = RUN_LAYER(base, x, seg)
    layer = remat_layer(indexer_sharded_topk=True, shard_indexer_acts=True)
    mesh = jax.make_mesh(*mesh_shape, axis_types=(axis_type,) * len(mesh_shape[0]))
    with jax.set_mesh(mesh):
        if axis_type == AxisType.Auto:
            x, seg = jax.device_put((x, seg), P("data"))
        y, aux = RUN_LAYER(layer, x, seg)
    np.testing.assert_array_equal(np.asarray(aux["selection"]), np.asarray(aux0["selection"]))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_shard_indexer_acts_constraints(axis_type):
    x, seg = layer_inputs()
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(axis_type,) * 2)
    specs, outs = {}, {}
    for on in (False, True):
        layer = remat_layer(shard_indexer_acts=on)
        with jax.set_mesh(mesh):
            jaxpr = jax.make_jaxpr(lambda m, x: m(x, segment_ids=seg))(layer, x)
            outs[on] = np.asarray(jax.jit(lambda m, x: m(x, segment_ids=seg))(layer, x))
        specs[on] = [
            e.params["sharding"].spec
            for e in walk_eqns(jaxpr)
            if e.primitive.name == "sharding_constraint"
        ]
    assert specs[False] == []
    assert sorted(map(str, specs[True])) == sorted(
        map(str, [P(None, None, "tensor", None), P(None, None, "tensor")])
    )
    np.testing.assert_allclose(outs[True], outs[False], rtol=1e-6, atol=1e-6)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_single_process(tmp_path):
    """2 processes x 4 CPU devices (jax.distributed on loopback, gloo collectives).

    The sharded selection on global (8,) and (2, 4) meshes equals the unsharded one bitwise
    in both processes. The full CSA layer with batch-sharded inputs and replicated global
    weights on the (2, 4) mesh (row-sharded top-k), and the same layer context-parallel on an
    (8,) context mesh whose sequence spans both processes: the parts each process holds of
    the output, the selection and the gradients (input, two weights) equal one plain process's
    run, and the two processes together hold all of them.
    """
    out = tmp_path / "run"
    port = free_port()
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    worker = str(ROOT / "tests" / "multiprocess_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(i), str(port), str(out)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    got = [np.load(f"{out}.{i}.npz") for i in range(2)]

    q, w, keys, qi, seg, layout = make_inputs()
    args = [jnp.asarray(a) for a in (q, w, keys, qi, seg)]
    want = np.asarray(selected(*args, EntryLayout(*map(jnp.asarray, layout)), k=K))
    for name in MESHES:
        for part in got:
            np.testing.assert_array_equal(part[f"sel_{name}"], want)

    x, seg, cotangent = mp_worker.layer_inputs()
    want = mp_worker.layer_results(mp_worker.make_layer(sharded=False), x, seg, cotangent)
    for prefix, name in itertools.product(("", "context_"), mp_worker.LAYER_OUTPUTS):
        ref, key = np.asarray(want[name]), prefix + name
        assert (got[0][f"{key}_known"] | got[1][f"{key}_known"]).all(), key
        for part in got:
            known = part[f"{key}_known"]
            assert known.any(), key
            if name == "selection":
                np.testing.assert_array_equal(part[key][known], ref[known])
            else:
                np.testing.assert_allclose(
                    part[key][known],
                    ref[known],
                    rtol=1e-5,
                    atol=1e-6 * np.abs(ref).max(),
                    err_msg=key,
                )


def test_shard_indexer_acts_with_mesh_placed_weights():
    """Weights replicated on an Explicit mesh (as multi-process runs need global arrays) with
    ``shard_indexer_acts``: the indexer's weights, which the selection stage closes over, are
    recast onto ``tensor_axis_auto``'s mesh (``csa_eqx._indexer.sharding.on_context_mesh``;
    before, "context mesh ... should match the aval mesh"); the output is the unsharded
    layer's."""
    from jax.sharding import NamedSharding

    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    x, seg = layer_inputs()
    want, _ = RUN_LAYER(remat_layer(), x, seg)
    layer = remat_layer(shard_indexer_acts=True)
    layer = jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P())) if eqx.is_array(a) else a, layer
    )
    with jax.set_mesh(mesh):
        y, _ = RUN_LAYER(layer, x, seg)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_v41_stack_sharded_topk_bitwise():
    """A V4.1 stack (docs/v41.md: the ratio-1 candidate source and its reindex consumer) with
    ``indexer_sharded_topk`` and ``shard_indexer_acts`` (the index heads' activations placed on
    the tensor axis) on a (data 2, tensor 4) mesh, 26 rows (padded to 28): both selections and
    the candidate blocks are bitwise the unsharded stack's; the outputs within float
    tolerance."""
    from test_v41_layers import candidate_pair

    import csa_eqx as ce

    config = candidate_pair(2, 4, index_n_heads=4)  # the index heads split over 4 devices
    keys = jax.random.split(jax.random.key(0), config.num_layers)

    def stack(execution=None):
        return [ce.V41Attention(config, i, key=k, execution=execution) for i, k in enumerate(keys)]

    run = eqx.filter_jit(ce.run_v41_stack)
    x = jax.random.normal(jax.random.key(5), (2, 26, 32))
    want_ys, want = run(stack(), x)
    sharded = stack(ce.Execution.from_options(indexer_sharded_topk=True, shard_indexer_acts=True))
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "tensor"))):
        ys, got = run(sharded, x)
        jaxpr = jax.make_jaxpr(lambda x: run(sharded, x))(x)
    assert count_prim(jaxpr, "shard_map") == 2
    specs = {
        str(e.params["sharding"].spec)
        for e in walk_eqns(jaxpr)
        if e.primitive.name == "sharding_constraint"
    }
    assert specs == {str(P(None, None, "tensor", None)), str(P(None, None, "tensor"))}
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(got[i].selection), np.asarray(want[i].selection))
    np.testing.assert_array_equal(np.asarray(got[0].candidates), np.asarray(want[0].candidates))
    # the filter bites: 7 blocks of 4 entries, 2 kept
    assert (np.asarray(want[0].candidates) >= 0).all(-1).mean() > 0.5
    for y, w in zip(ys, want_ys, strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kind, execution",
    [
        ("v4", dict(indexer_loss="sparse")),
        ("v4", dict(selection=ce.StreamingSelection(), indexer_loss="dense")),
        (
            "v4",
            dict(
                selection=ce.GatheredSelection(),
                indexer_kl=ce.GatheredIndexerLoss(),
                indexer_loss="sparse",
            ),
        ),
        ("v32", dict(indexer_loss="dense")),
    ],  # fmt: skip
    ids=["dense+sparse-loss", "streaming+dense-loss", "gathered+gathered-loss", "v32"],
)
def test_xla_selections_under_jit_sharding(kind, execution):
    """``jit`` data parallelism with an ``Explicit`` data axis (``jax.make_mesh``'s default):
    the XLA selections' buffers and loop carries take the batch's sharding from the data, so
    the program is typed (before: a ``ShardingTypeError`` in the top-k's and the selections'
    selects and updates) and its loss and every gradient equal one device's."""
    config = tiny_v4("csa", index_topk=4) if kind == "v4" else tiny_v32(index_topk=4)
    layer = (ce.V4Attention if kind == "v4" else ce.V32Attention)(
        config, key=jax.random.key(0), execution=ce.Execution(**execution)
    )
    x = jax.random.normal(jax.random.key(1), (2, 16, config.hidden_size))

    def loss(m, x):
        y, aux = m(x, return_aux=True)
        return jnp.mean(y**2) + jnp.mean(aux["indexer_loss"])

    program = jax.jit(jax.value_and_grad(loss))
    want_value, want_grads = program(layer, x)
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "tensor"))):
        value, grads = program(layer, jax.device_put(x, P("data")))
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(want))))
