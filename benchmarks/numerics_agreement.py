"""Agreement with DeepSeek's quantised inference code: the exact path and ``DeepSeekInference``.

Reads the ``q_*`` (bf16 weights) and ``q8_*`` (FP8 checkpoints) fixtures of
``tests/fixtures/deepseek/`` (DeepSeek's inference code in bf16 with ports of its kernels; how
they were made: the ``README.md`` there), loads each layer's weights as a native checkpoint
folder stores them and prints, per case and numerics, the mean selection overlap with
DeepSeek's top-k, the share of rows whose selection is equal and the largest output error on
those rows relative to DeepSeek's largest output. docs/numerics.md holds the table.

    python -m benchmarks.numerics_agreement
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax
import numpy as np
import torch
from safetensors.torch import save_file

import csa_eqx as ce
from csa_eqx.hf import load_v4_attention_from_safetensors, load_v32_attention_from_safetensors

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepseek"
_FLASH, _PRO = "V4-Flash kernels", "V4-Pro kernels (FP8 KV)"  # Flash / Pro below too
_V32_KEYS, _V4_KEYS = "config_671B_v3.2.json's keys", "V4-Flash config.json's keys"
# case: (fixture file, what it is, layer index, V4-Pro's FP8 KV round trip, output key)
QUANTISED = {
    "q_v32": ("q_v32", "V3.2 DSA, bf16 weights", 0, False, "out_bf16"),
    "q_v4_csa_flash": ("q_v4_csa_flash", f"V4 CSA, bf16 weights, {_FLASH}", 1, False, "out_bf16"),
    "q_v4_csa_pro": ("q_v4_csa_pro", f"V4 CSA, bf16 weights, {_PRO}", 1, True, "out_bf16"),
    "q_v4_hca_pro": ("q_v4_hca_pro", f"V4 HCA, bf16 weights, {_PRO}", 2, True, "out_bf16"),
    "q8_v32": ("q8_v32", f"V3.2 DSA, FP8 checkpoint, {_V32_KEYS}", 0, False, "out_bf16"),
    "q8_v4_csa_flash": ("q8_v4_csa", f"V4 CSA, FP8, {_V4_KEYS}, Flash", 2, False, "out_bf16_flash"),
    "q8_v4_csa_pro": ("q8_v4_csa", f"V4 CSA, FP8, {_V4_KEYS}, Pro", 2, True, "out_bf16_pro"),
    "q8_v4_hca_flash": ("q8_v4_hca", f"V4 HCA, FP8, {_V4_KEYS}, Flash", 3, False, "out_bf16_flash"),
    "q8_v4_hca_pro": ("q8_v4_hca", f"V4 HCA, FP8, {_V4_KEYS}, Pro", 3, True, "out_bf16_pro"),
}
# the fixtures' tensors by key prefix: how the checkpoint stores them
_DTYPES = {
    "w": torch.bfloat16,
    "f32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "e8m0": torch.float8_e8m0fnu,
}


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).view(torch.bfloat16)


def load(name: str, **options):
    """Returns: (case ``name``'s layer loaded from a native checkpoint folder holding the
    fixture's tensors as stored (bf16, float32, FP8 E4M3 with E8M0 or float32 tile scales)
    with ``options``, the fixture's arrays)."""
    fixture, _, lid, _, _ = QUANTISED[name]
    with np.load(FIXTURES / f"{fixture}.npz") as f:
        fx = {k: f[k] for k in f.files}
    folder = Path(tempfile.mkdtemp())
    tensors = {}
    for key, value in fx.items():
        kind, _, tensor = key.partition(":")
        if kind in _DTYPES:
            tensors[f"layers.{lid}.attn.{tensor}"] = torch.from_numpy(value).view(_DTYPES[kind])
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(str(fx["config_json"]))
    v32 = json.loads(str(fx["numerics_json"]))["family"] == "v32"
    loader = load_v32_attention_from_safetensors if v32 else load_v4_attention_from_safetensors
    return loader(folder, lid, **options), fx


def run(name: str, numerics) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """Returns: the layer's output ``[S, hidden]`` (float32) and selection ``[S, k]`` (or
    ``None``) with ``numerics`` on the fixture's input, and the fixture."""
    layer, fx = load(name, numerics=numerics)
    x = _bf16(fx["x_bf16"]).float().numpy()
    y, aux = jax.jit(lambda m, x: m(x, return_aux=True))(layer, x)
    sel = None if aux["selection"] is None else np.asarray(aux["selection"])[0]
    return np.asarray(y, np.float32)[0], sel, fx


def compare(y, sel, want_y, want_sel) -> tuple[float, float, float]:
    """Returns: (mean selection overlap, share of rows with an equal selection, largest
    output error on those rows / max|want_y|) of ``(y, sel)`` against ``(want_y, want_sel)``
    (selections as sets of visible entries, ``-1`` = none)."""
    equal, overlap = np.ones(len(want_y), bool), 1.0
    if want_sel is not None and want_sel.shape[-1]:
        sets = [(set(a[a >= 0]), set(b[b >= 0])) for a, b in zip(sel, want_sel, strict=True)]
        overlap = float(np.mean([len(a & b) / len(b) if b else float(a == b) for a, b in sets]))
        equal = np.array([a == b for a, b in sets])
    err = float(np.abs(y[equal] - want_y[equal]).max() / np.abs(want_y).max())
    return overlap, float(equal.mean()), err


def deepseek(name: str, fx: dict) -> tuple[np.ndarray, np.ndarray]:
    """Returns: DeepSeek's output ``[S, hidden]`` (float32) and selection of case ``name``."""
    return _bf16(fx[QUANTISED[name][4]]).float().numpy()[0], fx["selection"][0]


def agreement(name: str, numerics) -> tuple[float, float, float]:
    """``compare`` of the layer with ``numerics`` against DeepSeek's quantised fixture."""
    y, sel, fx = run(name, numerics)
    return compare(y, sel, *deepseek(name, fx))


def table() -> str:
    """Markdown: per fixture, each numerics against DeepSeek's quantised code, and
    ``DeepSeekInference`` against the exact path."""
    lines = [
        "| layer | numerics | compared with | selection overlap | rows with equal selection "
        "| output error |",
        "|---|---|---|---|---|---|",
    ]
    for name, (_, what, _, kv_fp8, _) in QUANTISED.items():
        numerics = ce.DeepSeekInference(kv_fp8=kv_fp8)
        runs = {label: run(name, n) for label, n in [("exact", "exact"), ("deepseek", numerics)]}
        ref = deepseek(name, runs["exact"][2])
        rows = [
            ("exact (default)", "DeepSeek's quantised code", runs["exact"][:2], ref),
            (f"DeepSeekInference(kv_fp8={kv_fp8})", "DeepSeek's quantised code",
             runs["deepseek"][:2], ref),
            (f"DeepSeekInference(kv_fp8={kv_fp8})", "csa_eqx's exact path",
             runs["deepseek"][:2], runs["exact"][:2]),
        ]  # fmt: skip
        for label, other, got, want in rows:
            overlap, share, err = compare(*got, *want)
            lines.append(
                f"| {what} | `{label}` | {other} | {overlap:.4f} | {share:.3f} | {err:.1e} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
