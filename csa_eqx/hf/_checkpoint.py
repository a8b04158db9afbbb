"""Checkpoint tensors -> layer leaves (upcast, FP8 tile scales; name, shape and finiteness
checks), and a checkpoint folder's config and one layer's tensors. An FP8 projection becomes
what the layer's numerics hold it as (``checkpoint_weight``: its dequantisation, or the
``Fp8Weight`` DeepSeek's product needs).

Private to ``csa_eqx.hf``; errors name the tensor as stored (file and name for folders).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._numerics.fp8_weight import Fp8Weight
from ._safetensors_io import decode_e8m0, read_safetensors, safetensors_header


def _dtype_name(value: Any) -> str:
    return str(getattr(value, "dtype", type(value).__name__))


def _to_numpy(name: str, value: Any) -> np.ndarray:
    """Float array from numpy / torch / jax; low-precision floats are upcast to float32 and
    E8M0 scales decoded as ``2**(byte - 127)``."""
    if hasattr(value, "detach"):  # torch tensor, without importing torch up front
        import torch

        value = value.detach().cpu()
        if value.dtype == getattr(torch, "float8_e8m0fnu", None):
            return decode_e8m0(value.view(torch.uint8).numpy())
        if value.dtype in (torch.bfloat16, torch.float16) or "float8" in str(value.dtype):
            value = value.float()
        value = value.numpy()
    arr = np.asarray(value)
    if arr.dtype == ml_dtypes.float8_e8m0fnu:
        return decode_e8m0(arr)
    if arr.dtype in (ml_dtypes.bfloat16, np.float16) or "float8" in str(arr.dtype):
        arr = arr.astype(np.float32)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"tensor {name!r} has non-float dtype {arr.dtype}")
    return arr


def _is_fp8(value: Any) -> bool:
    dtype = _dtype_name(value)
    return "float8" in dtype and "e8m0" not in dtype


def _scale_key(name: str) -> str | None:
    return name[: -len("weight")] + "weight_scale_inv" if name.endswith("weight") else None


def _check_tensor(
    label: str, value: np.ndarray, shape: tuple, why: str = "", what: str = "values"
) -> None:
    """``ValueError`` (naming ``label``) unless ``value`` has ``shape`` (``why``: what the
    expected shape follows from) and only finite ``what`` (entries of a scale, values)."""
    if value.shape != shape:
        raise ValueError(f"{label} has shape {value.shape}, expected {shape}{why}")
    bad = int((~np.isfinite(value)).sum())
    if bad:
        raise ValueError(f"{label} has {bad} non-finite {what}")


def _e4m3(value: Any) -> np.ndarray | None:
    """``value``'s bytes as a numpy ``float8_e4m3fn`` array, when it is stored as one."""
    if hasattr(value, "detach"):
        import torch

        value = value.detach().cpu()
        if value.dtype != torch.float8_e4m3fn:
            return None
        return value.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    arr = np.asarray(value)
    return arr if arr.dtype == ml_dtypes.float8_e4m3fn else None


def _dequantize(
    name: str, weight: Any, scale: Any, block: tuple[int, int], shown: Callable[[str], str]
) -> tuple[np.ndarray, np.ndarray | None]:
    """Upcast ``weight``; an FP8 weight is multiplied by its per-tile ``scale`` (DeepSeek's
    ``weight_scale_inv`` / ``.scale``: one entry per ``block`` tile, ragged at the edges).

    **Returns:** the float array and, for an FP8 weight, its float32 tile scales (``None``
    otherwise)."""
    scale_name = _scale_key(name)
    if not _is_fp8(weight):
        if scale is not None:
            raise ValueError(
                f"tensor {shown(scale_name)!r} is a block scale, but {shown(name)!r} is stored "
                f"as {_dtype_name(weight)}, not FP8"
            )
        return _to_numpy(shown(name), weight), None
    if scale is None:
        raise ValueError(
            f"tensor {shown(name)!r} is stored as FP8 without its block scale "
            f"{shown(scale_name)!r}; load a dequantised checkpoint or include the scales"
        )
    w, s = _to_numpy(shown(name), weight), _to_numpy(shown(scale_name), scale)
    if w.ndim != 2:
        raise ValueError(f"FP8 tensor {shown(name)!r} has shape {w.shape}; tile scales need 2-D")
    grid = tuple(math.ceil(n / b) for n, b in zip(w.shape, block, strict=True))
    _check_tensor(
        f"block scale {shown(scale_name)!r}",
        s,
        grid,
        f" (one per {block[0]}x{block[1]} tile of the {w.shape} weight)",
        "entries (an E8M0 byte 0xFF is NaN)",
    )
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: w.shape[0], : w.shape[1]]
    return w * full, s


def _check_names(present: set[str], expected: set[str], where: str, shown) -> None:
    """Every expected tensor present, nothing else (FP8 scales of expected weights allowed)."""
    scales = {_scale_key(n) for n in expected} - {None}
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - scales)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s): {', '.join(shown(n) for n in missing)}")
        if unexpected:
            parts.append(
                f"unexpected tensor(s) for this layer: {', '.join(shown(n) for n in unexpected)}"
            )
        raise ValueError(f"{where}: {'; '.join(parts)}")


