"""The attention-kernel family's conformance suite: every ``AbstractAttentionKernel`` through
the same checks against softmax attention written out (issue 43; docs/testing.md,
"Conformance suites").

The reference (``conformance.attention_np``) is each query's softmax over the rows it reads,
with the sink in the denominator: the rows are listed here in numpy from what each kind of
``Reads`` means (docs/concepts.md, "Sparse attention without a dense mask": gathered indices,
the window band ``t - window < j <= t`` of the query's own segment, a history ring before the
queries, dense entries visible to the query and among its picks), and the formula runs in
float64 numpy for the outputs and as plain ``jnp`` for the reference gradient.

Checks, each a test parametrised over ``MEMBERS`` (one jitted program per member computes
them all), on every kind of ``Reads`` the layers build (V4 CSA's band with gathered or masked
picks, HCA's band and dense entries, V3.2's MLA picks (gathered, or its tokens masked to the
picks) with their own values and no sink, ``extend``'s band with a history ring, the gathered
window): outputs and ``lse``, gradients
with respect to queries, keys, entries and sinks; packed documents of ragged lengths, a
query that reads nothing (zeros, ``lse = -inf``); bf16 inputs; the kernel contract for
non-finite rows (NaN exactly for the queries that read them, a NaN or Inf in MLA's values of
their own included); DeepSeek's rounded softmax
(``DeepSeekInference``: bf16 probabilities, the division after ``P·V``), against the formula
with that rounding. A member that cannot run a check says why in ``EXCEPTIONS`` (the test is
skipped with that reason) or refuses it (``REFUSES``: the error is asserted). Non-member tests
put ``AutoAttention``, ``AutoPicks`` and the query-block sizing on both sides of their
boundaries.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import assert_close
from conformance import attention_np, attention_query_block, bf16, choosers, member_results

import csa_eqx as ce

# each member's results come from one program (``member_results``): its tests run in one half
# of `make test` (tests/conftest.py, ``_unit``)
DEALT_TOGETHER = ("name",)
MEMBERS = {
    "xla": ce.XlaAttention(),  # blocks of 4 of the 11 queries (the last one padded)
    "triton": ce.TritonAttention(query_block=4, key_block=2),  # interpret mode: partial tiles
    "auto": ce.AutoAttention(),
    # Pallas' TPU interpreter: blocks of 8 queries (the second partial), its automatic choices
    "mosaic": ce.MosaicAttention(query_block=8),
    # every read set as a masked pass over tiles (a DenseKeys' picks masked by visibility)
    "mosaic-tiles": ce.MosaicAttention(query_block=8, gather="tiles"),
    "expanded": ce.ExpandedAttention(),  # V3.2's prefill arithmetic (float32 here: exact)
}
# (member, check) -> (error, message) the member refuses the check's call with (asserted)
REFUSES = {
    ("triton", "deepseek"): (ValueError, "TritonAttention computes the exact softmax"),
    ("mosaic", "deepseek"): (ValueError, "MosaicAttention computes the exact softmax"),
    ("mosaic-tiles", "deepseek"): (ValueError, "MosaicAttention computes the exact softmax"),
}

B, S, H, D, W, T, K = 2, 11, 3, 8, 4, 6, 3
SCALE, VDIM = 0.3, 5
KINDS = ["csa-gathered", "csa-masked", "hca", "v32", "v32-masked", "extend", "gathered-window"]
MLA = ("v32", "v32-masked")  # values of their own (narrower), no sink
# the kinds the non-finite check reads (csa-masked: a flagged entry some queries pick unseen)
NONFINITE_KINDS = ("hca", "extend", "csa-masked")
_ONE_TABLE = (
    "ExpandedAttention reads one table without sinks (dense entries or one set of gathered "
    "rows: V3.2's reads); it refuses a band, several key sets and sinks"
)
# (member, check) -> why the member cannot run the check (a check: a kind of reads, "bf16",
# "nonfinite" or "deepseek")
EXCEPTIONS = {
    **{("expanded", kind): _ONE_TABLE for kind in KINDS if kind not in MLA},
    ("expanded", "bf16"): _ONE_TABLE + " (the check reads csa-gathered)",
    ("expanded", "nonfinite"): _ONE_TABLE + " (the check reads hca, extend and csa-masked)",
    ("expanded", "deepseek"): (
        "ExpandedAttention is V3.2's prefill arithmetic (normalised before P.V, in the "
        "activations' dtype), not the rounded sparse softmax this check models over "
        "csa-gathered reads"
    ),
}
R = np.random.default_rng(4301)
SEG = np.asarray([[0] * 5 + [1] * 6, [0] * 11], np.int32)
HISTORY = np.asarray([[-1, 0, 0], [0, 0, 0]], np.int32)  # extend's ring: one empty row
_first = R.integers(0, T, (B, S, 1))
PICKS = (_first + np.arange(K)) % T  # distinct per query
PICKS = np.where(np.arange(K) < R.integers(0, K + 1, (B, S, 1)), PICKS, -1).astype(np.int32)
PICKS[:, 0] = -1  # a query that picks nothing
ARRAYS = {
    "q": R.normal(size=(B, S, H, D)),
    "kv": R.normal(size=(B, S + W - 1, D)),
    "entries": R.normal(size=(B, T, D)),
    "sinks": R.normal(size=H),
}
COTANGENT = {kind: R.normal(size=(B, S, H, VDIM if kind in MLA else D)) for kind in KINDS}
LAYOUT = ce.EntryLayout(*(np.asarray(a)[:, :T] for a in ce.entry_layout(jnp.asarray(SEG), 2)))


def reads_of(kind, kv, entries, values=None):
    """The ``Reads`` of one layer path (entries: segment-aligned, 2 tokens each); ``values``:
    MLA's own values (default ``2 kv[..., :VDIM]``)."""
    seg, picks = jnp.asarray(SEG), jnp.asarray(PICKS)
    values = kv[..., :VDIM] * 2.0 if values is None else values
    index = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    layout = ce.EntryLayout(*(jnp.asarray(a) for a in LAYOUT))
    band = ce.BandRows(kv, seg, W)
    if kind == "csa-gathered":
        return ce.Reads((ce.GatheredRows(entries, picks),), band=band)
    if kind == "csa-masked":
        return ce.Reads(band=band, dense=ce.DenseKeys(entries, layout, index, seg, None, picks))
    if kind == "hca":
        return ce.Reads(band=band, dense=ce.DenseKeys(entries, layout, index, seg))
    if kind == "v32":  # MLA: keys and (narrower) values differ; no sink
        tokens = jnp.where(picks >= 0, picks + W, -1)
        return ce.Reads((ce.GatheredRows(kv, tokens, values),))
    if kind == "v32-masked":  # the token rows as entries (m = 1), masked to the picks
        keys = kv[:, W - 1 :]
        tokens = ce.EntryLayout(index, seg, jnp.ones((B, S), bool))
        dense = ce.DenseKeys(keys, tokens, index, seg, values[:, W - 1 :], picks)
        return ce.Reads(dense=dense)
    if kind == "extend":
        band = ce.BandRows(kv, seg, W, jnp.asarray(HISTORY))
        return ce.Reads((ce.GatheredRows(entries, picks),), band=band)
    assert kind == "gathered-window"
    window = ce.GatheredWindow().reads(kv, index, seg, W)
    return window.join(ce.Reads((ce.GatheredRows(entries, picks),)))


