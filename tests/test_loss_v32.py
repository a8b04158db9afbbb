"""V3.2 indexer KL distillation (docs/concepts.md, "Training the indexer"): aux["indexer_loss"]
of V32Attention against a float64
numpy reference and HF's attention probabilities, gradient routing, head chunking, no NaN."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_loss import assert_trains_only, grads_by_leaf, kl_from_target_np, output_loss_of

from csa_eqx import DenseKeys, entry_layout, segment_positions, sparse_attention
from csa_eqx.hf import load_v32_attention
from csa_eqx.presets import tiny_v32
from csa_eqx.testing import hf_v32_config, random_hf_v32_layer, run_hf_v32, state_dict_numpy

INDEXER_LEAVES = {f".indexer.{n}" for n in ("wq_b", "wk", "k_norm", "k_norm_bias", "weights_proj")}


def visible_np(seg: np.ndarray) -> np.ndarray:
    """[B,S,S]: token j is visible to query t iff j <= t in t's segment."""
    s = seg.shape[1]
    causal = np.arange(s)[None, :] <= np.arange(s)[:, None]
    return causal[None] & (seg[:, None, :] == seg[:, :, None])


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta, interleaved):
    """Rotate all channels of ``x`` at ``pos`` (interleaved pairs or half-split). Pairs are
    written out as [firsts; seconds]; queries and keys get the same layout, so dot products are
    those of the rotation in place."""
    r = x.shape[-1]
    angle = pos[..., None] * theta ** (-np.arange(0, r, 2) / r)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : r // 2], x[..., r // 2 :])
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def reference_np(layer, x, seg, attended):
    """Float64 from the definitions (MLA with per-head expanded keys/values, no absorption):
    per-head attention probabilities P [B,H,S,S] over ``attended``, the layer output, and the
    indexer scores I [B,S,S] (unmasked)."""
    c, ix = layer.config, layer.indexer
    w = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x = x.astype(np.float64)
    b, s, _ = x.shape
    h, dn, dr, dv, kvr = (
        c.num_heads,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
        c.kv_lora_rank,
    )
    pos = np.asarray(segment_positions(jnp.asarray(seg)), np.float64)
    qr = _rms(x @ w(layer.q_a_proj).T, w(layer.q_a_layernorm), c.rms_norm_eps)
    q = (qr @ w(layer.q_b_proj).T).reshape(b, s, h, dn + dr)
    q_rope = _rope(q[..., dn:], pos[..., None], c.rope_theta, True)
    latent = x @ w(layer.kv_a_proj_with_mqa).T
    c_kv = _rms(latent[..., :kvr], w(layer.kv_a_layernorm), c.rms_norm_eps)
    k_rope = _rope(latent[..., kvr:], pos, c.rope_theta, True)
    kv = (c_kv @ w(layer.kv_b_proj).T).reshape(b, s, h, dn + dv)
    logits = np.einsum("bthd,bjhd->bhtj", q[..., :dn], kv[..., :dn])
    logits = (logits + np.einsum("bthd,bjd->bhtj", q_rope, k_rope)) * (dn + dr) ** -0.5
    logits = np.where(attended[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bhtj,bjhv->bthv", probs, kv[..., dn:]).reshape(b, s, h * dv)
    y = o @ w(layer.o_proj).T

    hi, di = c.index_n_heads, c.index_head_dim
    qi = (qr @ w(ix.wq_b).T).reshape(b, s, hi, di)
    qi = np.concatenate(
        [_rope(qi[..., :dr], pos[..., None], c.rope_theta, False), qi[..., dr:]], -1
    )
    ki = x @ w(ix.wk).T
    ki = ki - ki.mean(-1, keepdims=True)
    ki = ki / np.sqrt((ki * ki).mean(-1, keepdims=True) + 1e-6) * w(ix.k_norm) + w(ix.k_norm_bias)
    ki = np.concatenate([_rope(ki[..., :dr], pos, c.rope_theta, False), ki[..., dr:]], -1)
    head_w = x @ w(ix.weights_proj).T * hi**-0.5
    relu = np.maximum(np.einsum("bthd,bjd->bthj", qi, ki) * di**-0.5, 0)
    return probs, y, np.einsum("bth,bthj->btj", head_w, relu)


def selected_np(sel: np.ndarray, s: int) -> np.ndarray:
    cand = np.zeros(sel.shape[:2] + (s,), bool)
    for bi, si, j in zip(*np.nonzero(sel >= 0), strict=True):
        cand[bi, si, sel[bi, si, j]] = True
    return cand


def _layer(stage, topk=4, seed=3, **options):
    cfg = hf_v32_config(tiny_v32(index_topk=topk))
    hf_layer = random_hf_v32_layer(cfg, seed=seed)
    layer = load_v32_attention(state_dict_numpy(hf_layer), cfg, 0, indexer_loss=stage, **options)
    return cfg, hf_layer, layer


def _run(layer, x, seg=None):
    return jax.jit(lambda m, x, s: m(x, segment_ids=s, return_aux=True))(layer, x, seg)


@pytest.mark.parametrize("split", [None, "queries"])
@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_loss_and_output_match_numpy(stage, split, monkeypatch):
    """Packed rows: loss == mean_t KL(Σ_h P_h / mass ‖ softmax I) from float64 definitions;
    the dense stage is plain causal MLA, the sparse one attends to the selected tokens. With
    ``split``, the attention in 3 query chunks (forced; ``csa_eqx._layers.v32.SPLIT``): each
    chunk's rows, picks and ``lse`` (which the loss reads) joined back in order."""
    b, s, k = 2, 13 if split is None else 12, 4
    if split:
        from csa_eqx._layers import v32

        monkeypatch.setattr(v32, "SPLIT", split)
        monkeypatch.setattr(v32, "query_chunks", lambda *a: 3)
    _, _, layer = _layer(stage, topk=k)
    x = np.random.default_rng(0).normal(size=(b, s, 64)).astype(np.float32)
    seg = np.stack([np.zeros(s), np.repeat([0, 1], [5, s - 5])]).astype(np.int32)
    y, aux = _run(layer, x, seg)
    vis = visible_np(seg)
    sel = np.asarray(aux["selection"])
    if stage == "dense":
        cand = vis
    else:
        cand = selected_np(sel, s)
        assert (cand <= vis).all() and (cand.sum(-1) == np.minimum(vis.sum(-1), k)).all()
    probs, want_y, scores = reference_np(layer, x, seg, cand)
    if stage == "sparse":  # the selection is the numpy top-k (no ties with random weights)
        best = np.argsort(-np.where(vis, scores, -np.inf), axis=-1, kind="stable")[..., :k]
        np.testing.assert_array_equal(
            cand, selected_np(np.where(np.take_along_axis(vis, best, -1), best, -1), s)
        )
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=0, atol=1e-5 * np.abs(want_y).max())
    want = kl_from_target_np(probs.sum(1), scores, cand)
    assert want > 1e-3  # a random indexer is far from the target
    np.testing.assert_allclose(float(aux["indexer_loss"]), want, rtol=1e-5)


def hf_forward_with_probs(hf_layer, cfg, x):
    """HF output, indexer scores [B,S,S] and per-head attention probabilities [B,H,S,S]."""
    got = {}
    handle = hf_layer.register_forward_hook(lambda _m, _i, out: got.update(w=out[1].numpy()))
    try:
        out, _, scores = run_hf_v32(hf_layer, cfg, x)
    finally:
        handle.remove()
    return out, scores, got["w"].astype(np.float64)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_loss_matches_hf_probabilities(stage):
    """aux["indexer_loss"] == numpy KL of HF's attention probabilities vs HF's indexer scores.

    The dense stage equals an HF layer whose top-k covers every token (it then attends to all
    earlier tokens), so the layer output must match that one too.
    """
    b, s, k = 2, 12, 4
    cfg, hf_layer, layer = _layer(stage, topk=k, seed=5)
    x = np.random.default_rng(5).normal(size=(b, s, cfg.hidden_size)).astype(np.float32)
    y, aux = jax.jit(lambda m, x: m(x, return_aux=True))(layer, x)
    vis = visible_np(np.zeros((b, s), np.int32))
    if stage == "dense":
        hf_layer.indexer.index_topk = 64  # HF then selects every token (future ones masked)
        want_y, scores, probs = hf_forward_with_probs(hf_layer, cfg, x)
        np.testing.assert_allclose(np.asarray(y), want_y, rtol=0, atol=1e-4 * np.abs(want_y).max())
        cand = vis
    else:
        _, scores, probs = hf_forward_with_probs(hf_layer, cfg, x)
        cand = selected_np(np.asarray(aux["selection"]), s)
        assert (cand.sum(-1) == np.minimum(vis.sum(-1), k)).all()
    mass = probs.sum(axis=1)
    assert (mass[~cand] == 0).all() and (mass[cand] > 0).all()  # HF attends to our candidates
    want = kl_from_target_np(mass, scores, cand)
    np.testing.assert_allclose(float(aux["indexer_loss"]), want, rtol=1e-4)


def _inputs(s=12, seed=2):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(2, s, 64)), jnp.float32)