def load_tree(
    module: eqx.Module,
    names: dict[str, str],
    tensors: Mapping[str, Any],
    block: tuple[int, int],
    where: str,
    shown: Callable[[str], str],
    dequantised: tuple[str, ...] = (),
):
    """Replace each leaf named in ``names`` (path -> HF key) with its tensor: an FP8 E4M3
    weight as the layer's numerics hold it (``module.execution.numerics.checkpoint_weight``:
    dequantised, or an ``Fp8Weight`` of its values and scales), except the paths in
    ``dequantised`` (always float arrays: V4's ``block.o_a_proj``); the rest upcast."""
    _check_names(set(tensors), set(names.values()), where, shown)
    numerics = module.execution.numerics
    for path, key in names.items():
        current = _get_path(module, path)
        raw = tensors[key]
        value, scale = _dequantize(key, raw, tensors.get(_scale_key(key) or ""), block, shown)
        _check_tensor(f"{where}: tensor {shown(key)!r}", value, tuple(current.shape))
        values = None if scale is None or path in dequantised else _e4m3(raw)
        if values is None:
            new = jnp.asarray(value, dtype=current.dtype)
        else:
            weight = Fp8Weight(jnp.asarray(values), jnp.asarray(scale, jnp.float32), block)
            new = numerics.checkpoint_weight(weight, current.dtype)
        module = eqx.tree_at(lambda m, p=path: _get_path(m, p), module, new)
    return module


def _get_path(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def strip_prefix(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries whose key starts with ``prefix``, keyed by the rest."""
    return {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}


def rename(name: str, renames: list[tuple[str, str]]) -> str:
    """``name`` after each ``(pattern, replacement)`` regex substitution in turn."""
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    return name


# --- checkpoint folders ----------------------------------------------------------------------


def read_config(folder: Path) -> tuple[dict, str]:
    """A checkpoint folder's ``config.json`` (its ``text_config`` when present) and its path."""
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist or is not a directory")
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{folder} has no config.json: a checkpoint folder holds config.json (HF keys or "
            "DeepSeek's inference keys) and its *.safetensors files"
        )
    try:
        d = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object (got {type(d).__name__})")
    return d.get("text_config", d), str(path)


def _shard_files(folder: Path, wanted: Callable[[str], bool]) -> dict[Path, set[str] | None]:
    """Files to read -> the tensor names the index assigns to them (None without an index)."""
    index_file = folder / "model.safetensors.index.json"
    if not index_file.exists():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder} holds no *.safetensors files")
        return dict.fromkeys(files)
    try:
        index = json.loads(index_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{index_file} is not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index_file} lacks a 'weight_map' of tensor name -> file name")
    files: dict[Path, set[str]] = {}
    for name, file in weight_map.items():
        if wanted(name):
            files.setdefault(folder / file, set()).add(name)
    for file in files:
        if not file.is_file():
            raise ValueError(f"{index_file} maps tensors to {file.name}, which is missing")
    return files


def read_layer(
    folder: Path, prefixes: dict[str, Callable[[str], str]]
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The requested layer's tensors (HF names) and each one's origin ``file: name``.

    ``prefixes`` maps a checkpoint name prefix to the renaming of what follows it. With an
    index only the files it names are read, and only the tensors it assigns to them; without
    one, a tensor found in two files is an error (a stray shard must not silently win).
    """

    def wanted(name: str) -> bool:
        return name.startswith(tuple(prefixes))

    seen: dict[str, list[str]] = {}  # HF name -> every "file: checkpoint name" holding it
    plan: dict[Path, dict[str, str]] = {}  # file -> checkpoint name -> HF name
    for file, assigned in _shard_files(folder, wanted).items():
        header, _ = safetensors_header(file)
        if assigned is not None and (lost := sorted(assigned - header.keys())):
            raise ValueError(
                f"{folder / 'model.safetensors.index.json'} assigns {lost[0]!r} to {file.name}, "
                "which does not hold it"
            )
        for name in header:
            if wanted(name) and (assigned is None or name in assigned):
                prefix = next(p for p in prefixes if name.startswith(p))
                hf = prefixes[prefix](name[len(prefix) :])
                plan.setdefault(file, {})[name] = hf
                seen.setdefault(hf, []).append(f"{file.name}: {name}")
    clashes = {hf: where for hf, where in seen.items() if len(where) > 1}
    if clashes:
        hf, where = sorted(clashes.items())[0]
        raise ValueError(
            f"{folder}: {len(clashes)} tensor(s) of this layer are stored more than once, e.g. "
            f"{hf!r} as {' and '.join(where)}; the loader cannot tell which copy is current "
            "(remove the stray file or tensor, or add a model.safetensors.index.json naming one "
            "file per tensor; DeepSeek's convert.py output split over several model-parallel "
            "files is not supported)"
        )
    if not plan:
        raise ValueError(
            f"{folder}: no attention tensors of this layer (names starting {', '.join(prefixes)})"
        )
    tensors: dict[str, np.ndarray] = {}
    for file, names in plan.items():
        for name, value in read_safetensors(file, keep=names.__contains__).items():
            tensors[names[name]] = value
    return tensors, {hf: where[0] for hf, where in seen.items()}