def rows_read(kind):
    """What each query reads, listed from the reads' definitions: ``(table, row)`` pairs per
    query, ``table`` naming ``"kv"`` or ``"entries"``."""
    out = []
    for b in range(B):
        for t in range(S):
            rows = []
            picked = [("entries", int(j)) for j in PICKS[b, t] if j >= 0]
            window = [("kv", p) for p in range(max(t - W + 1, 0), t + 1) if SEG[b, p] == SEG[b, t]]
            visible = [
                j
                for j in range(T)
                if 0 <= LAYOUT.end[b, j] <= t and LAYOUT.segment[b, j] == SEG[b, t]
            ]
            if kind in ("csa-gathered", "gathered-window"):
                rows = picked + window
            elif kind == "csa-masked":
                rows = window + [("entries", j) for j in visible if j in PICKS[b, t]]
            elif kind == "hca":
                rows = window + [("entries", j) for j in visible]
            elif kind == "v32":
                rows = [("kv", int(j) + W) for j in PICKS[b, t] if j >= 0]
            elif kind == "v32-masked":  # a picked token the query sees (its own, earlier)
                seen = [j for j in PICKS[b, t] if 0 <= j <= t and SEG[b, j] == SEG[b, t]]
                rows = [("kv", int(j) + W - 1) for j in sorted(seen)]
            else:  # extend: tokens t - W < p <= t, the ring's rows (p < 0) first in the table
                for p in range(t - W + 1, t + 1):
                    own = HISTORY[b, p + W - 1] if p < 0 else SEG[b, p]
                    if p >= -(W - 1) and own == SEG[b, t]:
                        rows.append(("kv", p + W - 1))
                rows = picked + rows
            out.append(rows)
    return out


