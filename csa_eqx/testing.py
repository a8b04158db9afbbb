"""Hugging Face reference layers with random weights, for tests and benchmarks.

One builder turns a csa_eqx layer config (e.g. ``presets.tiny_v4("csa")``) into the matching
one-layer transformers config, fills a ``DeepseekV4Attention`` / ``DeepseekV32Attention`` with
random weights scaled like a trained layer, and runs it (full forward, cached steps, or a
timed forward / backward). csa_eqx's own layer gets the same weights through
``csa_eqx.hf.load_v4_attention`` / ``load_v32_attention`` on ``state_dict_numpy(layer)``.

This module needs torch and transformers; ``import csa_eqx`` never imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from transformers import DeepseekV4Config, DeepseekV32Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
)
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Attention,
    DeepseekV32RotaryEmbedding,
)

from ._config import V4AttentionConfig, V32AttentionConfig, YaRNScaling
from .hf._config import v4_config_from_hf, v32_config_from_hf
from .hf._to_hf import v4_hf_fields, v32_hf_fields

__all__ = [
    "TINY_YARN",
    "hf_v4_config",
    "hf_v32_config",
    "random_hf_v4_layer",
    "random_hf_v32_layer",
    "state_dict_numpy",
    "run_hf_v4",
    "hf_v4_runner",
    "run_hf_v32",
    "hf_v4_extend",
    "hf_v32_extend",
]

# a YaRN scaling that changes every rotated channel of a tiny layer within ~100 positions
TINY_YARN = YaRNScaling(
    factor=16.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.7
)

# fields every transformers config requires but an attention layer never reads
_UNUSED_MOE = dict(
    vocab_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)


def _architecture(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _check_round_trip(config, back) -> None:
    want, got = _architecture(config), _architecture(back)
    diff = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
    if diff:
        raise ValueError(f"config has no exact transformers equivalent: (ours, HF's) {diff}")


def hf_v4_config(config: V4AttentionConfig, **hf_fields) -> DeepseekV4Config:
    """The one-layer transformers ``DeepseekV4Config`` (eager attention) of a V4 layer config.

    **Arguments:**

    - `config`: the layer's architecture.
    - `hf_fields`: transformers config fields to set on top (e.g. ``num_hidden_layers=3``
      with ``layer_types=[...]`` and ``mlp_layer_types=[...]`` for a multi-layer model).

    **Returns:** a ``DeepseekV4Config`` whose layer 0 converts back to ``config``'s
    architecture through ``csa_eqx.hf.v4_config_from_hf`` (checked; ``ValueError`` otherwise).
    """
    fields = dict(_UNUSED_MOE, **v4_hf_fields([config]), mlp_layer_types=["moe"])
    fields.update(hf_fields)
    hf_config = DeepseekV4Config(**fields)
    hf_config._attn_implementation = "eager"
    if "layer_types" not in hf_fields:
        _check_round_trip(config, v4_config_from_hf(hf_config, 0))
    return hf_config


def hf_v32_config(config: V32AttentionConfig, **hf_fields) -> DeepseekV32Config:
    """The one-layer transformers ``DeepseekV32Config`` (eager attention) of a V3.2 config.

    **Arguments:**

    - `config`: the layer's architecture. HF normalises
      with eps 1e-6 whatever the config says, so ``config.rms_norm_eps`` must be 1e-6.
    - `hf_fields`: transformers config fields to set on top.

    **Returns:** a ``DeepseekV32Config`` that converts back to ``config``'s architecture
    through ``csa_eqx.hf.v32_config_from_hf`` (checked; ``ValueError`` otherwise).
    """
    fields = dict(_UNUSED_MOE, max_position_embeddings=1024) | v32_hf_fields(config)
    fields.update(
        num_key_value_heads=config.num_heads, n_group=1, topk_group=1, intermediate_size=32
    )
    fields.update(hf_fields)
    hf_config = DeepseekV32Config(**fields)
    hf_config._attn_implementation = "eager"
    _check_round_trip(config, v32_config_from_hf(hf_config))
    return hf_config


def _randomise(layer: torch.nn.Module, seed: int, scaled: Callable[[str], float | None]) -> None:
    """Norm weights ~ 1 + 0.1·N(0,1); parameters named by ``scaled`` ~ that scale · N(0,1);
    every other matrix ~ N(0,1)/sqrt(fan-in), as in a trained layer."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif (scale := scaled(name)) is not None:
                p.copy_(scale * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))


