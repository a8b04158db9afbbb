"""The loaders' keyword options (the flags of earlier versions' layer configs:
``qk_head_chunk_size=``, ``indexer_sharded_topk=``, ``context_parallel=``, ...) and the
``Execution`` they describe: ``Execution.from_options`` calls ``from_options`` below, and
``csa_eqx.hf``'s loaders take their ``execution=`` or these keywords
(``csa_eqx.hf._options``). Each spelling refuses the other's keywords with a message naming
the right one. The record (``csa_eqx._execution``) imports nothing from here at import time:
these flags are the loaders' vocabulary, not the record's."""

from __future__ import annotations

import dataclasses
import inspect

from .._loss.auto import AutoIndexerLoss
from .._loss.streaming import StreamingIndexerLoss
from .._numerics.base import AbstractNumerics
from .._numerics.deepseek import named_numerics
from .._placement.context import ContextParallel
from .._placement.heads import HeadParallel
from .._selection.auto import AutoSelection
from .._selection.sharded import ShardedSelection
from .._selection.streaming import StreamingSelection

__all__ = ["from_options", "OPTIONS", "refuse_fields", "refuse_options"]


def _axis(name: str, axis: object) -> None:
    if not (isinstance(axis, str) and axis != ""):
        raise ValueError(f"{name} must be a non-empty mesh axis name (got {axis!r})")


def _block(name: str, value: object) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"{name} must be a non-negative int (got {value!r})")


def from_options(
    cls,
    *,
    qk_head_chunk_size: int = 0,
    indexer_key_block: int = 0,
    query_block: int = 0,
    indexer_save_selection: bool = False,
    indexer_sharded_topk: bool = False,
    shard_indexer_acts: bool = False,
    indexer_loss: str = "off",
    data_axis: str = "data",
    tensor_axis: str = "tensor",
    context_parallel: bool = False,
    context_axis: str = "context",
    head_parallel: bool = False,
    numerics: str | AbstractNumerics = "exact",
    **fields,
):
    """``Execution.from_options`` (``cls``: the record): its keywords and what each means are
    documented there; a field's name given here is a ``TypeError`` (``refuse_fields``)."""
    refuse_fields(cls, fields)
    for name, axis in (("data_axis", data_axis), ("tensor_axis", tensor_axis)):
        _axis(name, axis)
    _axis("context_axis", context_axis)
    _block("indexer_key_block", indexer_key_block)
    _block("query_block", query_block)
    if indexer_key_block:
        selection = StreamingSelection(key_block=indexer_key_block, query_block=query_block)
        indexer_kl = StreamingIndexerLoss(key_block=indexer_key_block, query_block=query_block)
    else:
        selection = AutoSelection(query_block=query_block)
        indexer_kl = AutoIndexerLoss(query_block=query_block)
    if indexer_sharded_topk:
        selection = ShardedSelection(selection, tensor_axis=tensor_axis, data_axis=data_axis)
    return cls(
        selection=selection,
        qk_head_chunk_size=qk_head_chunk_size,
        query_block=query_block,
        save_selection=indexer_save_selection,
        indexer_heads_axis=tensor_axis if shard_indexer_acts else None,
        context=ContextParallel(context_axis, data_axis) if context_parallel else None,
        heads=HeadParallel(tensor_axis, data_axis) if head_parallel else None,
        indexer_loss=indexer_loss,
        numerics=named_numerics(numerics),
        indexer_kl=indexer_kl,
    )


OPTIONS = frozenset(inspect.signature(from_options).parameters) - {"cls", "fields"}
# the keywords whose field has another name (field -> keyword)
_SPELLED = {"save_selection": "indexer_save_selection", "indexer_heads_axis": "shard_indexer_acts"}


def refuse_fields(cls, fields: dict) -> None:
    """``TypeError`` for keywords of ``from_options`` that are none of its own: each named with
    its spelling here (``save_selection`` -> ``indexer_save_selection``) or as a field of
    ``cls(...)`` (``context`` -> ``Execution(context=...)``)."""
    if not fields:
        return
    names = {f.name for f in dataclasses.fields(cls)}
    hints = []
    for name in sorted(fields):
        if name in _SPELLED:
            hints.append(f"{name}= is spelled {_SPELLED[name]}= here")
        elif name in names:
            hints.append(f"{name}= is a field: {cls.__name__}({name}=...)")
        else:
            hints.append(f"{name}= is not an option")
    raise TypeError(f"Execution.from_options: {'; '.join(hints)}")


def refuse_options(cls, kwargs: dict) -> None:
    """``TypeError`` when ``cls(...)`` (the record) got keywords of ``from_options`` that are
    none of its fields, naming the spelling that takes them."""
    names = {f.name for f in dataclasses.fields(cls)}
    options = sorted(k for k in kwargs if k in OPTIONS and k not in names)
    if options:
        spelled = ", ".join(f"{k}=..." for k in options)
        raise TypeError(
            f"{', '.join(options)} {'is an option' if len(options) == 1 else 'are options'} of "
            f"the loaders, not a field of Execution: Execution.from_options({spelled})"
        )
