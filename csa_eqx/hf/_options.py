"""The loaders' keyword options: a loader takes ``execution=`` or the keywords of
``Execution.from_options`` (never both), and any other keyword overrides an architecture
field of the config; ``numerics="deepseek"`` takes the checkpoint's ``scale_fmt``."""

from __future__ import annotations

from .._execution import Execution
from .._numerics.base import DeepSeekFormats
from .._numerics.deepseek import named_numerics
from ._flags import OPTIONS

__all__ = ["loader_execution", "split_options"]


def loader_execution(
    execution: Execution | None,
    flags: dict,
    scale_fmt: str | None = "ue8m0",
    formats: DeepSeekFormats | None = None,
) -> Execution:
    """A loader's ``Execution``: its ``execution=`` or its execution keywords, not both.

    **Arguments:** the loader's ``execution`` (``None``: not given), the keywords of
    ``Execution.from_options`` it was called with (``flags``, by name), the checkpoint's
    activation scale format and the layer family's formats (for ``numerics=``,
    ``named_numerics``).

    **Returns:** ``execution``, or ``Execution.from_options(**flags)``; a ``ValueError`` when
    both are given.
    """
    if execution is not None and flags:
        raise ValueError(
            f"pass either execution= or the execution keywords {sorted(flags)}, not both"
        )
    if "numerics" in flags:
        flags = {**flags, "numerics": named_numerics(flags["numerics"], scale_fmt, formats)}
    return Execution.from_options(**flags) if execution is None else execution


def split_options(options: dict, scale_fmt: str | None = None) -> tuple[dict, Execution]:
    """Loader keyword ``options`` -> ``(architecture overrides, Execution)``: ``execution=`` an
    ``Execution``, or the keywords of ``Execution.from_options``; anything else overrides a
    config field. ``numerics="deepseek"`` takes the checkpoint's ``scale_fmt``."""
    overrides = {k: v for k, v in options.items() if k not in OPTIONS | {"execution"}}
    flags = {k: v for k, v in options.items() if k in OPTIONS}
    return overrides, loader_execution(options.get("execution"), flags, scale_fmt)