def gathered_rows(kind, xp, kv, entries, values=None):
    """Each query's key and value rows ``[B, S, n, ·]`` and its mask, from ``rows_read``
    (``values``: MLA's own, as ``reads_of``)."""
    lists = rows_read(kind)
    n = max(len(r) for r in lists)
    tables = {"kv": kv, "entries": entries}
    offsets = {"kv": 0, "entries": kv.shape[1]}
    index = np.zeros((B * S, n), np.int32)
    mask = np.zeros((B * S, n), bool)
    for i, rows in enumerate(lists):
        for j, (table, row) in enumerate(rows):
            index[i, j], mask[i, j] = offsets[table] + row, True
    index, mask = index.reshape(B, S, n), mask.reshape(B, S, n)
    keys = xp.concatenate([tables["kv"], tables["entries"]], axis=1)
    if kind not in MLA:
        values = keys
    elif values is None:
        values = keys[..., :VDIM] * 2.0
    take = (
        jax.vmap(lambda t, i: t[i])
        if xp is jnp
        else (lambda t, i: t[np.arange(B)[:, None, None], i])
    )
    return take(keys, index), take(values, index), mask


def reference(kind, arrays, weights_round=None):
    """float64 ``(out, lse)`` of ``kind``, the readers of a non-finite row (or of their own
    non-finite query) set to NaN as the kernel contract says."""
    a = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
    bad_kv = ~np.isfinite(a["kv"]).all(-1)
    if "values" in a:  # MLA's own values: a non-finite value row poisons its readers too
        bad_kv = bad_kv | ~np.isfinite(a["values"]).all(-1)
    bad_entries = ~np.isfinite(a["entries"]).all(-1)
    zero = {k: np.where(np.isfinite(v), v, 0.0) for k, v in a.items()}
    keys, values, mask = gathered_rows(kind, np, zero["kv"], zero["entries"], zero.get("values"))
    sinks = None if kind in MLA else a["sinks"]
    out, lse = attention_np(np, zero["q"], keys, values, mask, sinks, SCALE, weights_round)
    bad, _, _ = gathered_rows(kind, np, bad_kv[..., None], bad_entries[..., None])
    poisoned = (bad[..., 0] & mask).any(-1) | ~np.isfinite(a["q"]).all((2, 3))
    return np.where(poisoned[..., None, None], np.nan, out), np.where(
        poisoned[..., None], np.nan, lse
    )


def loss_of(fn, kind):
    def loss(arrays):
        out, lse = fn(arrays)
        seen = jnp.isfinite(lse)
        total = jnp.sum(out * COTANGENT[kind]) + 0.1 * jnp.sum(jnp.where(seen, lse, 0.0))
        return total, (out, lse)

    return loss


@pytest.fixture(scope="module")
def reference_grads():
    """The plain ``jnp`` formula's gradients, per kind, in one program."""

    def formula(kind):
        def fn(arrays):
            keys, values, mask = gathered_rows(kind, jnp, arrays["kv"], arrays["entries"])
            sinks = None if kind in MLA else arrays["sinks"]
            return attention_np(jnp, arrays["q"], keys, values, mask, sinks, SCALE)

        return fn

    arrays = {k: jnp.asarray(v, jnp.float32) for k, v in ARRAYS.items()}
    grads = jax.jit(
        lambda a: {k: jax.grad(loss_of(formula(k), k), has_aux=True)(a)[0] for k in KINDS}
    )
    return jax.device_get(grads(arrays))