def random_hf_v4_layer(hf_config: DeepseekV4Config, seed: int = 0) -> DeepseekV4Attention:
    """Layer 0 of ``hf_config`` in eval mode with random weights (sinks and compressor
    position biases ~ 0.5·N(0,1), so they matter), reproducible from ``seed``.

    **Arguments:** ``hf_config`` (from ``hf_v4_config``) and the torch ``seed``.

    **Returns:** the transformers ``DeepseekV4Attention`` (float32, eval mode).
    """
    layer = DeepseekV4Attention(hf_config, layer_idx=0).eval()
    biases = ("position_bias", "sinks")
    _randomise(layer, seed, lambda n: 0.5 if n.split(".")[-1] in biases else None)
    return layer


def random_hf_v32_layer(hf_config: DeepseekV32Config, seed: int = 0) -> DeepseekV32Attention:
    """Layer 0 of ``hf_config`` in eval mode with random weights (the indexer key norm's
    bias ~ 0.1·N(0,1)), reproducible from ``seed``.

    **Arguments:** ``hf_config`` (from ``hf_v32_config``) and the torch ``seed``.

    **Returns:** the transformers ``DeepseekV32Attention`` (float32, eval mode).
    """
    layer = DeepseekV32Attention(hf_config, layer_idx=0).eval()
    _randomise(layer, seed, lambda n: 0.1 if n.endswith("bias") else None)
    return layer


def state_dict_numpy(layer: torch.nn.Module) -> dict[str, np.ndarray]:
    """**Arguments:** a torch module (an HF attention layer).

    **Returns:** its parameters and buffers as float32 numpy arrays, keyed by HF name (what
    ``csa_eqx.hf.load_v4_attention`` / ``load_v32_attention`` take).
    """
    return {k: v.detach().cpu().float().numpy() for k, v in layer.state_dict().items()}


def _v4_inputs(hf_config, x, start: int, past: int, device, dtype):
    """Input tensor and keyword arguments of one HF V4 call on tokens ``start..start+S-1``,
    with ``past`` earlier tokens in the cache (the window mask spans them)."""
    b, s, _ = x.shape
    xt = torch.tensor(np.asarray(x), device=device, dtype=dtype or torch.float32)
    pos = torch.arange(start, start + s, device=device)[None].expand(b, -1)
    rope = DeepseekV4RotaryEmbedding(hf_config, device=device)
    emb = {kind: rope(xt, pos, layer_type=kind) for kind in ("main", "compress")}
    i = torch.arange(start, start + s, device=device)[:, None]
    j = torch.arange(start - past, start + s, device=device)[None]
    allowed = (j <= i) & (i - j < hf_config.sliding_window)
    mask = torch.zeros(allowed.shape, device=device, dtype=xt.dtype)
    mask = mask.masked_fill(~allowed, float("-inf"))[None, None].expand(b, 1, -1, -1)
    return xt, dict(position_embeddings=emb, position_ids=pos, attention_mask=mask)


class _V4Capture:
    """Forward hooks keeping the HF V4 indexer's top-k [B,S,k] and raw scores [B,S,T]."""

    def __init__(self, layer: DeepseekV4Attention):
        self.got: dict[str, np.ndarray] = {}
        self.handles = []
        indexer = getattr(layer.compressor, "indexer", None)
        if indexer is not None:
            self.handles = [
                indexer.register_forward_hook(self._keep("topk")),
                indexer.scorer.register_forward_hook(self._keep("scores")),
            ]

    def _keep(self, name):
        def hook(_module, _inputs, out):  # returns None: the output is left unchanged
            out = out.detach().cpu()
            self.got[name] = (out.float() if out.is_floating_point() else out).numpy()

        return hook

    def __enter__(self):
        return self.got

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def run_hf_v4(
    layer: DeepseekV4Attention, hf_config: DeepseekV4Config, x: np.ndarray, device="cpu", dtype=None
):
    """HF V4 forward without cache (positions ``0..S-1``, causal window mask).

    **Arguments:**

    - `layer`: the HF attention layer (on ``device`` in ``dtype``).
    - `hf_config`: its config (RoPE and window).
    - `x`: float array [B,S,hidden_size].
    - `device`, `dtype`: where the inputs live (torch device and dtype; default float32).

    **Returns:** ``(output [B,S,hidden], topk [B,S,k] or None, scores [B,S,T] or None)``:
    the indexer's top-k entry indices and raw scores, ``None`` for layers without an indexer;
    numpy float32 arrays on the host.
    """
    xt, kwargs = _v4_inputs(hf_config, x, 0, 0, device, dtype)
    with _V4Capture(layer) as got, torch.no_grad():
        out, _ = layer(xt, **kwargs)
    return out.cpu().float().numpy(), got.get("topk"), got.get("scores")


