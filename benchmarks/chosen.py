"""What csa_eqx's automatic execution runs: the one place the accelerator table
(``benchmarks/accelerator_table.py``) asks the library's choosers (``AutoSelection.strategy``
and ``.choose``, ``AutoAttention.choose``) and watches a layer's forward.

A layer's forward is traced (shapes only) with its selection and attention kernel wrapped in
watchers that note what they run and the attention call's inputs; ``resolve`` says what the
automatic choice took, what the XLA path would take, and the attention call alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

import csa_eqx as ce

from .harness import forward

KERNEL_PREFIXES = ("Triton", "Mosaic")  # the kernel strategy classes (docs/kernels.md)
_SEEN: list[tuple] = []  # what the watched strategies saw while a forward was traced


def is_kernel(strategy) -> bool:
    """Whether ``strategy`` (a selection or attention object) is a Triton / Mosaic kernel."""
    return type(strategy).__name__.startswith(KERNEL_PREFIXES)


def platform_execution(execution: ce.Execution) -> ce.Execution:
    """The execution the table measures as "the automatic choice": ``execution`` itself, but on
    a GPU with the Triton kernels (``TritonSelection``, ``TritonAttention``) forced. The
    library's automatic choice there is the XLA path until these kernels have been measured on
    a GPU, which is what this table does."""
    if jax.default_backend() != "gpu":
        return execution
    kernels = dict(selection=ce.TritonSelection(), attention=ce.TritonAttention())
    return dataclasses.replace(execution, **kernels)


def automatic_selection(selection, problem) -> ce.AbstractSelection:
    """The strategy ``selection`` runs on ``problem`` (``AutoSelection``'s choice, or itself)."""
    return selection.strategy(problem) if isinstance(selection, ce.AutoSelection) else selection


def xla_selection(problem) -> ce.AbstractSelection:
    """The XLA path's strategy for ``problem``: the dense or streaming top-k by the automatic
    size rule, never a kernel."""
    return ce.AutoSelection().choose(*problem.sizes(), problem.tiles)


def automatic_attention(kernel, numerics) -> ce.AbstractAttentionKernel:
    """The attention kernel ``kernel`` runs under ``numerics`` (``AutoAttention``'s choice)."""
    return kernel.choose(numerics) if isinstance(kernel, ce.AutoAttention) else kernel


class _WatchedSelection(ce.AbstractSelection):
    """``inner``, noting the strategy it runs and the XLA path's for each problem."""

    inner: ce.AbstractSelection

    def _note(self, problem) -> None:
        _SEEN.append(("selection", automatic_selection(self.inner, problem), problem))

    def select(self, problem, k):
        self._note(problem)
        return self.inner.select(problem, k)


class _WatchedAttention(ce.AbstractAttentionKernel):
    """``inner``, noting the kernel it runs and its call (inputs and options)."""

    inner: ce.AbstractAttentionKernel

    def attend(self, q, reads, sinks, scale, *, return_lse=False, query_block, numerics=None):
        kw = dict(return_lse=return_lse, query_block=query_block, numerics=numerics)
        kernel = automatic_attention(self.inner, numerics)
        _SEEN.append(("attention", kernel, (q, reads, sinks, scale, kw)))
        return self.inner.attend(q, reads, sinks, scale, **kw)


def watched(layer):
    """``layer`` with its selection and attention watched (same results)."""
    ex = layer.execution
    return layer.with_execution(
        dataclasses.replace(
            ex, selection=_WatchedSelection(ex.selection), attention=_WatchedAttention(ex.attention)
        )
    )


def _seen(kind: str) -> tuple:
    return next(s[1:] for s in _SEEN if s[0] == kind)


def attention_inputs(layer, x):
    """The inputs ``(q, reads, sinks)`` of ``layer``'s attention call in its forward on ``x``."""
    _SEEN.clear()
    forward(watched(layer), x)
    q, reads, sinks, _, _ = _seen("attention")[1]
    return q, reads, sinks


class Choice(NamedTuple):
    """What a layer's automatic execution runs on an input (``resolve``)."""

    selection: Any  # the selection strategy it takes
    xla_selection: Any  # the XLA path's strategy for the same problem
    attention: Any  # the attention kernel it takes
    call: tuple  # (scale, keywords) of its attention call
    inputs: tuple  # shapes of that call's (q, reads, sinks)

    @property
    def path(self) -> str:
        return "kernel" if is_kernel(self.selection) or is_kernel(self.attention) else "xla"

    @property
    def names(self) -> dict[str, str]:
        return {
            "selection": type(self.selection).__name__,
            "attention": type(self.attention).__name__,
        }

    @property
    def xla_names(self) -> dict[str, str]:
        return {"selection": type(self.xla_selection).__name__, "attention": "XlaAttention"}

    @property
    def automatic_is_xla(self) -> bool:
        """Whether the automatic choice is the XLA path itself (then it runs once)."""
        same = repr(self.selection) == repr(self.xla_selection)
        return same and isinstance(self.attention, ce.XlaAttention)

    def xla_execution(self, execution: ce.Execution) -> ce.Execution:
        """``execution`` with the XLA path's selection and attention forced."""
        return dataclasses.replace(
            execution, selection=self.xla_selection, attention=ce.XlaAttention()
        )


def resolve(layer, x) -> Choice:
    """Trace (shapes only) ``layer``'s forward on ``x`` (arrays or shapes) and say what its
    automatic execution runs."""
    inputs = eqx.filter_eval_shape(attention_inputs, layer, x)
    strategy, problem = _seen("selection")
    kernel, (_, _, _, scale, kw) = _seen("attention")
    choice = Choice(strategy, xla_selection(problem), kernel, (scale, kw), inputs)
    _SEEN.clear()  # drop the tracers
    return choice


def attention_programs(layer, choice: Choice) -> dict[str, Callable]:
    """``layer``'s attention call alone, as its forward makes it, on captured inputs
    ``(q, reads, sinks)``: fwd and fwd+bwd (the gradient w.r.t. every float input)."""
    scale, kw = choice.call
    kernel = layer.execution.attention

    def attention(q, reads, sinks):
        return kernel.attend(q, reads, sinks, scale, **kw)

    def attention_fwd_bwd(q, reads, sinks):
        loss = lambda a: jnp.sum(attention(*a).astype(jnp.float32))  # noqa: E731
        return eqx.filter_grad(loss)((q, reads, sinks))

    return {"attention fwd": attention, "attention fwd+bwd": attention_fwd_bwd}