def _attend(kernel, kind, arrays, numerics=None):
    reads = reads_of(kind, arrays["kv"], arrays["entries"], arrays.get("values"))
    sinks = None if kind in MLA else arrays["sinks"]
    kw = dict(return_lse=True, query_block=4, numerics=numerics)
    return kernel.attend(arrays["q"], reads, sinks, SCALE, **kw)


def nonfinite_arrays():
    a = {k: np.array(v, np.float32) for k, v in ARRAYS.items()}
    a["kv"][0, 6] = np.nan  # token 3 of row 0 (the history's rows come first for extend)
    a["entries"][1, 2, 1] = np.inf
    a["q"][1, 9, 0, 0] = np.nan
    return a


def bad_values_arrays():
    """MLA's values an array of their own (``2 kv[..., :VDIM]``, the keys finite) with a NaN in
    token 5's row of batch row 0 and an Inf in token 3's of row 1: some queries read them
    (gathered, or seen among their picks), others not."""
    a = {k: np.array(v, np.float32) for k, v in ARRAYS.items()}
    a["values"] = a["kv"][..., :VDIM] * 2.0
    a["values"][0, W - 1 + 5, 2] = np.nan
    a["values"][1, W - 1 + 3, 0] = np.inf
    return a


@eqx.filter_jit
def outputs(name: str, arrays, bf16_arrays, bad_arrays, deepseek: bool):
    kernel, out = MEMBERS[name], {}
    runs = lambda check: (name, check) not in EXCEPTIONS  # noqa: E731
    for kind in filter(runs, KINDS):
        fn = lambda a, kind=kind: _attend(kernel, kind, a)  # noqa: E731
        out[kind] = jax.grad(loss_of(fn, kind), has_aux=True)(arrays)
    if runs("bf16"):
        out["bf16"] = _attend(kernel, "csa-gathered", bf16_arrays)
    if runs("nonfinite"):
        for kind in NONFINITE_KINDS:
            out[f"bad-{kind}"] = _attend(kernel, kind, bad_arrays)
    for kind in MLA:  # every member reads MLA's values of their own
        values = {k: jnp.asarray(v) for k, v in bad_values_arrays().items()}
        out[f"bad-values-{kind}"] = _attend(kernel, kind, values)
    if deepseek:
        out["deepseek"] = _attend(kernel, "csa-gathered", arrays, ce.DeepSeekInference())
    return out


def _bf16_arrays():
    a = {k: jnp.asarray(v, jnp.bfloat16) for k, v in ARRAYS.items()}
    return {**a, "sinks": a["sinks"].astype(jnp.float32)}


@pytest.fixture(scope="module")
def results():
    def run(name: str) -> dict:
        arrays = {k: jnp.asarray(v, jnp.float32) for k, v in ARRAYS.items()}
        bad = {k: jnp.asarray(v) for k, v in nonfinite_arrays().items()}
        refused = REFUSES.get((name, "deepseek"))
        deepseek = refused is None and (name, "deepseek") not in EXCEPTIONS
        out = jax.device_get(outputs(name, arrays, _bf16_arrays(), bad, deepseek))
        if refused:
            with pytest.raises(refused[0], match=refused[1]):
                _attend(MEMBERS[name], "csa-gathered", arrays, ce.DeepSeekInference())
            out["refused"] = True
        return out

    return member_results(EXCEPTIONS, run)


def test_the_inputs_tell_right_from_wrong():
    """Every kind reads rows from more than one set and some queries read few; query 0 of
    V3.2's reads nothing; the non-finite rows reach some queries, not all, and one of them is
    also picked by a query that cannot see it."""
    for kind in KINDS:
        counts = [len(r) for r in rows_read(kind)]
        assert max(counts) > 2 and min(counts) < max(counts), kind
    assert rows_read("v32")[0] == [] and rows_read("v32")[S] == []
    for kind in NONFINITE_KINDS:
        out, _ = reference(kind, nonfinite_arrays())
        bad = np.isnan(out).any((2, 3))
        assert bad.any() and not bad.all(), kind
    for kind in MLA:  # the non-finite values reach some queries, not all
        out, _ = reference(kind, bad_values_arrays())
        bad = np.isnan(out).any((2, 3))
        assert bad[0].any() and bad[1].any() and not bad.all(), kind
    # csa-masked: the flagged entry (row 1, entry 2) is also picked by a query that cannot see it
    end, seg = (int(np.asarray(a)[1, 2]) for a in LAYOUT[:2])
    assert [t for t in range(S) if 2 in PICKS[1, t] and not (0 <= end <= t and seg == SEG[1, t])]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", MEMBERS)
