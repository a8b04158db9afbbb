"""What an adopter reads: the layers' short reprs, ``Execution.describe`` against the automatic
choosers, the README's "what runs where" table against the same choosers, and the stable public
API (``csa_eqx.__all__``) against its documented list."""

import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_eqx as ce
from csa_eqx import _backend
from csa_eqx.presets import tiny_v4, tiny_v32, v4_flash, v32


def abstract(cls, config, **kw):
    """A layer's shapes only (no initialisation computed): reprs and ``describe`` read no
    values."""
    return eqx.filter_eval_shape(cls, config, key=jax.random.key(0), **kw)


def test_layer_reprs_name_the_kind_and_key_sizes():
    """A layer prints in a few lines: its kind, compression rate, top-k, window, heads,
    weight dtype and execution; every array is still one ``eqx.tree_pformat`` away."""
    csa = abstract(ce.V4Attention, tiny_v4("csa"))
    assert repr(csa) == (
        "V4Attention(CSA (compressed sparse attention),\n"
        "  compress_rate=4, index_topk=8, index_n_heads=4, sliding_window=16,\n"
        "  num_heads=4, head_dim=32, hidden_size=64, weights=float32,\n"
        "  execution=Execution())"
    )
    hca = abstract(ce.V4Attention, tiny_v4("hca"), dtype=jnp.bfloat16)
    assert repr(hca).splitlines()[:2] == [
        "V4Attention(HCA (heavily compressed attention),",
        "  compress_rate=8, sliding_window=16, num_heads=4, head_dim=32,",
    ]
    assert "weights=bfloat16" in repr(hca)
    dsa = abstract(ce.V32Attention, tiny_v32())
    assert repr(dsa).startswith("V32Attention(DSA (MLA + lightning indexer over tokens),\n")
    assert "index_topk=8" in repr(dsa) and len(repr(dsa).splitlines()) <= 5
    sharded = ce.Execution(selection=ce.ShardedSelection(ce.StreamingSelection(query_block=8)))
    assert repr(dsa.with_execution(sharded)).endswith(  # the fields that differ, on one line
        "\n  execution=Execution(selection=ShardedSelection("
        "inner=StreamingSelection(query_block=8))))"
    )
    v41 = ce.V41AttentionConfig(
        compress_ratios=(4, 4, 0),
        kv_source_layers=(0,),
        index_source_layers=(0,),
        **{k: v for k, v in vars(tiny_v4()).items() if k != "compress_rate"},
    )
    assert repr(abstract(ce.V41Attention, v41, layer=1)).startswith(
        "V41Attention(V4.1 layer 1 of 3, reuse,\n  compress_rate=4, index_topk=8,"
    )
    assert "q_a_proj=ShapeDtypeStruct(shape=(32, 64)" in eqx.tree_pformat(csa)
    # a config inside a module always shows compress_rate, the default 4 too
    assert "compress_rate=4" in eqx.tree_pformat(csa.config)
    assert "rope_theta" not in eqx.tree_pformat(csa.config)  # other defaults stay hidden


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_describe_resolves_the_automatic_choices(monkeypatch, backend):
    """``Execution().describe`` names the strategies the choosers pick on each backend: the
    Mosaic kernels on a TPU only, the XLA paths on a CPU and a GPU; dense while a score
    tensor fits a tile, streaming beyond; masked picks up to 4 entries per pick, gathered
    beyond; nothing for a layer without an indexer. Asked for the traced backend (here
    faked) it answers as when the backend is named."""
    csa = abstract(ce.V4Attention, tiny_v4("csa"))
    small = ce.Execution().describe(csa, (1, 64, 64), backend=backend)
    kernels = backend == "tpu"
    assert small["selection"] == (ce.MosaicSelection() if kernels else ce.DenseSelection())
    assert small["attention"] == (ce.MosaicAttention() if kernels else ce.XlaAttention())
    assert small["picks"] == ce.MaskedPicks()  # 16 entries, 8 picks
    assert small["indexer_kl"] == ce.DenseIndexerLoss()
    assert small["scorer"] == ce.XlaScorer() and small["placement"] == ce.SingleDevice()
    long = ce.Execution().describe(csa, (1, 1 << 16, 64), backend=backend)
    streaming = ce.StreamingSelection()
    assert long["selection"] == (ce.MosaicSelection() if kernels else streaming)
    assert long["picks"] == ce.GatheredPicks()
    assert long["indexer_kl"] == ce.StreamingIndexerLoss()
    hca = abstract(ce.V4Attention, tiny_v4("hca"))
    none = ce.Execution().describe(hca, (1, 64, 64), backend=backend)
    assert none["selection"] is none["picks"] is none["indexer_kl"] is None
    forced = ce.Execution(selection=ce.StreamingSelection(), attention=ce.XlaAttention())
    assert forced.describe(csa, (1, 64, 64), backend=backend)["selection"] == streaming
    monkeypatch.setattr(_backend.jax, "default_backend", lambda: backend)
    assert ce.Execution().describe(csa, (1, 64, 64)) == small
    assert ce.AutoAttention().choose() == small["attention"]


