"""Model FLOPs and the attention's bytes of one attention layer (B = 1, causal, one document):
the counts behind the model-FLOP utilisation and the bytes per second of the accelerator table
(``benchmarks/accelerator_table.py``), written once so that its page can state them.

Forward FLOPs, counting multiply-adds as 2:

- **projections**: ``2 S`` times the elements of every weight matrix of the layer (each is
  applied once per token: V4's query, key/value, grouped output and compressor projections, V3.2's
  MLA projections with ``kv_b_proj`` absorbed into the queries and the values, the indexer's);
  not the compressors' position biases, norms, RoPE or softmaxes;
- **indexer scoring**: ``(2 H_I d_I + 2 H_I)`` per visible (query, entry) pair (the ``q . k`` of
  each indexer head and its weighting), over the pairs a causal query can see: entry ``j`` of
  a V4 CSA layer (``m`` tokens each) once its window has closed, ``floor((i + 1) / m)`` of them
  for query ``i``; V3.2's token keys ``i + 1``;
- **attention**: ``2 H (d_qk + d_v)`` per row each query reads: its picks ``min(k, visible)``
  and (V4) its window ``min(w, i + 1)``; V4: ``d_qk = d_v = head_dim``; V3.2 in its absorbed
  form: ``d_qk = kv_lora_rank + qk_rope_head_dim``, ``d_v = kv_lora_rank``.

Forward and backward: 3x the forward's matmuls that get gradients (the attention's projections
and the attention; the backward's two matmuls per forward matmul) and 1x the indexer's
projections and scoring (the selection gets no gradient: they run once). Recomputation is not
counted (model FLOPs, not hardware FLOPs).

The attention's bytes (``attention_bytes``): each query's read rows (its picks and window, one
row of keys, which are the values or hold them), its queries read and its output written,
in the activations' dtype, once per query: what a kernel that fetches every query's rows
itself moves; one that fetches a row once for a block of queries moves less, so a rate above
the memory's bandwidth says it shares. Forward and backward: 3x the forward's.
"""

from __future__ import annotations

import jax
import numpy as np

from csa_eqx import V4AttentionConfig

# parameter-path fragments: the indexer's weights (no gradient through the selection), and
# 2-D parameters that are added, not multiplied (the compressors' position biases)
INDEXER_PARTS = ("indexer", "index_compressor")
NOT_MATRICES = ("bias",)


def weight_elements(layer) -> tuple[int, int]:
    """**Arguments:** an attention layer (arrays or ``jax.ShapeDtypeStruct`` leaves).

    **Returns:** ``(attention, indexer)``: the elements of its weight matrices (2-D parameters
    that are not position biases), the indexer's apart."""
    attention = indexer = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(layer)[0]:
        name = jax.tree_util.keystr(path)
        if len(leaf.shape) != 2 or any(part in name for part in NOT_MATRICES):
            continue
        if any(part in name for part in INDEXER_PARTS):
            indexer += int(np.prod(leaf.shape))
        else:
            attention += int(np.prod(leaf.shape))
    return attention, indexer


def reads_per_query(config, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """**Arguments:** a layer ``config`` (V4 CSA or V3.2) and the sequence length ``seq``.

    **Returns:** per query ``i`` (int64 ``[seq]`` each): the entries it can see (V4 CSA:
    ``floor((i + 1) / m)``, V3.2: ``i + 1``), the picks it reads ``min(k, visible)`` and its
    window rows (V4: ``min(w, i + 1)``, V3.2: 0)."""
    tokens = np.arange(1, seq + 1, dtype=np.int64)
    if isinstance(config, V4AttentionConfig):
        visible = tokens // config.compress_rate
        window = np.minimum(config.sliding_window, tokens)
    else:
        visible, window = tokens, np.zeros_like(tokens)
    return visible, np.minimum(config.index_topk, visible), window


def layer_costs(layer, seq: int, itemsize: int) -> dict[str, float]:
    """The module docstring's counts for ``layer`` (arrays or shapes) at ``seq`` tokens whose
    activations take ``itemsize`` bytes per element.

    **Returns:** ``fwd`` and ``fwd_bwd`` model FLOPs, the forward's parts (``projections``,
    ``indexer_projections``, ``scoring``, ``attention``), the attention's FLOPs and bytes of
    its own forward and backward (``attention_fwd_bwd``, ``attention_bytes_fwd``,
    ``attention_bytes_fwd_bwd``)."""
    c = layer.config
    attention_weights, indexer_weights = weight_elements(layer)
    visible, picks, window = reads_per_query(c, seq)
    scoring = float(visible.sum()) * (2 * c.index_n_heads * c.index_head_dim + 2 * c.index_n_heads)
    if isinstance(c, V4AttentionConfig):
        d_qk = d_v = row = c.head_dim
    else:
        d_qk, d_v = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
        row = d_qk
    rows = float((picks + window).sum())
    attention = rows * 2 * c.num_heads * (d_qk + d_v)
    projections = 2.0 * seq * attention_weights
    indexer_projections = 2.0 * seq * indexer_weights
    moved = itemsize * (rows * row + seq * c.num_heads * (d_qk + d_v))
    return dict(
        fwd=projections + indexer_projections + scoring + attention,
        fwd_bwd=3 * (projections + attention) + indexer_projections + scoring,
        projections=projections,
        indexer_projections=indexer_projections,
        scoring=scoring,
        attention=attention,
        attention_fwd_bwd=3 * attention,
        attention_bytes_fwd=moved,
        attention_bytes_fwd_bwd=3 * moved,
    )