def test_outputs_and_lse(results, name, kind):
    _, (out, lse) = results(name, kind)[kind]
    want_out, want_lse = reference(kind, ARRAYS)
    assert_close(out, want_out, what="out")
    assert_close(lse, want_lse, what="lse")
    if kind == "v32":  # query 0 reads nothing and has no sink
        assert (out[:, 0] == 0).all() and (lse[:, 0] == -np.inf).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", MEMBERS)
def test_gradients(results, reference_grads, name, kind):
    grads, _ = results(name, kind)[kind]
    for array, want in reference_grads[kind].items():
        if kind in MLA and array in ("entries", "sinks"):
            assert not np.asarray(grads[array]).any()
            continue
        assert np.abs(want).max() > 0, array
        assert_close(grads[array], want, what=f"d{array}")


@pytest.mark.parametrize("name", MEMBERS)
def test_bf16_inputs(results, name):
    out, lse = results(name, "bf16")["bf16"]
    assert out.dtype == jnp.bfloat16
    rounded = {k: bf16(v) if k != "sinks" else v for k, v in ARRAYS.items()}
    want_out, want_lse = reference("csa-gathered", rounded)
    assert_close(out, want_out, rtol=2e-2, what="out")
    assert_close(lse, want_lse, rtol=1e-2, what="lse")


@pytest.mark.parametrize("name", MEMBERS)
def test_nonfinite_rows_reach_only_their_readers(results, name):
    for kind in NONFINITE_KINDS:
        out, lse = results(name, "nonfinite")[f"bad-{kind}"]
        want_out, want_lse = reference(kind, nonfinite_arrays())
        assert_close(out, want_out, what=kind)
        assert_close(lse, want_lse, what=kind)


@pytest.mark.parametrize("kind", MLA)
@pytest.mark.parametrize("name", MEMBERS)
def test_nonfinite_values_reach_only_their_readers(results, name, kind):
    """A NaN (and an Inf) in the values, not the keys: exactly the queries that read that value
    row return NaN (out and ``lse``); the others' are the formula's."""
    out, lse = results(name, kind)[f"bad-values-{kind}"]
    want_out, want_lse = reference(kind, bad_values_arrays())
    assert_close(out, want_out, what=f"{kind} out")
    assert_close(lse, want_lse, what=f"{kind} lse")


def _deepseek_rounding(p):
    return bf16(np.float32(p)).astype(np.float64)


@pytest.mark.parametrize("name", MEMBERS)
def test_deepseek_rounded_softmax(results, name):
    """``DeepSeekInference``'s softmax: bf16 probabilities relative to the logits' maximum
    (the sink left out of it), divided after ``P·V``. Within float32 rounding of the formula
    with that rounding on nearly every output; the exact softmax is not."""
    out = results(name, "deepseek")
    if out.get("refused"):  # asserted in results(): the member refuses the numerics
        return
    got, _ = out["deepseek"]
    want, _ = reference("csa-gathered", ARRAYS, _deepseek_rounding)
    exact, _ = reference("csa-gathered", ARRAYS)
    scale = np.abs(want).max()
    assert np.mean(np.abs(got - want) <= 1e-5 * scale) > 0.99
    assert np.abs(got - want).max() <= 4e-3 * scale
    assert np.mean(np.abs(exact - want) <= 1e-5 * scale) < 0.5


# --- the automatic choices, on both sides of each boundary ------------------------------------