def test_describe_v32_under_deepseek_numerics():
    """MLA under DeepSeek's numerics runs DeepSeek's expanded attention on every backend; V3.2
    has no sliding window."""
    deepseek = ce.Execution(numerics=ce.DeepSeekInference())
    layer = abstract(ce.V32Attention, v32(), execution=deepseek)  # sizes its numerics take
    for backend in ("cpu", "gpu", "tpu"):
        described = deepseek.describe(layer, (1, 32, 7168), backend=backend)
        assert described["attention"] == ce.ExpandedAttention()
        assert described["window"] is None


# --- the indexer scores behind a selection, and their picture ----------------------------------

QUERIES = [0, 9, 29, 30, 45, 63]  # the first rows, a document's last row, the next's first


@pytest.mark.parametrize("kind", ["csa", "v32"])
def test_indexer_scores_are_the_formula_over_the_visible_entries(kind):
    """``layer.indexer_scores`` for chosen queries of a packed row: the scores formula
    (``scores_np``) over the layer's own indexer queries, weights and keys (read from its
    pipeline), ``-inf`` exactly where the visibility rule (``visible_np``) hides an entry;
    its picks are the forward's selection rows (``aux["selection"]``'s; the selection explorer
    notebook compares them with ``aux["selection"]`` itself) and the brute-force top-k."""
    from conformance import brute_topk, scores_np, visible_np

    config = tiny_v4("csa") if kind == "csa" else tiny_v32()
    layer_cls = ce.V4Attention if kind == "csa" else ce.V32Attention
    layer = layer_cls(config, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 64, config.hidden_size))
    seg = jnp.asarray([[0] * 30 + [1] * 34, [0] * 64], jnp.int32)

    @eqx.filter_jit
    def run(layer, x, seg):
        scores, picks = layer.indexer_scores(x, QUERIES, segment_ids=seg)
        rows = layer._whole_rows(ce.SingleDevice(), x, None, seg)  # the private route
        f = layer.forward_rows(x, rows, "off", False)  # what __call__ runs on one device
        v = f.problem.visibility
        where = (v.query_index, v.query_segment, v.layout.end, v.layout.segment)
        return scores, picks, f.selection, f.problem.queries(), f.problem.keys, where

    scores, picks, selection, (q, w), keys, where = run(layer, x, seg)
    visible = visible_np(*where)[:, QUERIES]
    want = scores_np(q, w, keys)[:, QUERIES]
    scores = np.asarray(scores)
    assert scores.shape == want.shape == (2, len(QUERIES), keys.shape[1])
    np.testing.assert_array_equal(np.isfinite(scores), visible)
    np.testing.assert_allclose(scores[visible], want[visible], rtol=1e-5, atol=1e-6)
    assert not (visible[0, 3] & (where[2][0] < 30)).any()  # row 30 opens document 1
    np.testing.assert_array_equal(picks, np.asarray(selection)[:, QUERIES])
    np.testing.assert_array_equal(picks, brute_topk(scores, visible, config.index_topk))
    with pytest.raises(ValueError, match=r"queries must be .* ints in \[0, 64\) \(got \[64\]\)"):
        layer.indexer_scores(x, [64])
    hca = abstract(ce.V4Attention, tiny_v4("hca"))
    with pytest.raises(ValueError, match="indexer_scores needs a layer with an indexer"):
        hca.indexer_scores(x[..., : hca.config.hidden_size])


