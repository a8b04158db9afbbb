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

**The convention** (``convention``, stated beside every MFU figure): model FLOPs of the form
the layer executes. V3.2 DSA counts MLA **absorbed**: every head's query mapped into the
``kv_lora_rank + qk_rope_head_dim`` (512 + 64) latent, one latent key row and one 512-wide
latent value row shared by all heads (MQA-style), over each query's ``min(k, i + 1)`` picked
rows; ``kv_b_proj`` counted once per token as the absorption's and the values' projections.
Not plain MLA's per-head ``qk_nope + qk_rope`` keys over every causal pair (Megatron-LM #6753:
such a count overstates DSA by 1.74x at 32k). V4 counts its ``head_dim`` keys / values (shared
by the heads) over the picks and the window.

**Hardware FLOPs** (``hardware_costs``, beside the model FLOPs where the attention is the Mosaic
kernel): what the chip's matmul units are given. The projections and the scoring as counted
above (their backward's two matmuls per matmul that gets gradients), and the attention
kernels' dense work from their configurations (``mosaic_layout.Config``, the forward's and the
backward's: a rows source whose gradients go to HBM is read as tiles backward): heads padded to the
kernel's (16 for bfloat16), key and value widths padded to 128 lanes (``key_blocks``,
``value_blocks``: V3.2's 576-wide keys as 640); per read set, forward
``2 R (K + V)`` and backward ``2 R (3 K + 2 V)`` (logits again, ``dO V``, ``dq``, ``dk``,
``dv``) over its softmax-row x key-row pairs ``R``: a rows source's picks in chunks
(``ceil(min(k, visible) / chunk) * chunk`` per query and head), a tiles / dense source's every
tile up to the query block's causal frontier (``ceil(visible / tile) * tile`` rows per query of
the block: an upper bound, which picks spread over the whole prefix, as random weights' are,
reach; the kernel skips tiles no query of the block picks), a band's slab (``window - 1`` rows
before the block's ``Qb``, rounded to the block). Recomputation: V4's queries (``q_b_proj``
again in the backward) and the forward of the V3.2 head groups that keep no output
(``v32.kept_parts``; all of them with a kernel that cannot ``replay``) once more.

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
from csa_eqx._attention.mosaic_layout import Config, DenseRead, RowsRead, TilesRead
from csa_eqx._mosaic import LANES

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
        convention=convention(c),
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


def convention(config) -> str:
    """**Returns:** the FLOP convention of ``config``'s layer in words (module docstring)."""
    if isinstance(config, V4AttentionConfig):
        return (
            f"V4 CSA: {config.num_heads} heads x {config.head_dim} keys and values shared by "
            f"the heads, over min(k = {config.index_topk}, visible) picked entries and "
            f"min({config.sliding_window}, i + 1) window rows; 2 FLOP per multiply-add; "
            "fwd+bwd = 3 x (projections + attention) + indexer once"
        )
    return (
        f"V3.2 DSA, MLA absorbed: {config.num_heads} heads' queries in the "
        f"{config.kv_lora_rank} + {config.qk_rope_head_dim} latent, MQA-style over "
        f"min(k = {config.index_topk}, i + 1) picked latent rows ({config.kv_lora_rank}-wide "
        "values); kv_b_proj once per token; 2 FLOP per multiply-add; fwd+bwd = 3 x "
        "(projections + attention) + indexer once (not plain MLA's count: Megatron-LM #6753)"
    )


def kernel_pairs(config: Config, visible: np.ndarray) -> float:
    """**Arguments:** a Mosaic attention call's ``config`` (one call: a V3.2 head group's) and
    each query's visible entries ``visible [S]`` (``reads_per_query``).

    **Returns:** the softmax-row x key-row pairs its kernels compute (module docstring,
    "Hardware FLOPs"): summed over its read sets, heads padded."""
    s, qb = len(visible), config.query_block
    ends = visible[np.minimum(np.arange(qb - 1, config.seq, qb), s - 1)]  # per query block
    pairs = 0.0
    for src in config.sources:
        rows = config.tables[src.table].rows
        if isinstance(src, RowsRead):
            read = np.minimum(src.width, visible)
            per_query = float((-(-read // config.chunk) * config.chunk).sum())
        elif isinstance(src, TilesRead | DenseRead):
            tiles = -(-np.minimum(ends, rows) // config.tile)
            per_query = float(tiles.sum()) * config.tile * qb
        else:  # band: one slab per query block
            per_query = float(config.n_q * qb * config.slab(src))
        pairs += per_query * config.heads * config.batch
    return pairs


def hardware_costs(
    layer, seq: int, costs: dict, configs: tuple[Config, Config], calls: int, recomputed: int
):
    """**Arguments:** the layer, ``seq``, its ``layer_costs``, its Mosaic attention's forward
    and backward ``configs`` (``kernel_pairs``; a rows source's backward may read tiles), the
    attention ``calls`` per forward (V3.2's head groups) and
    how many of them the backward runs again (``recomputed``: V3.2's head groups that keep no
    output, ``csa_eqx._layers.v32.kept_parts``).

    **Returns:** ``hardware_fwd`` and ``hardware_fwd_bwd`` FLOPs, the kernels' own
    (``hardware_attention_fwd``, ``hardware_attention_bwd``) and the recomputed
    (``hardware_recompute``) (module docstring, "Hardware FLOPs")."""
    c = layer.config
    config, backward = configs
    kp, vp = config.key_blocks * LANES, config.value_blocks * LANES
    visible = reads_per_query(c, seq)[0]
    fwd = 2 * kernel_pairs(config, visible) * (kp + vp)
    bwd = 2 * kernel_pairs(backward, visible) * (3 * kp + 2 * vp)
    again = recomputed * fwd
    fwd, bwd = calls * fwd, calls * bwd
    if isinstance(c, V4AttentionConfig):  # the queries recomputed: q_b_proj once more
        again += 2.0 * seq * int(np.prod(layer.block.q_b_proj.shape))
    rest = costs["projections"] + costs["indexer_projections"] + costs["scoring"]
    rest_bwd = 2 * costs["projections"]
    return dict(
        hardware_fwd=rest + fwd,
        hardware_fwd_bwd=rest + rest_bwd + fwd + bwd + again,
        hardware_attention_fwd=fwd,
        hardware_attention_bwd=bwd,
        hardware_recompute=again,
    )
