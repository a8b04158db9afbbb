"""Selections of pre-projected indexer queries through the public strategy API, in the
positional form the selection tests share: ``(q, weights, keys, query_index, segment, layout,
k)``."""

import csa_eqx as ce


def problem(q, weights, keys, query_index, segment, layout, head_chunk=0):
    """The ``SelectionProblem`` of already projected queries and head weights."""
    visibility = ce.Visibility(query_index, segment, layout)
    return ce.SelectionProblem.from_queries(q, weights, keys, visibility, head_chunk)


def selected(*args, k, strategy=None, head_chunk=0, key_block=0, query_block=0):
    """``strategy`` (default: ``StreamingSelection`` when ``key_block`` is given, else
    ``AutoSelection``) on ``problem(*args)``."""
    if strategy is None:
        strategy = (
            ce.StreamingSelection(key_block=key_block, query_block=query_block)
            if key_block
            else ce.AutoSelection(query_block=query_block)
        )
    return strategy.select(problem(*args, head_chunk=head_chunk), k)


def sharded_selected(*args, k, tensor_axis="tensor", data_axis="data", mesh=None, **tiles):
    """``ShardedSelection`` around the strategy ``selected`` would use."""
    inner = (
        ce.StreamingSelection(key_block=tiles["key_block"], query_block=tiles.get("query_block", 0))
        if tiles.get("key_block")
        else ce.AutoSelection(query_block=tiles.get("query_block", 0))
    )
    strategy = ce.ShardedSelection(inner, tensor_axis=tensor_axis, data_axis=data_axis, mesh=mesh)
    return selected(*args, k=k, strategy=strategy, head_chunk=tiles.get("head_chunk", 0))
