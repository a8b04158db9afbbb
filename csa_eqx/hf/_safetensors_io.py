"""A small, validating ``.safetensors`` reader (numpy + ``ml_dtypes``; never pickle).

A file is an 8-byte little-endian header length, a JSON header mapping tensor names to
``{"dtype", "shape", "data_offsets"}``, then the raw bytes. Every structural fault — a file too
short for its header, a header that is not JSON, an entry whose byte range does not match its
shape or runs past the end of the file, a dtype the reader does not know — raises
``SafetensorsError`` naming the file (and the tensor), never a bare ``struct`` / ``json`` /
``reshape`` error.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["SafetensorsError", "read_safetensors", "safetensors_header", "decode_e8m0"]

DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    # exponent-only scale format of DeepSeek's FP8 checkpoints: 2**(byte - 127), 0xFF = NaN
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsError(ValueError):
    """A ``.safetensors`` file is truncated, corrupt or uses a dtype the reader lacks."""


def decode_e8m0(raw: np.ndarray) -> np.ndarray:
    """Float32 values of E8M0 scale bytes: ``2**(byte - 127)``, NaN for ``0xFF``.

    **Arguments:** ``raw``: a ``uint8`` array (or the ``float8_e8m0fnu`` view of one).

    **Returns:** a float32 array of the same shape; every finite entry is an exact power of two
    (``2**-127`` is a float32 subnormal, still exact).
    """
    byte = np.asarray(raw).view(np.uint8).astype(np.int32)
    out = np.ldexp(np.float32(1.0), np.minimum(byte, 254) - 127).astype(np.float32)
    return np.where(byte == 0xFF, np.float32(np.nan), out)


def safetensors_header(path: str | Path) -> tuple[dict[str, dict], int]:
    """The validated JSON header of ``path`` (without ``__metadata__``) and its data start.

    **Raises:** ``SafetensorsError`` naming the file when it is shorter than its header, the
    header is not a JSON object, or an entry's dtype / shape / byte range is invalid.
    """
    path = Path(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(
                f"{path}: truncated safetensors file ({size} bytes; the 8-byte header length "
                "alone needs 8)"
            )
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise SafetensorsError(
                f"{path}: truncated or corrupt safetensors file: header length {header_len} "
                f"bytes, but only {size - 8} bytes follow"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    for name, info in header.items():
        _check_entry(path, name, info, data_size)
    return header, 8 + header_len


def _check_entry(path: Path, name: str, info: Any, data_size: int) -> None:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise SafetensorsError(f"{where}: header entry needs dtype, shape and data_offsets")
    if info["dtype"] not in DTYPES:
        raise SafetensorsError(
            f"{where} has unsupported dtype {info['dtype']!r} (known: {', '.join(DTYPES)})"
        )
    shape, offsets = info["shape"], info["data_offsets"]
    lists = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
    ints = lists and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shape + offsets
    )
    if not ints:
        raise SafetensorsError(f"{where}: invalid shape {shape!r} or data_offsets {offsets!r}")
    start, end = offsets
    expected = math.prod(shape) * np.dtype(DTYPES[info["dtype"]]).itemsize
    if end - start != expected:
        raise SafetensorsError(
            f"{where}: data_offsets {offsets} hold {end - start} bytes, but shape {shape} of "
            f"{info['dtype']} needs {expected}"
        )
    if end > data_size:
        raise SafetensorsError(
            f"{where}: bytes {start}..{end} run past the end of the data ({data_size} bytes); "
            "the file is truncated"
        )


def read_safetensors(path: str | Path, keep=lambda name: True) -> dict[str, np.ndarray]:
    """Read the tensors of one ``.safetensors`` file whose names pass ``keep``.

    **Arguments:**

    - ``path``: the file.
    - ``keep``: a predicate on tensor names; only those tensors' bytes are read.

    **Returns:** name -> numpy array in the stored dtype (``F8_E8M0`` as
    ``ml_dtypes.float8_e8m0fnu``; ``decode_e8m0`` turns it into float32).

    **Raises:** ``SafetensorsError`` naming the file (and tensor) for any structural fault.
    """
    header, base = safetensors_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if not keep(name):
                continue
            start, end = info["data_offsets"]
            f.seek(base + start)
            data = f.read(end - start)
            dtype = np.dtype(DTYPES[info["dtype"]])
            out[name] = np.frombuffer(data, dtype=dtype).reshape(info["shape"]).copy()
    return out