def indexer_loss_of(layer, x, seg=None):
    return layer(x, segment_ids=seg, return_aux=True)[1]["indexer_loss"]


_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(indexer_loss_of))


def loss_and_grads(layer, x, seg=None) -> tuple[float, dict[str, np.ndarray]]:
    """The indexer loss and its gradient per inexact leaf (one compiled call, cached)."""
    loss, g = _value_and_grad(layer, x, seg)
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(g, eqx.is_inexact_array))[0]
    return float(loss), {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_loss_trains_only_the_indexer(stage):
    assert_trains_only(loss_and_grads(_layer(stage)[2], _inputs())[1], INDEXER_LEAVES)


@pytest.mark.parametrize("stage", ["off", "dense", "sparse"])
def test_output_gives_the_indexer_no_gradient(stage):
    grads = grads_by_leaf(output_loss_of, _layer(stage)[2], _inputs())
    for name in INDEXER_LEAVES:
        assert (grads[name] == 0).all(), f"{name} gets gradient from the layer output"
    assert np.abs(grads[".q_a_proj"]).max() > 0 and np.abs(grads[".kv_b_proj"]).max() > 0


def test_loss_absent_when_off():
    layer, x = _layer("off")[2], _inputs()
    assert jax.eval_shape(indexer_loss_of, layer, x) is None
    jaxpr = str(jax.make_jaxpr(lambda m, x: m(x, return_aux=True)[0])(layer, x))
    assert jaxpr == str(jax.make_jaxpr(lambda m, x: m(x))(layer, x))  # nothing extra computed


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_head_chunking_is_exact(stage):
    """qk_head_chunk_size 1, 2, H: same loss and indexer gradients as unchunked."""
    x = _inputs()
    want, want_g = loss_and_grads(_layer(stage)[2], x)
    for chunk in (1, 2, 4):
        loss, grads = loss_and_grads(_layer(stage, qk_head_chunk_size=chunk)[2], x)
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        for name, g in grads.items():
            np.testing.assert_allclose(g, want_g[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_first_tokens_no_nan(stage):
    """Rows of singleton segments (every token is a first token): one candidate each, so the
    loss is exactly 0 and its gradients 0; a short row: finite, positive loss and gradients."""
    layer = _layer(stage)[2]
    singletons = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    for x, seg, zero in [(_inputs(4), singletons, True), (_inputs(3), None, False)]:
        loss, grads = loss_and_grads(layer, x, seg)
        assert loss == 0.0 if zero else np.isfinite(loss) and loss > 0
        for name, g in grads.items():
            assert np.isfinite(g).all() and (not zero or (g == 0).all()), name


@pytest.mark.parametrize("query_block", [0, 3])
def test_dense_keys_with_separate_values(query_block):
    """DenseKeys(values=...): causal softmax over the keys, averaging the values (MLA), equal to
    numpy, with the log-normaliser; unblocked and in query blocks."""
    rng = np.random.default_rng(7)
    b, s, h, d, dv = 2, 7, 3, 6, 4
    q, kv = rng.normal(size=(b, s, h, d)), rng.normal(size=(b, s, d))
    vals = rng.normal(size=(b, s, dv))
    seg = np.stack([np.zeros(s), np.repeat([0, 1], [3, 4])]).astype(np.int32)
    qi = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    dense = DenseKeys(f32(kv), entry_layout(jnp.asarray(seg), 1), qi, jnp.asarray(seg), f32(vals))
    out, lse = sparse_attention(
        f32(q),
        f32(kv),
        jnp.zeros((b, s, 0), jnp.int32),
        None,
        0.5,
        values=f32(vals),
        return_lse=True,
        query_block=query_block,
        dense=dense,
    )
    logits = np.where(
        visible_np(seg)[:, :, None], np.einsum("bshd,btd->bsht", q, kv) * 0.5, -np.inf
    )
    want_lse = np.log(np.exp(logits).sum(-1))
    want = np.einsum("bsht,btv->bshv", np.exp(logits - want_lse[..., None]), vals)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5)


def _topk_widths(jaxpr) -> set[int]:
    """Last-axis sizes of every exact_topk operand, nested jaxprs (shard_map, loops) included."""
    widths = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "bitcast_convert_type":  # one per exact top-k
            widths.add(eqn.invars[0].aval.shape[-1])
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    widths |= _topk_widths(inner)
    return widths


def test_sharded_selection_uses_the_key_and_query_blocks():
    """indexer_sharded_topk passes key_block / query_block on (streaming over tiles of 3 keys:
    one row buffer of 15 = the 14 tokens padded to whole tiles; it holds every entry, so no
    k + k merge follows; unblocked it would be one exact top-k over the 14 tokens) and stays
    exact."""
    x = _inputs(14, seed=4)
    selection = lambda m, x: m(x, return_aux=True)[1]["selection"]  # noqa: E731
    ref = jax.jit(selection)(_layer("off")[2], x)
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "tensor"))):
        layer = _layer("off", indexer_sharded_topk=True, indexer_key_block=3, query_block=5)[2]
        jaxpr = jax.make_jaxpr(selection)(layer, x)
        assert "shard_map" in str(jaxpr) and _topk_widths(jaxpr.jaxpr) == {15}
        np.testing.assert_array_equal(np.asarray(jax.jit(selection)(layer, x)), np.asarray(ref))
