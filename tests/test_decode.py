"""Decoding with caches: prefill, chunked prefill and single-token steps equal the full forward;
padding and packed segments; one trace per decode step; parity with HF's cached path."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_v4_behaviour import randomise, tiny

import csa_eqx as ce
from csa_eqx.demo.models import DecoderLM, LMConfig

D = 32
KINDS = ["sliding", "csa", "hca", "dsa"]


def make(kind: str, seed: int = 0):
    if kind in ("dsa", "dsa-dense"):
        cfg = ce.V32AttentionConfig(
            hidden_size=D,
            num_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            index_n_heads=4,
            index_head_dim=16,
            index_topk=5,
        )
        ex = ce.Execution(indexer_loss="dense" if kind == "dsa-dense" else "off")
        return randomise(ce.V32Attention(cfg, key=jax.random.key(seed), execution=ex), seed)
    if kind == "csa-dense":  # the dense warm-up attends to every visible entry
        ex = ce.Execution(indexer_loss="dense")
        return randomise(ce.V4Attention(tiny("csa"), key=jax.random.key(seed), execution=ex), seed)
    return randomise(ce.V4Attention(tiny(kind), key=jax.random.key(seed)), seed)


B, T, MAXLEN = 3, 27, 64  # shared shapes, so the jitted functions compile once per kind
full = eqx.filter_jit(lambda m, x, seg: m(x, segment_ids=seg, return_aux=True))
extend = eqx.filter_jit(
    lambda m, x, c, n, seg: m.extend(x, c, lengths=n, segment_ids=seg, return_aux=True)
)


def run_chunks(layer, x, sizes, cache, seg=None, lengths=None):
    """Feed ``x`` through ``extend`` in chunks of ``sizes``; concatenated outputs/selections
    (``lengths``: real tokens per row of each chunk, default all)."""
    ys, sels, t = [], [], 0
    # numpy slices (a jax array's slice of each new shape would compile a program of its own)
    x = np.asarray(x)
    seg = np.zeros(x.shape[:2], np.int32) if seg is None else np.asarray(seg)
    for i, n in enumerate(sizes):
        rows = np.full((x.shape[0],), n, np.int32) if lengths is None else lengths[i]
        y, cache, aux = extend(layer, x[:, t : t + n], cache, rows, seg[:, t : t + n])
        ys.append(y)
        sels.append(aux["selection"])
        t += n
    sel = None if sels[0] is None else np.concatenate(sels, axis=1)
    return np.concatenate(ys, axis=1), sel, cache


def rel_err(got, want):
    return float(np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(want).max())


def random_chunks(rng, total):
    """Random chunk sizes from {1, 3, 7} (few distinct shapes to compile) summing to ``total``."""
    sizes = []
    while sum(sizes) < total:
        left = total - sum(sizes)
        sizes.append(int(rng.choice([n for n in (1, 3, 7) if n <= left])))
    return sizes


def reference(layer, docs):
    """Each document alone: one full forward with every document at the start of its own row
    (right padding cannot reach earlier tokens); outputs and selections per document."""
    x = np.stack([np.pad(np.asarray(d), ((0, T - d.shape[0]), (0, 0))) for d in docs])
    y, aux = full(layer, x, np.zeros(x.shape[:2], np.int32))
    y, sel = np.asarray(y), None if aux["selection"] is None else np.asarray(aux["selection"])
    return [
        (y[i, : d.shape[0]], None if sel is None else sel[i, : d.shape[0]])
        for i, d in enumerate(docs)
    ]


@pytest.mark.parametrize("kind", KINDS + ["csa-dense", "dsa-dense"])
def test_prefill_steps_and_chunks_equal_full(kind):
    """Full forward == prefill(S) + single steps == random chunks, outputs and selections."""
    rng = np.random.default_rng(len(kind))
    layer = make(kind)
    s = 13  # S, T not multiples of m=4 / 8; cross windows (5) and entries
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    want, aux = full(layer, x, jnp.zeros((B, T), jnp.int32))
    cache = layer.init_cache(B, MAXLEN)
    chunked = [] if kind.endswith("-dense") else [random_chunks(rng, T)]  # same path
    for sizes in [[s] + [1] * (T - s)] + chunked:
        got, sel, _ = run_chunks(layer, x, sizes, cache)
        assert rel_err(got, want) <= 1e-5, sizes
        if kind in ("csa", "csa-dense", "dsa", "dsa-dense"):
            np.testing.assert_array_equal(sel, aux["selection"])
            assert (sel >= 0).any() and (sel == -1).any()


@pytest.mark.parametrize("window", [ce.BandWindow(), ce.GatheredWindow()], ids=["band", "gathered"])
def test_csa_chunks_read_the_window_like_the_forward(window):
    """CSA chunks of several tokens after earlier ones, the window read as a band over
    ``[ring ; chunk]`` in 4-query blocks or gathered: per element the full forward's outputs,
    selections bitwise (the HF comparison for sliding / HCA is in test_decode_hf.py)."""
    layer = make("csa", seed=2).with_execution(ce.Execution(window=window, query_block=4))
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    want, aux = full(layer, x, jnp.zeros((B, T), jnp.int32))
    got, sel, _ = run_chunks(layer, x, [5, 11, 1, 10], layer.init_cache(B, MAXLEN))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(sel, aux["selection"])


@pytest.mark.parametrize("kind", KINDS)
def test_padded_rows_decode_like_each_row_alone(kind):
    """Right-padded prefill of rows with different lengths (one empty), then steps in which a
    row may sit out (length 0): each row equals the row run alone, and garbage in the padding
    changes nothing."""
    layer = make(kind, seed=1)
    lens, s, steps, pause = np.array([13, 6, 0]), 13, 10, 4
    x = jax.random.normal(jax.random.key(2), (B, s + steps, D))
    pad = np.arange(s)[None, :] >= lens[:, None]
    prompt = jnp.concatenate([jnp.where(pad[..., None], 1e3, x[:, :s]), x[:, s:]], axis=1)
    step_lens = [np.array([1, int(i != pause), 1]) for i in range(steps)]
    got, sel, cache = run_chunks(
        layer, prompt, [s] + [1] * steps, layer.init_cache(B, MAXLEN), lengths=[lens] + step_lens
    )
    np.testing.assert_array_equal(cache.length, lens + steps - np.array([0, 1, 0]))
    keep = [np.r_[: lens[r], s : s + steps] for r in range(B)]
    keep[1] = keep[1][keep[1] != s + pause]
    docs = [x[r, keep[r]] for r in range(B)]
    for r, (want, want_sel) in enumerate(reference(layer, docs)):
        assert np.isfinite(got[r, keep[r]]).all()
        assert rel_err(got[r, keep[r]], want) <= 1e-5, r
        if sel is not None:  # padding is never written, so cache slots match the row alone
            np.testing.assert_array_equal(sel[r, keep[r]], want_sel)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_prefill_then_steps_with_segments(kind):
    """Packed prefill, then single-token steps that carry segment ids (continuing the last
    document, and starting new ones): equals the packed full forward, and every document
    equals the document alone (no token sees another segment's keys or entries)."""
    rng = np.random.default_rng(3)
    layer = make(kind, seed=2)
    docs = [[9, 6, 10, 1, 1], [3, 14, 10], [27]]  # prefill ends inside a document
    seg = np.array([np.repeat(np.arange(len(d)), d) for d in docs])
    x = jax.random.normal(jax.random.key(3), (B, T, D))
    want, aux = full(layer, x, jnp.asarray(seg))
    sizes = random_chunks(rng, 13) + [1] * (T - 13)
    got, sel, _ = run_chunks(layer, x, sizes, layer.init_cache(B, MAXLEN), seg=seg)
    assert rel_err(got, want) <= 1e-5
    if kind == "dsa":
        np.testing.assert_array_equal(sel, aux["selection"])
    elif sel is not None:  # cache slots are in closing order, the full forward's in row order
        m = layer.config.compress_rate
        pos = np.asarray(ce.segment_positions(jnp.asarray(seg)))
        closing = np.full((B, MAXLEN // m), -1)
        for r in range(B):
            ends = np.nonzero((pos[r] + 1) % m == 0)[0]
            closing[r, : len(ends)] = ends
        np.testing.assert_array_equal(
            as_ends(sel, closing), as_ends(np.asarray(aux["selection"]), slot_ends(layer, seg))
        )
    ends = [np.cumsum(d) for d in docs]
    pieces = [
        (r, int(e - n), int(e)) for r in range(B) for n, e in zip(docs[r], ends[r], strict=True)
    ]
    alone = reference(layer, [x[r, a:b] for r, a, b in pieces])
    for (r, a, b), (want_doc, _) in zip(pieces, alone, strict=True):
        assert rel_err(got[r, a:b], want_doc) <= 1e-5, (r, a, b)


def slot_ends(layer, seg):
    """Full forward slot -> row index of the closing token (``-1`` = empty)."""
    return np.asarray(ce.entry_layout(jnp.asarray(seg), layer.config.compress_rate).end)


def as_ends(sel, end_of_slot):
    """Selections as the closing row index of each picked entry (slot-layout independent)."""
    picked = np.take_along_axis(end_of_slot[:, None, :], np.maximum(sel, 0), axis=2)
    return np.where(sel >= 0, picked, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_step_traces_once(kind):
    """50 jitted decode steps trace (and compile) once; the cache can be donated."""
    layer = make(kind)
    traces = []

    @eqx.filter_jit(donate="all-except-first")
    def step(layer, x, cache):
        traces.append(1)
        return layer.extend(x, cache)

    cache = layer.init_cache(B, MAXLEN)
    x = jax.random.normal(jax.random.key(4), (B, 50, D))
    for t in range(50):
        y, cache = step(layer, x[:, t : t + 1], cache)
    assert len(traces) == 1
    assert np.isfinite(np.asarray(y)).all()
    np.testing.assert_array_equal(cache.length, [50] * B)


def test_overflow_raises():
    """Writing past max_length is an error whose message names the cache, its max_length and
    the fix (at trace time when the chunk alone is too long or the cache is concrete, at run
    time under jit otherwise: readable under eqx.filter_jit, inside XLA's callback error under
    jax.jit); nothing wraps around."""
    layer = make("csa")
    x = jnp.ones((1, 5, D))
    says = (
        "decode cache overflow",
        "V4Cache's max_length=8",
        "layer.init_cache(batch_size, max_length=...)",
    )
    step = eqx.filter_jit(lambda m, x, c: m.extend(x, c))
    _, cache = step(layer, x, layer.init_cache(1, 8))
    with pytest.raises(eqx.EquinoxRuntimeError) as caught:  # traced: the run-time check
        jax.block_until_ready(step(layer, x, cache))
    line = next(line for line in str(caught.value).splitlines() if says[0] in line)
    assert line.startswith("equinox.EquinoxRuntimeError: decode cache overflow")
    assert all(part in line for part in says), line
    with pytest.raises(Exception) as caught:  # a plain jax.jit: the same text, wrapped
        jax.block_until_ready(jax.jit(lambda m, x, c: m.extend(x, c))(layer, x, cache))
    assert "INTERNAL: CpuCallback error" in str(caught.value)
    assert all(part in str(caught.value) for part in says)
    with pytest.raises(ValueError) as caught:  # a concrete cache: now, with the rows' lengths
        layer.extend(x, cache)
    assert all(part in str(caught.value) for part in says)
    assert str(caught.value).endswith("(got row lengths [10])")
    with pytest.raises(ValueError, match="a chunk of 9 tokens is longer than the V4Cache's"):
        layer.extend(jnp.ones((1, 9, D)), layer.init_cache(1, 8))
    assert np.asarray(cache.length).tolist() == [5]


def test_generate_matches_full_forward_argmax():
    """Greedy generation from padded prompts == argmax of the full forward, row by row;
    temperature sampling is reproducible from its key."""
    cfg = LMConfig(vocab_size=50, layers=("csa",), attention=tiny("csa", hidden_size=D))
    model = randomise(DecoderLM(cfg, key=jax.random.key(0)), 5)
    prompt = jax.random.randint(jax.random.key(6), (2, 7), 0, 50)
    lens, new = np.array([7, 4]), 6
    out, caches = ce.generate(model, prompt, new, prompt_lengths=jnp.asarray(lens), max_length=16)
    assert out.shape == (2, new)
    np.testing.assert_array_equal(caches[0].length, lens + new - 1)
    forward = eqx.filter_jit(lambda m, t: m(t))
    seq = np.zeros((2, 16), np.int32)
    for r in range(2):
        seq[r, : lens[r]] = prompt[r, : lens[r]]
    for i in range(new):
        logits = np.asarray(forward(model, jnp.asarray(seq)))
        for r in range(2):
            seq[r, lens[r] + i] = np.argmax(logits[r, lens[r] + i - 1])
    for r in range(2):
        np.testing.assert_array_equal(out[r], seq[r, lens[r] : lens[r] + new])
    plain, _ = ce.generate(  # any logits_fn(tokens, caches[, lengths]) with explicit caches
        model.extend, prompt, new, caches=model.init_caches(2, 16), prompt_lengths=lens
    )
    np.testing.assert_array_equal(plain, out)
    kw = dict(max_length=16, temperature=1.0, key=jax.random.key(0))
    sampled, _ = ce.generate(model, prompt, new, **kw)
    np.testing.assert_array_equal(sampled, ce.generate(model, prompt, new, **kw)[0])
    assert ((sampled >= 0) & (sampled < 50)).all()


@pytest.mark.torch
def test_matches_hf_cached_path():
    """A V4 CSA layer: prefill then single steps through HF's DynamicCache (DeepseekV4CSACache)
    == our prefill + extend steps, outputs and selections (on rows whose top-k is untied)."""
    import torch
    from transformers import DynamicCache
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from csa_eqx.hf import load_v4_attention
    from csa_eqx.presets import tiny_v4
    from csa_eqx.testing import hf_v4_config, random_hf_v4_layer, state_dict_numpy

    cfg = hf_v4_config(tiny_v4("csa", sliding_window=6, index_topk=2))
    hf = random_hf_v4_layer(cfg, seed=7)
    layer = load_v4_attention(state_dict_numpy(hf), cfg, 0)
    b, s, steps, m, k = 2, 13, 7, 4, 2
    x = np.random.default_rng(7).normal(size=(b, s + steps, cfg.hidden_size)).astype(np.float32)
    rope, hf_cache, captured = DeepseekV4RotaryEmbedding(cfg), DynamicCache(config=cfg), {}
    hooks = [
        hf.compressor.indexer.register_forward_hook(lambda _m, _i, o: captured.update(top=o)),
        hf.compressor.indexer.scorer.register_forward_hook(
            lambda _m, _i, o: captured.update(scores=o)
        ),
    ]
    cache = layer.init_cache(b, 32)
    step = eqx.filter_jit(lambda m, x, c: m.extend(x, c, return_aux=True))
    checked = 0
    for start, n in [(0, s)] + [(s + i, 1) for i in range(steps)]:
        xt = torch.tensor(x[:, start : start + n])
        pos = torch.arange(start, start + n)[None].expand(b, -1)
        emb = {kind: rope(xt, pos, layer_type=kind) for kind in ("main", "compress")}
        i, j = torch.arange(start, start + n)[:, None], torch.arange(max(start - 5, 0), start + n)
        allowed = (j[None] <= i) & (i - j[None] < cfg.sliding_window)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        with torch.no_grad():
            want, _ = hf(
                xt,
                position_embeddings=emb,
                position_ids=pos,
                attention_mask=mask[None, None].expand(b, 1, -1, -1),
                cache=hf_cache,
            )
        got, cache, aux = step(layer, x[:, start : start + n], cache)
        want, top, scores = want.numpy(), captured["top"].numpy(), captured["scores"].numpy()
        sel = np.asarray(aux["selection"])
        for bi in range(b):
            for qi in range(n):
                visible = np.arange(scores.shape[-1]) < (start + qi + 1) // m
                srt = -np.sort(-scores[bi, qi][visible])
                if len(srt) > k and srt[k - 1] == srt[k]:
                    continue  # torch leaves the order of tied picks unspecified
                hf_set = set(top[bi, qi][top[bi, qi] >= 0]) & set(np.nonzero(visible)[0])
                assert set(sel[bi, qi][sel[bi, qi] >= 0]) == hf_set
                np.testing.assert_allclose(
                    got[bi, qi], want[bi, qi], rtol=1e-4, atol=1e-4 * np.abs(want).max()
                )
                checked += 1
    for h in hooks:
        h.remove()
    assert checked >= 0.7 * b * (s + steps), checked


def test_v41_decoder_lm_decodes_as_it_runs():
    """The demo LM hosts a V4.1 stack (a KV source, a sliding layer, a reindex layer) through
    the one layer protocol: its chunked prefill and decode steps (``DecoderLM.extend``, the
    published state threaded) give the full forward's logits."""
    cfg = LMConfig(
        vocab_size=50,
        layers=("full", "sliding", "reindex"),
        family="v41",
        attention=tiny("csa", hidden_size=D),
    )
    assert [cfg.v41_config().role(i) for i in range(3)] == ["full", "sliding", "reindex"]
    model = randomise(DecoderLM(cfg, key=jax.random.key(0)), 2)
    tokens = jax.random.randint(jax.random.key(3), (2, 14), 0, 50)
    want = np.asarray(eqx.filter_jit(lambda m, t: m(t))(model, tokens))
    step = eqx.filter_jit(lambda m, t, c: m.extend(t, c))
    caches, got = model.init_caches(2, 16), []
    for s0, s1 in [(0, 6), (6, 7), (7, 14)]:
        logits, caches = step(model, tokens[:, s0:s1], caches)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, 1), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sliding/full/reindex/reuse for the v41 family"):
        LMConfig(vocab_size=50, layers=("csa",), family="v41")