def test_plot_picks_outlines_the_picks(monkeypatch):
    """``plot_picks`` draws the scores (the invisible entries masked) and outlines each pick at
    (entry, query row); without matplotlib it raises an ``ImportError`` naming the install."""
    import sys

    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    scores = np.array([[[0.5, -np.inf, -np.inf], [0.1, 0.9, -np.inf]]], np.float32)
    picks = np.array([[[0, -1], [0, 1]]], np.int32)
    ax = ce.plot_picks(scores, picks, queries=[3, 7])
    image = ax.get_images()[0].get_array()
    np.testing.assert_array_equal(image.mask, ~np.isfinite(scores[0]))
    np.testing.assert_array_equal(ax.collections[0].get_offsets(), [[0, 0], [0, 1], [1, 1]])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["3", "7"]
    matplotlib.pyplot.close("all")
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        ce.plot_picks(scores, picks)


# --- the README's table and the stable API page, against the code -----------------------------

ROOT = Path(__file__).resolve().parents[1]


def readme_table() -> dict[str, dict[str, str]]:
    """The README's "What runs where" table: platform -> {column: cell}."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What runs where") :]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


@pytest.mark.parametrize("platform", ["CPU", "GPU", "TPU"])
def test_readme_table_matches_the_choosers(monkeypatch, platform):
    """Each platform's row names exactly the strategies the choosers pick there (the backend
    faked where the choosers ask it) for a V4-Flash CSA layer from 64 tokens to 4M: the
    selection (as the size grows), the attention kernel and the scorer."""
    row = readme_table()[platform]
    monkeypatch.setattr(_backend.jax, "default_backend", lambda: platform.lower())
    layer = abstract(ce.V4Attention, v4_flash("csa"))
    chosen = {"Selection": set(), "Attention": set(), "Scorer": set()}
    for seq in (64, 1 << 16, 1 << 22):
        described = ce.Execution().describe(layer, (1, seq, layer.config.hidden_size))
        for column, key in (("Selection", "selection"), ("Attention", "attention")):
            chosen[column].add(type(described[key]).__name__)
        chosen["Scorer"].add(type(described["scorer"]).__name__)
    for column, names in chosen.items():
        assert set(re.findall(r"`(\w+)`", row[column])) == names, (platform, column)


def test_stable_api_is_the_documented_list():
    """``csa_eqx.__all__`` is exactly the names docs/api/stable.md lists (its list lines:
    backticked names, comma-separated), once each, and every one of them exists."""
    text = (ROOT / "docs" / "api" / "stable.md").read_text()
    lists = [line for line in text.splitlines() if re.fullmatch(r"`\w+`(, `\w+`)*\.", line)]
    listed = [name for line in lists for name in re.findall(r"`(\w+)`", line)]
    assert sorted(listed) == sorted(ce.__all__)
    assert len(set(ce.__all__)) == len(ce.__all__)
    assert all(hasattr(ce, name) for name in ce.__all__)
    for internal in ("candidate_blocks", "BandRows", "Reads", "V4Block", "IndexerHeads"):
        assert internal not in ce.__all__ and hasattr(ce, internal)  # importable, not stable


@pytest.mark.parametrize(
    "old, new", [("Pallas" + k, "Triton" + k) for k in ("Selection", "Attention", "Scorer")]
)
def test_the_old_kernel_names_are_deprecated_aliases(old, new):
    """The Triton kernels' names before they were named by their backend still import, as the
    same classes, with a ``DeprecationWarning`` (CHANGELOG.md); they are not in the stable API."""
    with pytest.warns(DeprecationWarning, match=f"csa_eqx.{old} is deprecated.*csa_eqx.{new}"):
        assert getattr(ce, old) is getattr(ce, new)
    with pytest.warns(DeprecationWarning):
        exec(f"from csa_eqx import {old}", {})
    assert old not in ce.__all__ and old not in dir(ce)


def test_readme_is_short():
    """The README is for the adoption decision: at most ~900 words outside code blocks."""
    text = re.sub(r"```.*?```|<!--.*?-->", "", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(text.split()) <= 900
