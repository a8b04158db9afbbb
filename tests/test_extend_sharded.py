"""Chunked prefill through ``extend`` runs the forward's selection strategy: with the sharded
top-k (``indexer_sharded_topk=True``) on 8 devices its selections equal the unsharded
forward's bitwise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode import full, run_chunks
from test_remat import count_prim
from test_v4_behaviour import make

import csa_eqx as ce


@pytest.mark.parametrize("mesh_shape", [((8,), ("tensor",)), ((2, 4), ("data", "tensor"))])
def test_chunked_prefill_with_sharded_topk_equals_forward(mesh_shape):
    """One document per row: the sharded chunked prefill selects what the unsharded forward
    selects. Packed rows (cache slots count closed windows, the forward's slots are aligned
    to segments): what the unsharded chunked prefill selects."""
    layer = make("csa", seed=2, index_topk=4)
    sharded = make("csa", seed=2, index_topk=4, indexer_sharded_topk=True)
    assert isinstance(sharded.execution.selection, ce.ShardedSelection)
    b, s, sizes = 2, 27, [9, 1, 12, 5]
    x = jax.random.normal(jax.random.key(3), (b, s, 32))
    one_doc = jnp.zeros((b, s), jnp.int32)
    packed = jnp.asarray([[0] * 11 + [1] * 16, [0] * s], jnp.int32)
    _, want = full(layer, x, one_doc)  # unsharded, one device
    _, want_packed, _ = run_chunks(layer, x, sizes, layer.init_cache(b, 64), packed)
    with jax.set_mesh(jax.make_mesh(*mesh_shape)):
        cache = sharded.init_cache(b, 64)
        chunk = jax.make_jaxpr(lambda m, x, c: m.extend(x, c))(sharded, x[:, :9], cache)
        assert count_prim(chunk, "shard_map") == 1  # the chunk's rows are split over devices
        _, got, _ = run_chunks(sharded, x, sizes, cache, one_doc)
        _, got_packed, _ = run_chunks(sharded, x, sizes, cache, packed)
    want = np.asarray(want["selection"])
    assert (want >= 0).any() and (want == -1).any()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_packed, want_packed)
