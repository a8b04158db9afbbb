"""Crash-safe files for training runs: one atomic checkpoint holding everything a resume needs.

A checkpoint is one file: a JSON header line (format, step, the optimizer's phase, the run's
config, the history so far, the payload's length and SHA-256), then the payload, the
``eqx.tree_serialise_leaves`` bytes of ``(model, optimizer state)``. Every file is written to
``NAME.tmp``, flushed and fsynced, then renamed over ``NAME`` (and the folder fsynced), so a
kill at any instant leaves either the previous complete file or the new one. The data position
is the step (batches and initial weights derive from the seed and the step), so no other state
is needed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import equinox as eqx

__all__ = [
    "prepare_folder",
    "RunError",
    "write_atomic",
    "save_checkpoint",
    "read_checkpoint",
    "restore",
    "kill_point",
]

FORMAT = "csa_eqx.demo checkpoint"
VERSION = 1
KILL_AT = "CSA_EQX_DEMO_KILL_AT"  # fault-injection hook, see kill_point
_HEADER_KEYS = {
    "format",
    "version",
    "step",
    "phase",
    "config",
    "history",
    "payload_bytes",
    "payload_sha256",
}


class RunError(Exception):
    """A run that cannot go on as asked: an unusable checkpoint, an unwritable folder or a
    non-finite loss (the message says which file and what to do)."""


def kill_point(step: int, site: str) -> None:
    """Fault injection for tests/test_train_faults.py: SIGKILL this process when the environment
    variable ``CSA_EQX_DEMO_KILL_AT`` equals ``"STEP:SITE"`` (unset in normal runs).

    **Arguments:** ``step``: the training step the run is at; ``site``: the instant's name.
    """
    if os.environ.get(KILL_AT) == f"{step}:{site}":
        os.kill(os.getpid(), signal.SIGKILL)


def prepare_folder(folder: Path) -> None:
    """Create ``folder`` (with its parents) and check that files can be written in it.

    Raises ``RunError`` naming the folder and the reason (a file in the way, no permission).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise RunError(
            f"cannot write to the folder {folder}: {err.strerror or err} ({err.filename}); "
            "choose another folder"
        ) from None


def write_atomic(path: Path, data: bytes, step: int) -> None:
    """Replace ``path`` by ``data`` so that a kill at any instant leaves the old or the new file.

    **Arguments:** ``path``: the file; ``data``: its new contents; ``step``: the training step,
    for :func:`kill_point` (sites ``NAME:partial``, ``NAME:written``, ``NAME:replaced``).

    Raises ``RunError`` naming the file when it cannot be written.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            kill_point(step, f"{path.name}:partial")
            f.write(data[len(data) // 2 :])
            f.flush()
            os.fsync(f.fileno())
        kill_point(step, f"{path.name}:written")
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as err:
        raise RunError(
            f"cannot write {path}: {err.strerror or err}; the previous {path.name} (if any) is "
            "kept. Free space or fix permissions and run the same command again to resume."
        ) from None
    kill_point(step, f"{path.name}:replaced")


def save_checkpoint(
    path: Path, tree: Any, *, step: int, phase: str, config: dict, history: list[dict]
) -> None:
    """Write one checkpoint file atomically.

    **Arguments:** ``path``: the checkpoint file; ``tree``: ``(model, optimizer state)``;
    ``step``: steps done; ``phase``: the phase ``tree``'s optimizer state belongs to (the phase
    of the last step done); ``config``: the run's config as JSON-able dict; ``history``: the
    evaluation records so far.
    """
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, tree)
    payload = buffer.getvalue()
    header = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "phase": phase,
        "config": config,
        "history": history,
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    write_atomic(path, json.dumps(header).encode() + b"\n" + payload, step)


def unusable(path: Path, reason: str) -> RunError:
    """The one error for a checkpoint a run cannot resume from, with the user's choices."""
    return RunError(
        f"cannot resume from {path}: {reason}. Start over under a new --name, or delete "
        f"{path} to restart this run from step 0."
    )


def read_checkpoint(path: Path) -> tuple[dict, bytes]:
    """The checkpoint's header and payload, checked for truncation and corruption.

    **Returns:** ``(header, payload)``; raises ``RunError`` naming ``path`` and the choices
    when the file is empty, truncated, corrupt or of another format.
    """
    try:
        data = path.read_bytes()
    except OSError as err:
        raise unusable(path, f"it cannot be read ({err.strerror or err})") from None
    if not data:
        raise unusable(path, "the file is empty")
    head, newline, payload = data.partition(b"\n")
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not newline or not isinstance(header, dict):
        raise unusable(path, "its header is truncated or corrupt")
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise unusable(
            path,
            f"it is not a {FORMAT} version {VERSION} (format {header.get('format')!r}, "
            f"version {header.get('version')!r}; written by another csa_eqx version?)",
        )
    missing = sorted(_HEADER_KEYS - set(header))
    if missing:
        raise unusable(path, f"its header lacks {missing}")
    if len(payload) != header["payload_bytes"]:
        raise unusable(
            path, f"the file is truncated ({len(payload)} of {header['payload_bytes']} bytes)"
        )
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise unusable(path, "its contents are corrupt (checksum mismatch)")
    return header, payload


def restore(path: Path, payload: bytes, like: Any) -> Any:
    """The checkpoint's ``(model, optimizer state)``, shaped like ``like``; ``RunError`` naming
    ``path`` when its arrays do not fit (e.g. written by another model version)."""
    try:
        return eqx.tree_deserialise_leaves(io.BytesIO(payload), like)
    except Exception as err:  # any mismatch: the message is the same for the user
        reason = f"its arrays do not fit this model ({type(err).__name__}: {err})"
        raise unusable(path, reason) from None
