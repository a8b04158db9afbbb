"""Builders for tiny Hugging Face reference layers with random weights."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
)

LAYER_TYPES = {
    "sliding": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}


def tiny_v4_config(kind: str, *, window=6, topk=3, hca_rate=8, yarn=False, **over):
    fields = dict(
        vocab_size=64,
        hidden_size=48,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=24,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=window,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=topk,
        num_hidden_layers=1,
        layer_types=[LAYER_TYPES[kind]],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_rate},
        partial_rotary_factor=8 / 32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_layer_types=["moe"],
    )
    if yarn:
        fields["rope_parameters"] = {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    fields.update(over)
    cfg = DeepseekV4Config(**fields)
    cfg._attn_implementation = "eager"
    return cfg


def random_v4_layer(cfg, seed: int = 0) -> DeepseekV4Attention:
    torch.manual_seed(seed)
    layer = DeepseekV4Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("position_bias") or name == "sinks":
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    return layer


def run_v4_layer(layer: DeepseekV4Attention, cfg, x: np.ndarray):
    """HF forward without cache; returns (output, top-k indices or None)."""
    b, s, _ = x.shape
    xt = torch.tensor(x, dtype=torch.float32)
    pos = torch.arange(s)[None].expand(b, -1)
    rope = DeepseekV4RotaryEmbedding(cfg)
    emb = {k: rope(xt, pos, layer_type=k) for k in ("main", "compress")}
    i = torch.arange(s)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < cfg.sliding_window)
    mask = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))[None, None].expand(b, 1, s, s)
    captured = {}
    if layer.compressor is not None and hasattr(layer.compressor, "indexer"):

        def hook(_mod, _inp, out):
            captured["topk"] = out.numpy()

        handle = layer.compressor.indexer.register_forward_hook(hook)
    else:
        handle = None
    with torch.no_grad():
        out, _ = layer(xt, position_embeddings=emb, position_ids=pos, attention_mask=mask)
    if handle is not None:
        handle.remove()
    return out.numpy(), captured.get("topk")


def hf_indexer_scores(layer: DeepseekV4Attention, cfg, x: np.ndarray) -> np.ndarray:
    """The HF indexer's raw scores [B,S,T] (to find rows whose top-k boundary is untied)."""
    captured = {}

    def hook(_mod, _inp, out):
        captured["scores"] = out.numpy()

    handle = layer.compressor.indexer.scorer.register_forward_hook(hook)
    run_v4_layer(layer, cfg, x)
    handle.remove()
    return captured["scores"]


def state_dict_numpy(layer) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in layer.state_dict().items()}
