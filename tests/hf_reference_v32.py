"""Builders for tiny Hugging Face DeepSeek-V3.2 attention layers with random weights."""

from __future__ import annotations

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Attention,
    DeepseekV32RotaryEmbedding,
)


def tiny_v32_config(*, topk=5, yarn=False, **over):
    fields = dict(
        vocab_size=64,
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=20,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=topk,
        num_hidden_layers=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=16,
        intermediate_size=32,
        max_position_embeddings=1024,
    )
    if yarn:
        fields["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        }
    fields.update(over)
    cfg = DeepseekV32Config(**fields)
    cfg._attn_implementation = "eager"
    return cfg


def random_v32_layer(cfg, seed: int = 0) -> DeepseekV32Attention:
    torch.manual_seed(seed)
    layer = DeepseekV32Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    return layer


class _CaptureTopkInput(TorchFunctionMode):
    """Records the tensor whose ``topk`` is taken: the indexer's masked scores [B,S,T]."""

    def __init__(self):
        super().__init__()
        self.scores = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.topk:
            self.scores = args[0].detach().clone()
        return func(*args, **(kwargs or {}))


def run_v32_layer(layer: DeepseekV32Attention, cfg, x: np.ndarray):
    """HF forward without cache (causal mask); returns (output, top-k indices, scores).

    The top-k indices come from a forward hook on the indexer, the masked indexer scores from
    intercepting the ``topk`` call.
    """
    b, s, _ = x.shape
    xt = torch.tensor(x, dtype=torch.float32)
    pos = torch.arange(s)[None].expand(b, -1)
    emb = DeepseekV32RotaryEmbedding(cfg)(xt, pos)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = torch.zeros(s, s).masked_fill(~causal, torch.finfo(torch.float32).min)
    mask = mask[None, None].expand(b, 1, s, s)
    captured = {}

    def hook(_mod, _inp, out):
        captured["topk"] = out.numpy().copy()

    handle = layer.indexer.register_forward_hook(hook)
    mode = _CaptureTopkInput()
    try:
        with torch.no_grad(), mode:
            out, _ = layer(xt, position_embeddings=emb, attention_mask=mask, position_ids=pos)
    finally:
        handle.remove()
    return out.numpy(), captured["topk"], mode.scores.numpy()


def state_dict_numpy(layer) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in layer.state_dict().items()}
