"""The randomised sweep of the Mosaic kernels' settings (issue 57), shared by the CPU tests
(Pallas' TPU interpreter: ``test_mosaic_attention.py``, ``test_mosaic_selection.py``) and the
chip's (``test_tpu_attention.py``, ``test_tpu_selection.py``, larger example budgets).

A *setting* is what a compiled program depends on (the kernel's fields, dtypes, widths, sizes,
the kinds of reads): drawn from a small fixed table, so that every example of a setting reuses
its programs (compiling dominates on the CPU). The *data* of an example are drawn by hypothesis
(``derandomize=True``: the same examples every run; a failure prints the drawn values): picks
with repeats, a block's largest pick exactly on a tile boundary (row 0 alone, row ``tile``,
``2 tile``), queries that pick nothing, an entry closing exactly at a query block's last query
at the start of a tile, document boundaries, non-finite values in the queries, the keys and the
values. Each example is compared with the numpy references of ``tests/conformance.py``:
``attention_np`` (float64 outputs and ``lse``; its ``jnp`` form's autodiff for every gradient)
and ``scores_np`` / ``brute_topk`` / ``visible_np`` for the selection.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from attention_helpers import assert_close
from conformance import attention_np, bf16, brute_topk, scores_np, visible_np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

import csa_eqx as ce

SCALE = 0.3


def sweep_settings(examples: int):
    """hypothesis' settings of a sweep: a fixed budget, the same examples every run, no
    shrinking (each run of a failing example costs a kernel call; the failing example's draws
    are printed as drawn)."""
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )


# --- attention -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionSetting:
    """One compiled program: ``kernel`` over ``reads`` (``"+"``-joined: ``band``, ``picks``
    (gathered rows), ``masked`` (a ``DenseKeys``' picks), ``dense`` (every visible entry)) of
    ``batch`` rows of ``s`` queries x ``heads`` heads, keys ``d`` wide, ``t`` entries, ``k``
    picks a query, a band of ``window``; ``values``: 0 (the keys, V4) or the width of values of
    their own (MLA, bf16 ones packed in words of their own)."""

    name: str
    kernel: ce.MosaicAttention
    reads: str
    dtype: str = "float32"
    batch: int = 1
    s: int = 16
    heads: int = 8
    d: int = 8
    values: int = 0
    t: int = 150
    k: int = 6
    window: int = 4
    sinks: bool = True
    tolerance: float = 0.0  # 0: 1e-5 for float32, 3e-2 for bfloat16 (relative to the largest)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.reads.split("+"))

    @property
    def width(self) -> int:
        return self.values or self.d

    @property
    def rtol(self) -> float:
        return self.tolerance or (1e-5 if self.dtype == "float32" else 3e-2)


def attention_data(draw, c: AttentionSetting) -> dict:
    """One example's numpy inputs of setting ``c`` (see the module docstring)."""
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    r = np.random.default_rng(seed)
    b, s, t, k = c.batch, c.s, c.t, c.k
    qb = c.kernel.query_block_for(b, c.heads, None, None)
    tile = c.kernel.tile_block
    # documents: each batch row split once (the split drawn; s: one document)
    splits = [draw(st.integers(1, s), label="document split") for _ in range(b)]
    segment = (np.arange(s)[None, :] >= np.asarray(splits)[:, None]).astype(np.int32)
    # entries: windows closing in order (row-major, -1: empty), a document's own segment
    end = np.sort(r.integers(-2, s + 1, (b, t)), axis=1).astype(np.int32)
    end = np.where(end < 0, -1, end)
    if "dense" in c.kinds or "masked" in c.kinds:
        # an entry closing exactly at a query block's last query, first of its tile (the
        # block's last tile holds only it), the entries after it closing later
        block = draw(st.integers(0, -(-s // qb) - 1), label="block closing a tile")
        last = min(block * qb + qb - 1, s - 1)
        first = draw(st.sampled_from([m * tile for m in range(1, -(-t // tile))]), label="tile")
        end[:, :first] = np.minimum(end[:, :first], last)
        end[:, first] = last
        end[:, first + 1 :] = np.maximum(end[:, first + 1 :], last + 1)
    entry_segment = np.take_along_axis(segment, np.clip(end, 0, s - 1), axis=1)
    # picks: distinct, or with repeats (a row picked twice counts twice); some -1
    picks = np.stack([r.permutation(t)[:k] for _ in range(b * s)]).reshape(b, s, k)
    picks = np.where(np.arange(k) < r.integers(0, k + 1, (b, s, 1)), picks, -1)
    # a query block whose largest pick is on a tile boundary: row 0 alone, or m * tile (its
    # other picks below it, distinct)
    boundary = draw(st.sampled_from([m * tile for m in range(-(-t // tile))]), label="boundary")
    block = draw(st.integers(0, -(-s // qb) - 1), label="boundary block")
    rows = range(block * qb, min(block * qb + qb, s))
    for i in range(b):
        for j in rows:
            below = r.permutation(max(boundary, 1))[:k]
            picks[i, j] = -1 if boundary == 0 else np.where(picks[i, j] >= 0, below, -1)
        picks[i, rows[0], -1] = boundary
    if "picks" in c.kinds:  # about half the queries pick a row twice (gathered rows only)
        twice = r.random((b, s)) < 0.5
        picks[..., 1] = np.where(twice, picks[..., 0], picks[..., 1])
    data = dict(
        q=r.normal(size=(b, s, c.heads, c.d)),
        kv=r.normal(size=(b, s, c.d)),
        entries=r.normal(size=(b, t, c.d)),
        sinks=r.normal(size=c.heads),
        segment=segment,
        end=end,
        entry_segment=entry_segment,
        picks=picks.astype(np.int32),
    )
    if c.values:
        data["kv_values"] = r.normal(size=(b, s, c.values))
        data["entry_values"] = r.normal(size=(b, t, c.values))
    # non-finite values: a query's feature, a key row's, a value row's (NaN or Inf)
    poison = draw(st.sampled_from(["none", "query", "key", "value", "all"]), label="non-finite")
    bad = draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="non-finite value")
    if poison in ("query", "all"):
        data["q"][r.integers(b), r.integers(s), r.integers(c.heads), r.integers(c.d)] = bad
    if poison in ("key", "all"):
        data["entries"][
            r.integers(b), picks.max() if r.random() < 0.5 else r.integers(t), r.integers(c.d)
        ] = bad
    if poison in ("value", "all"):
        table = "entry_values" if c.values else "kv"
        if c.values and "band" in c.kinds and r.random() < 0.5:
            table = "kv_values"
        shape = data[table].shape
        data[table][r.integers(b), r.integers(shape[1]), r.integers(shape[2])] = np.nan
    for key in ("q", "kv", "entries", "sinks", "kv_values", "entry_values"):
        if key in data:
            data[key] = data[key].astype(np.float32)
            if c.dtype == "bfloat16" and key != "sinks":
                data[key] = bf16(data[key])
    data["cotangent"] = r.normal(size=(b, s, c.heads, c.width)).astype(np.float32)
    return data


def rows_read(c: AttentionSetting, data) -> list[list[tuple[int, int]]]:
    """Each query's rows (``(table, row)``: 0 the band's token rows, 1 the entries), listed
    from what each kind of reads means (a repeated pick listed twice)."""
    seg, end, eseg, picks = (data[k] for k in ("segment", "end", "entry_segment", "picks"))
    out = []
    for b in range(c.batch):
        for t in range(c.s):
            rows = []
            visible = [j for j in range(c.t) if 0 <= end[b, j] <= t and eseg[b, j] == seg[b, t]]
            if "band" in c.kinds:
                lo = max(t - c.window + 1, 0)
                rows += [(0, p) for p in range(lo, t + 1) if seg[b, p] == seg[b, t]]
            if "picks" in c.kinds:
                rows += [(1, int(j)) for j in picks[b, t] if j >= 0]
            if "masked" in c.kinds:
                rows += [(1, j) for j in visible if j in picks[b, t]]
            if "dense" in c.kinds:
                rows += [(1, j) for j in visible]
            out.append(rows)
    return out


def _index(c: AttentionSetting, data):
    """``[B, S, n]`` rows of the joined table (token rows, then entries) and the mask, ``n``
    fixed per setting (one reference program)."""
    lists = rows_read(c, data)
    n = c.window * ("band" in c.kinds) + c.k * ("picks" in c.kinds) + c.k * ("masked" in c.kinds)
    n += c.t * ("dense" in c.kinds)
    index = np.zeros((c.batch * c.s, max(n, 1)), np.int32)
    mask = np.zeros(index.shape, bool)
    for i, rows in enumerate(lists):
        for j, (table, row) in enumerate(rows):
            index[i, j], mask[i, j] = row + table * c.s, True
    return index.reshape(c.batch, c.s, -1), mask.reshape(c.batch, c.s, -1)


def _tables(xp, c: AttentionSetting, a):
    keys = xp.concatenate([a["kv"], a["entries"]], axis=1)
    if not c.values:
        return keys, keys
    return keys, xp.concatenate([a["kv_values"], a["entry_values"]], axis=1)


FLOATS = ("q", "kv", "entries", "sinks", "kv_values", "entry_values")


def attention_reference(c: AttentionSetting, data):
    """float64 ``(out, lse)``, the readers of a non-finite row (or of their own non-finite
    query) NaN (the kernel contract), and the poisoned queries."""
    a = {k: np.asarray(data[k], np.float64) for k in FLOATS if k in data}
    zero = {k: np.where(np.isfinite(v), v, 0.0) for k, v in a.items()}
    index, mask = _index(c, data)
    keys, values = _tables(np, c, zero)
    take = lambda table: table[np.arange(c.batch)[:, None, None], index]  # noqa: E731
    sinks = zero["sinks"] if c.sinks else None
    out, lse = attention_np(np, zero["q"], take(keys), take(values), mask, sinks, SCALE)
    bad_keys, bad_values = _tables(
        np, c, {k: ~np.isfinite(v).all(-1, keepdims=True) for k, v in a.items()}
    )
    bad = (take(bad_keys) | take(bad_values))[..., 0]
    poisoned = (bad & mask).any(-1) | ~np.isfinite(a["q"]).all((2, 3))
    out = np.where(poisoned[..., None, None], np.nan, out)
    return out, np.where(poisoned[..., None], np.nan, lse), poisoned


def _reads(c: AttentionSetting, a, ints):
    seg, index = ints["segment"], jnp.broadcast_to(jnp.arange(c.s, dtype=jnp.int32), (c.batch, c.s))
    layout = ce.EntryLayout(ints["end"], ints["entry_segment"], ints["end"] >= 0)
    values = a.get("entry_values")
    gathered, dense, band = (), None, None
    if "picks" in c.kinds:
        gathered = (ce.GatheredRows(a["entries"], ints["picks"], values),)
    if "masked" in c.kinds:
        dense = ce.DenseKeys(a["entries"], layout, index, seg, values, ints["picks"])
    if "dense" in c.kinds:
        dense = ce.DenseKeys(a["entries"], layout, index, seg, values)
    if "band" in c.kinds:
        band = ce.BandRows(a["kv"], seg, c.window, None, a.get("kv_values"))
    return ce.Reads(gathered, band=band, dense=dense)


def _loss(out, lse, cotangent, seen):
    total = jnp.sum(out.astype(jnp.float32) * cotangent)
    return total + 0.1 * jnp.sum(jnp.where(seen, lse, 0.0))


@eqx.filter_jit
def kernel_outputs(c: AttentionSetting, a, ints, cotangent):
    """The kernel's ``(grads, (out, lse))`` of the sweep's loss (``lse`` where finite)."""

    def loss(a):
        sinks = a["sinks"] if c.sinks else None
        out, lse = c.kernel.attend(a["q"], _reads(c, a, ints), sinks, SCALE, return_lse=True,
                                   query_block=8)  # fmt: skip
        return _loss(out, lse, cotangent, jnp.isfinite(lse)), (out, lse)

    return jax.grad(loss, has_aux=True)(a)


@eqx.filter_jit
def reference_grads(c: AttentionSetting, a, index, mask, cotangent, seen):
    """The ``jnp`` formula's gradients (float32; the poisoned queries' cotangents and their
    non-finite inputs zeroed, as the kernel contract reads them)."""

    def loss(a):
        keys, values = _tables(jnp, c, a)
        take = jax.vmap(lambda table, i: table[i])
        sinks = a["sinks"] if c.sinks else None
        out, lse = attention_np(jnp, a["q"], take(keys, index), take(values, index), mask,
                                sinks, SCALE)  # fmt: skip
        return _loss(out, lse, cotangent, seen)

    return jax.grad(loss)(a)


def check_attention(c: AttentionSetting, data, reference_device=None) -> None:
    """One example: the kernel's outputs, ``lse`` and every gradient against the references
    (``reference_device``: where the ``jnp`` formula runs; default the default device)."""
    dtype = jnp.dtype(c.dtype)
    a = {
        k: jnp.asarray(data[k], jnp.float32 if k == "sinks" else dtype) for k in FLOATS if k in data
    }
    ints = {
        k: jnp.asarray(data[k], jnp.int32) for k in ("segment", "end", "entry_segment", "picks")
    }
    grads, (out, lse) = kernel_outputs(c, a, ints, jnp.asarray(data["cotangent"]))
    want_out, want_lse, poisoned = attention_reference(c, data)
    assert_close(out, want_out, rtol=c.rtol, what="out")
    assert_close(lse, want_lse, rtol=min(c.rtol, 1e-2), what="lse")
    index, mask = _index(c, data)
    seen = np.isfinite(want_lse)
    cotangent = np.where(poisoned[..., None, None], 0.0, data["cotangent"])
    zero = {k: np.where(np.isfinite(data[k]), data[k], 0.0).astype(np.float32) for k in a}
    args = (zero, index, mask, cotangent.astype(np.float32), seen)
    if reference_device is not None:  # float32 dots in full precision (not a TPU's default)
        args = jax.device_put(args, reference_device)
    want = reference_grads(c, *args)
    names = set(a) - (set() if c.sinks else {"sinks"})
    if "band" not in c.kinds:
        names -= {"kv", "kv_values"}
    for name in names:
        got = np.asarray(grads[name], np.float32)
        assert np.isfinite(got).all(), f"d{name} not finite"
        assert_close(got, want[name], rtol=c.rtol * (5 if c.dtype == "bfloat16" else 1),
                     what=f"d{name}")  # fmt: skip


# --- selection -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SelectionSetting:
    """One compiled ``MosaicSelection`` program: ``batch`` rows of ``s`` queries x ``heads``
    indexer heads of width ``d`` over ``t`` entries, ``k`` picks; ``score_dtype`` ``None`` or
    ``"bfloat16"`` (DeepSeek-V4's bf16 einsum), ``head_chunk`` heads a partial sum."""

    name: str
    kernel: object
    d: int = 128
    batch: int = 1
    s: int = 8
    heads: int = 4
    t: int = 40
    k: int = 8
    score_dtype: str | None = None
    head_chunk: int = 0
    dtype: str = "float32"


def selection_data(draw, c: SelectionSetting) -> dict:
    """Queries, weights and keys whose logits are exact in float32 (small integers; weights
    ``w·d^-1/2`` not exact in bf16, so the rounding order shows), entries closing in order
    over documents, ties."""
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    r = np.random.default_rng(seed)
    b, s, h, t, d = c.batch, c.s, c.heads, c.t, c.d
    splits = [draw(st.integers(1, s), label="document split") for _ in range(b)]
    segment = (np.arange(s)[None, :] >= np.asarray(splits)[:, None]).astype(np.int32)
    end = np.sort(r.integers(-2, s, (b, t)), axis=1).astype(np.int32)
    end = np.where(end < 0, -1, end)
    entry_segment = np.take_along_axis(segment, np.clip(end, 0, s - 1), axis=1)
    # integer keys near one common key: each query's logits large and close (many scores a
    # bf16 step apart, where the order in which the weight, d^-1/2 and the roundings apply
    # moves the picks); the ReLU's zeros tie
    dense = lambda *shape: r.integers(-3, 4, shape) * (r.random(shape) < 0.6)  # noqa: E731
    q = dense(b, s, h, d).astype(np.float32)
    near = r.integers(-1, 2, (b, t, d)) * (r.random((b, t, d)) < 0.1)
    keys = (dense(b, 1, d) + near).astype(np.float32)
    if draw(st.booleans(), label="tied keys"):
        keys[:, 1::3] = keys[:, ::3][:, : keys[:, 1::3].shape[1]]
    # magnitudes 0.25..1.5: the bf16 terms of a query stay within 2^16 of each other, so their
    # float32 head sums are exact (scores_np asserts it) on every draw
    weights = (r.choice([-1, 1], (b, s, h)) * r.uniform(0.25, 1.5, (b, s, h))).astype(np.float32)
    if c.dtype == "bfloat16":
        q, keys, weights = bf16(q), bf16(keys), bf16(weights)
    data = dict(
        q=q, keys=keys, weights=weights, segment=segment, end=end, entry_segment=entry_segment
    )
    if c.score_dtype == "bfloat16":
        _rounding_order_pair(r, c, data)
    return data


def _bf16_score(logits, weights, chunk: int, late: bool) -> np.float32:
    """One bf16 score (``scores_np``'s model) of integer ``logits [H]``; ``late``: the head
    weight rounded to bf16 before ``d^-1/2`` multiplies it (a wrong order), not after."""
    c = np.float32(128**-0.5)
    w = bf16(weights) * c if late else bf16(np.float32(weights) * c)
    terms = bf16(np.maximum(logits, 0).astype(np.float32) * w.astype(np.float32))
    total = np.float32(0)
    for i in range(0, len(terms), chunk):
        total = total + terms[i : i + chunk].sum(dtype=np.float32)
    return bf16(total)


def _rounding_order_pair(r, c: SelectionSetting, data) -> None:
    """Where the last query of batch row 0 sees more than ``k`` entries: its logits made the
    first ``H`` features of its entries (one-hot queries), ``k - 1`` entries far ahead, then two
    entries ``A`` and ``B`` whose order (a tie going to ``A``, the lower index) the rounding
    order decides: the weight rounded after ``d^-1/2`` multiplies it, as DeepSeek's bf16 einsum
    does, or before. A wrong order then changes that query's ``k``-th pick on every such draw."""
    s, h, k, chunk = c.s, c.heads, c.k, c.head_chunk or c.heads
    index = np.arange(s)[None, :]
    seen = np.flatnonzero(visible_np(index, data["segment"][:1], data["end"][:1],
                                     data["entry_segment"][:1])[0, s - 1])  # fmt: skip
    if len(seen) <= k:
        return
    for _ in range(200):  # a pair one logit apart the rounding order decides (~1 in 7)
        w = r.uniform(0.25, 1.5, h).astype(np.float32)
        w = bf16(w) if c.dtype == "bfloat16" else w
        a = r.integers(100, 200, h).astype(np.float32)
        b = a.copy()
        b[r.integers(h)] += r.choice([-1.0, 1.0])
        # A, at the lower index, wins a tie
        right = _bf16_score(a, w, chunk, False) >= _bf16_score(b, w, chunk, False)
        if right != (_bf16_score(a, w, chunk, True) >= _bf16_score(b, w, chunk, True)):
            break
    else:
        return
    q, keys = data["q"], data["keys"]
    q[0, s - 1] = 0.0
    q[0, s - 1, np.arange(h), np.arange(h)] = 1.0
    keys[0, seen, :h] = 0.0
    keys[0, seen[: k - 1], :h] = 250.0
    keys[0, seen[k - 1], :h], keys[0, seen[k], :h] = a, b
    data["weights"][0, s - 1] = w


def selection_problem(c: SelectionSetting, data):
    dtype = jnp.dtype(c.dtype)
    index = jnp.broadcast_to(jnp.arange(c.s, dtype=jnp.int32), (c.batch, c.s))
    seg = jnp.asarray(data["segment"])
    layout = ce.EntryLayout(jnp.asarray(data["end"]), jnp.asarray(data["entry_segment"]),
                            jnp.asarray(data["end"]) >= 0)  # fmt: skip
    visibility = ce.Visibility(index, seg, layout)
    q, w, keys = (jnp.asarray(data[k], dtype) for k in ("q", "weights", "keys"))
    return ce.SelectionProblem.from_queries(q, w, keys, visibility, c.head_chunk,
                                             score_dtype=c.score_dtype)  # fmt: skip


@eqx.filter_jit
def kernel_picks(c: SelectionSetting, problem):
    return c.kernel.select(problem, c.k)


def check_selection(c: SelectionSetting, data) -> None:
    """One example: the picks bitwise those of the brute-force top-k over the numpy scores
    (float64, or DeepSeek's bf16 einsum modelled by ``scores_np``)."""
    picks = np.asarray(kernel_picks(c, selection_problem(c, data)))
    index = np.broadcast_to(np.arange(c.s), (c.batch, c.s))
    visible = visible_np(index, data["segment"], data["end"], data["entry_segment"])
    scores = scores_np(data["q"], data["weights"], data["keys"], c.score_dtype, c.head_chunk)
    want = brute_topk(scores, visible, c.k)
    np.testing.assert_array_equal(picks, want)