def test_auto_attention_runs_the_platforms_kernel(monkeypatch):
    assert ce.Execution().attention == ce.AutoAttention()
    assert ce.AutoAttention().choose() == ce.XlaAttention()  # CPU: the reference
    monkeypatch.setattr(choosers.jax, "default_backend", lambda: "gpu")
    assert ce.AutoAttention().choose() == ce.XlaAttention()  # the Triton kernel: by name only
    monkeypatch.setattr(choosers.jax, "default_backend", lambda: "tpu")
    assert ce.AutoAttention().choose() == ce.MosaicAttention()
    # DeepSeek's rounded softmax is XlaAttention's only: the kernel refuses it
    assert ce.AutoAttention().choose(ce.DeepSeekInference()) == ce.XlaAttention()
    assert ce.AutoAttention().choose(ce.ExactNumerics()) == ce.MosaicAttention()
    # under a mesh the compiler shards the kernels still run (per device: csa_eqx._mesh);
    # the platform is the mesh's devices': a TPU's (abstract) mesh, the CPU's own devices
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    tpus = jax.sharding.AbstractMesh((2, 4), ("data", "tensor"), explicit, abstract_device=device)
    with jax.sharding.use_abstract_mesh(tpus):
        assert ce.AutoAttention().choose() == ce.MosaicAttention()
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "tensor"))):
        assert ce.AutoAttention().choose() == ce.XlaAttention()


@pytest.mark.parametrize(
    "entries, chosen", [(4 * K, ce.MaskedPicks), (4 * K + 1, ce.GatheredPicks)]
)
def test_auto_picks_at_its_ratio(entries, chosen):
    """``AutoPicks`` (``ratio = 4``) at ``T = 4k`` and ``4k + 1``: what it chooses, and the
    attention over its reads the formula's over each query's visible picks."""
    seg = np.zeros((B, S), np.int32)
    end = (
        np.where(np.arange(entries) < S, np.arange(entries), -1)[None].repeat(B, 0).astype(np.int32)
    )
    index = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    visible = (end[:, None, :] >= 0) & (end[:, None, :] <= index[..., None])
    picks = np.full((B, S, K), -1, np.int32)
    for b, t in np.ndindex(B, S):
        slots = R.permutation(np.flatnonzero(visible[b, t]))[:K]
        picks[b, t, : len(slots)] = slots
    entries_ = R.normal(size=(B, entries, D)).astype(np.float32)
    q = R.normal(size=(B, S, H, D)).astype(np.float32)
    layout = ce.EntryLayout(
        jnp.asarray(end), jnp.zeros_like(jnp.asarray(end)), jnp.asarray(end >= 0)
    )
    visibility = ce.Visibility(jnp.asarray(index), jnp.asarray(seg), layout)
    assert type(ce.AutoPicks().choose(entries, K)) is chosen

    @jax.jit
    def run(q, keys):
        reads = ce.AutoPicks().reads(keys, visibility, jnp.asarray(picks))
        return ce.XlaAttention().attend(q, reads, None, SCALE, return_lse=True, query_block=4)

    out, lse = run(jnp.asarray(q), jnp.asarray(entries_))
    rows = np.take_along_axis(entries_[:, None], np.maximum(picks, 0)[..., None], axis=2)
    want = attention_np(np, q.astype(np.float64), rows, rows, picks >= 0, None, SCALE)
    assert_close(out, want[0], what="out")
    assert_close(lse, want[1], what="lse")


def test_query_block_sizing_on_both_sides_of_a_boundary():
    """``attention_query_block``: the largest power of two of rows within the elements budget,
    capped near the window; the reference kernel's results at the blocks either side equal the
    formula's."""
    arrays = {k: jnp.asarray(v, jnp.float32) for k, v in ARRAYS.items()}
    reads = reads_of("csa-gathered", arrays["kv"], arrays["entries"])
    per_row = K * (D + H)  # gathered keys and logits per pick; the band caps the block at 4
    assert attention_query_block(B, H, reads, B * per_row * 2) == 2
    assert attention_query_block(B, H, reads, B * per_row * 2 - 1) == 1
    assert attention_query_block(B, H, reads, 1 << 24) == 4  # window 4: at most 4
    want_out, want_lse = reference("csa-gathered", ARRAYS)
    for block in (1, 2, 4):
        out, lse = jax.jit(
            lambda a, block=block: ce.XlaAttention().attend(
                a["q"], reads_of("csa-gathered", a["kv"], a["entries"]), a["sinks"], SCALE,
                return_lse=True, query_block=block,
            )
        )(arrays)  # fmt: skip
        assert_close(out, want_out, what=f"block {block}")
        assert_close(lse, want_lse, what=f"block {block}")
