"""The XLA paths' exact select as a TPU runs it (``TileSizes.select = "top_k"``, ``TPU_TILES``:
``lax.top_k`` on integer order keys, then a sort of the picks by index; merges by one sort of
keys with indices) selects what the radix select selects on the CPU, bitwise, and what a numpy
stable sort selects: exact ties (to the lower index), ``-0.0`` next to ``+0.0``, fully masked
rows, ``k`` above the row's length. The TPU-configured streaming program (the XLA fallback
the benchmark runs there) holds no gather inside a loop, where the radix one does (the walk
can fail).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_helpers import loop_primitives, walk_eqns
from test_topk_reference import B, S, brute_force, fixed_case, layout_of
from test_triton_selection import problem

import csa_eqx as ce
from csa_eqx._backend import CPU_TILES, TPU_TILES
from csa_eqx._selection.auto import candidate_source
from csa_eqx._topk import _key_values, _order_keys, exact_topk, merge_topk, signed_keys

TOP_K = CPU_TILES._replace(select="top_k")  # the CPU's sizes, the TPU's select


def stable_topk(values, valid, k):
    """Numpy reference: per row the ``k`` best valid values (``-0.0`` equal to ``+0.0``, ties
    to the lower position) as ``(values, positions)`` in increasing position order, ``(-inf,
    -1)`` past the last."""
    rows = values.reshape(-1, values.shape[-1])
    ok = valid.reshape(rows.shape)
    val = np.full((rows.shape[0], k), -np.inf, np.float32)
    pos = np.full((rows.shape[0], k), -1, np.int32)
    for r in range(rows.shape[0]):
        idx = np.nonzero(ok[r])[0]
        picks = sorted(sorted(idx, key=lambda j: (-float(rows[r, j]), j))[:k])
        pos[r, : len(picks)], val[r, : len(picks)] = picks, rows[r, picks]
    return val.reshape(*values.shape[:-1], k), pos.reshape(*values.shape[:-1], k)


@jax.jit
def both_selects(values, valid):
    """``exact_topk`` by both methods for k = 1, 3, 8 (= n) and 11 (> n)."""
    return {
        k: [exact_topk(values, valid, k, method=m) for m in ("radix", "top_k")]
        for k in (1, 3, 8, 11)
    }


def test_top_k_select_equals_the_radix_select_and_a_stable_sort():
    r = np.random.default_rng(0)
    values = r.choice(np.float32([-1.0, -0.0, 0.0, 0.5, 1.0, -np.inf]), (3, 16, 8))
    valid = r.random((3, 16, 8)) < 0.7
    valid[0, :4] = False  # fully masked rows
    valid[1, :4] = True  # rows with more ties than room
    for k, ((rv, rp), (tv, tp)) in both_selects(values, valid).items():
        want_v, want_p = stable_topk(values, valid, k)
        np.testing.assert_array_equal(tp, rp, err_msg=f"k={k}")
        np.testing.assert_array_equal(tp, want_p, err_msg=f"k={k}")
        np.testing.assert_array_equal(tv, want_v, err_msg=f"k={k}")  # -0.0 == +0.0 here
        np.testing.assert_array_equal(rv, want_v, err_msg=f"k={k}")
        assert (tp[0, :4] == -1).all() and np.isneginf(tv[0, :4]).all()


def test_signed_keys_order_and_invert():
    """``signed_keys`` is ``_order_keys`` with its top bit flipped (the same order, signed),
    ``-0.0`` and ``+0.0`` one key, and ``_key_values`` gives the canonical value back."""
    x = jnp.float32([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, np.inf])
    keys = np.asarray(signed_keys(x))
    flipped = np.asarray(_order_keys(x) ^ np.uint32(1 << 31)).view(np.int32)
    np.testing.assert_array_equal(keys, flipped)
    assert (np.diff(keys) > 0).sum() == len(x) - 2 and keys[3] == keys[4]
    back = np.asarray(_key_values(jnp.asarray(keys)))
    np.testing.assert_array_equal(back.view(np.int32), np.where(x == 0, 0.0, x).view(np.int32))


def candidates(r, first: int, rows: int, width: int):
    """A candidate list ``(values, index) [rows, width]``: per row some indices of ``first ..
    first + 9`` in increasing order, then ``(-inf, -1)``; values from three levels (ties)."""
    values = np.full((rows, width), -np.inf, np.float32)
    index = np.full((rows, width), -1, np.int32)
    for i in range(rows):
        n = r.integers(0, width + 1)
        index[i, :n] = np.sort(r.choice(10, n, replace=False)) + first
        values[i, :n] = r.choice([0.0, 1.0, 2.0], n)
    return jnp.asarray(values), jnp.asarray(index)


@pytest.mark.parametrize("k", [2, 5])
def test_merges_equal(k):
    """Two candidate lists with exact ties across them and ``-1`` fills: the sort merge
    equals the radix merge, and a numpy stable sort of the union."""
    r = np.random.default_rng(k)
    running, new = candidates(r, 0, 6, 3), candidates(r, 10, 6, 3)
    got = merge_topk(running, new, k, method="top_k")
    want = merge_topk(running, new, k, method="radix")
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
    index = np.concatenate([running[1], new[1]], -1)
    _, pos = stable_topk(np.concatenate([running[0], new[0]], -1), index >= 0, k)
    np.testing.assert_array_equal(
        got[1], np.where(pos >= 0, np.take_along_axis(index, pos, -1), -1)
    )


@jax.jit
def tiles_selections(q, w, keys, qi, qs, layout):
    """The dense, streaming (one row buffer; merging buffers of 6 entries) and candidate
    source selections of one problem under the radix and the top_k select (k = 3)."""
    out = []
    for tiles in (CPU_TILES, TOP_K):
        p = problem(q, w, keys, qi, qs, layout)._replace(tiles=tiles)
        strategies = (ce.DenseSelection(), ce.StreamingSelection(), STREAMING_MERGES)
        picks = [s.select(p, 3) for s in strategies]
        picks += list(candidate_source(STREAMING_MERGES, p).select_candidates(p, 3, 2, 2))
        out.append(picks)
    return out


STREAMING_MERGES = ce.StreamingSelection(key_block=2, query_block=5, topk_block=6)
NAMES = ("dense", "streaming", "merging", "candidate source", "candidate blocks")


def test_selections_equal_under_both_selects():
    """Every XLA path of a problem (exact ties, packed documents, empty slots, queries that
    see nothing) selects alike under both selects, and as the numpy brute force."""
    q, w, keys, qi, qs, end = fixed_case(2)
    layout = layout_of(end, qs)
    radix, top_k = tiles_selections(q, w, keys, qi, qs, layout)
    for name, got, want in zip(NAMES, top_k, radix, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=name)
    want = brute_force(q, w, keys, qi, qs, end, np.asarray(layout.segment), 3)
    np.testing.assert_array_equal(top_k[1], want)
    assert (want == -1).all(-1).any()


def xla_program(tiles, s=4096, heads=64, m=4, k=512, **fields):
    """The jaxpr of the XLA fallback's selection (``AutoSelection.choose``, as the benchmark's
    XLA path) at the benchmark layer's indexer sizes, bf16, under ``tiles``."""
    seg = jnp.zeros((1, s), jnp.int32)
    qi = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, s))
    vis = ce.Visibility(qi, seg, ce.entry_layout(seg, m))
    chosen = []

    def select(q, w, keys):
        p = ce.SelectionProblem.from_queries(q, w, keys, vis, tiles=tiles)
        strategy = ce.AutoSelection().choose(*p.sizes(), p.tiles)
        strategy = strategy if not fields else ce.StreamingSelection(**fields)
        chosen.append(strategy)
        return strategy.select(p, k)

    sd = jax.ShapeDtypeStruct
    args = (sd((1, s, heads, 128), jnp.bfloat16), sd((1, s, heads), jnp.float32))
    jaxpr = jax.make_jaxpr(select)(*args, sd((1, s // m, 128), jnp.bfloat16))
    return chosen[0], jaxpr.jaxpr


def test_tpu_streaming_program_has_no_gather_in_a_loop():
    """On a TPU's tiles the fallback streams with one ``lax.top_k`` per query block and no
    gather inside any loop; with merging row buffers (a ``topk_block`` of 512) still none; on
    the CPU's radix select the same walk finds the compaction's gathers."""
    strategy, jaxpr = xla_program(TPU_TILES)
    assert isinstance(strategy, ce.StreamingSelection)
    inside = loop_primitives(jaxpr)
    assert "top_k" in inside and "sort" in inside and "dot_general" in inside
    assert "gather" not in inside, sorted(inside)
    _, merging = xla_program(TPU_TILES, topk_block=512)
    assert "gather" not in loop_primitives(merging)
    _, radix = xla_program(TPU_TILES._replace(select="radix"))
    assert "gather" in loop_primitives(radix)


def test_xla_scorer_contracts_at_highest_precision():
    """The logits and the head sum ask for ``HIGHEST`` precision (float32 on a TPU, whose
    default takes bf16 passes); on the CPU that changes nothing: bitwise the default
    precision's scores."""
    r = np.random.default_rng(5)
    q = jnp.asarray(r.normal(size=(B, S, 3, 8)), jnp.float32)
    w = jnp.asarray(r.normal(size=(B, S, 3)), jnp.float32)
    keys = jnp.asarray(r.normal(size=(B, 7, 8)), jnp.float32)
    jaxpr = jax.make_jaxpr(ce.indexer_scores)(q, w, keys).jaxpr
    dots = [e for e in walk_eqns(jaxpr) if e.primitive.name == "dot_general"]
    highest = jax.lax.Precision.HIGHEST
    assert [highest in (e.params["precision"] or ()) for e in dots] == [True, True]

    def default(q, w, keys):
        logits = jnp.einsum("bshd,btd->bsht", q, keys, preferred_element_type=jnp.float32)
        return jnp.einsum("bsht,bsh->bst", jax.nn.relu(logits), w * 8**-0.5)

    got = jax.jit(ce.indexer_scores)(q, w, keys)
    np.testing.assert_array_equal(got, jax.jit(default)(q, w, keys))