def hf_v4_runner(
    layer: DeepseekV4Attention, hf_config: DeepseekV4Config, x: np.ndarray, device="cpu", dtype=None
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """Two closures for timing the HF V4 layer on fixed inputs (built once, outside them).

    **Arguments:**

    - `layer`, `hf_config`, `x`: as in ``run_hf_v4``; ``layer`` must already be on ``device``
      in ``dtype``.
    - `device`, `dtype`: where the inputs live (torch device and dtype; default float32).

    **Returns:** ``(forward, forward_backward)``: the output under ``no_grad``, and the
    gradient of the output sum with respect to ``x`` (parameter gradients accumulate too).
    """
    xt, kwargs = _v4_inputs(hf_config, x, 0, 0, device, dtype)

    def forward():
        with torch.no_grad():
            return layer(xt, **kwargs)[0]

    def forward_backward():
        layer.zero_grad(set_to_none=True)
        xg = xt.clone().requires_grad_(True)
        layer(xg, **kwargs)[0].sum().backward()
        return xg.grad

    return forward, forward_backward


def hf_v4_extend(
    layer: DeepseekV4Attention, hf_config: DeepseekV4Config, x: np.ndarray, start: int, cache
):
    """One cached HF V4 call on tokens ``start..start+S-1`` (prefill or decode step).

    **Arguments:**

    - `layer`, `hf_config`: as in ``run_hf_v4``.
    - `x`: float array [B,S,hidden_size], the next ``S`` tokens.
    - `start`: position of ``x[:, 0]`` (the number of tokens already in ``cache``).
    - `cache`: a ``transformers.DynamicCache(config=hf_config)``, updated in place.

    **Returns:** ``(output [B,S,hidden], topk or None, scores or None)`` as in ``run_hf_v4``;
    ``scores`` cover every entry cached so far.
    """
    past = min(start, hf_config.sliding_window - 1)  # HF's sliding cache keeps window-1 tokens
    xt, kwargs = _v4_inputs(hf_config, x, start, past, "cpu", None)
    with _V4Capture(layer) as got, torch.no_grad():
        out, _ = layer(xt, cache=cache, **kwargs)
    return out.numpy(), got.get("topk"), got.get("scores")


class _CaptureTopkInput(TorchFunctionMode):
    """Records the tensor whose ``topk`` is taken: the V3.2 indexer's masked scores."""

    def __init__(self):
        super().__init__()
        self.scores = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.topk:
            self.scores = args[0].detach().clone()
        return func(*args, **(kwargs or {}))


def _run_v32(layer, hf_config, x, start: int, cache):
    b, s, _ = x.shape
    xt = torch.tensor(np.asarray(x), dtype=torch.float32)
    pos = torch.arange(start, start + s)[None].expand(b, -1)
    emb = DeepseekV32RotaryEmbedding(hf_config)(xt, pos)
    causal = torch.arange(start + s)[None, :] <= torch.arange(start, start + s)[:, None]
    mask = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    got = {}
    handle = layer.indexer.register_forward_hook(
        lambda _m, _i, out: got.update(topk=out.numpy().copy())
    )
    mode = _CaptureTopkInput()
    try:
        with torch.no_grad(), mode:
            out, _ = layer(
                xt,
                position_embeddings=emb,
                attention_mask=mask[None, None].expand(b, 1, -1, -1),
                position_ids=pos,
                cache=cache,
            )
    finally:
        handle.remove()
    return out.numpy(), got["topk"], mode.scores.numpy()


def run_hf_v32(layer: DeepseekV32Attention, hf_config: DeepseekV32Config, x: np.ndarray):
    """HF V3.2 forward without cache (positions ``0..S-1``, causal mask), float32.

    **Arguments:**

    - `layer`, `hf_config`: the HF attention layer and its config.
    - `x`: float array [B,S,hidden_size].

    **Returns:** ``(output [B,S,hidden], topk [B,S,k], scores [B,S,S])``: the indexer's
    top-k token indices (HF pads rows with fewer than k visible tokens with masked,
    future indices) and its masked scores (the tensor HF takes the top-k of).
    """
    return _run_v32(layer, hf_config, x, 0, None)


def hf_v32_extend(
    layer: DeepseekV32Attention, hf_config: DeepseekV32Config, x: np.ndarray, start: int, cache
):
    """One cached HF V3.2 call on tokens ``start..start+S-1``.

    **Arguments:** as in ``hf_v4_extend``.

    **Returns:** as in ``run_hf_v32``; ``scores`` ``[B, S, start + S]`` cover every cached
    token.
    """
    return _run_v32(layer, hf_config, x, start, cache)
