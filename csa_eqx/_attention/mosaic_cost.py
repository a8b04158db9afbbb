"""The cost model of ``MosaicAttention``'s automatic gather (``mosaic_plan.block_sizes``): the
modelled seconds of a call's gathered sets read by row DMAs, copied from a resident table, or
as tiles, from the chip's figures (TPU v5e, JAX 0.10.2; docs/kernels.md, "The automatic
configuration").
"""

from __future__ import annotations

__all__ = ["gather_seconds"]

# A row DMA costs ~20.5 ns whatever its size; the tiles pass runs at ~136 TFLOP/s of its own
# (masked, dense) work; rows copied from a resident table cost ~2.3 ns a row and their
# per-query arithmetic runs at ~96 TFLOP/s, after the table's one load at the HBM's ~820 GB/s.
ROW_SECONDS = 20.5e-9
TILE_FLOPS = 136e12
COPY_SECONDS = 2.3e-9
ROWS_FLOPS = 96e12
HBM_BYTES_PER_SECOND = 820e9


def gather_seconds(gather: str, seq: int, sets, heads: int, width: int, tile: int, qb: int):
    """The cost model of a call's gathered sets (module constants; docs/kernels.md): row DMAs
    cost ``ROW_SECONDS`` each (one per query and index column); rows copied from a
    ``"resident"`` table ``COPY_SECONDS`` each and their arithmetic (every head against the
    row) at ``ROWS_FLOPS``, after the table's load (its rows ``width`` bfloat16 wide) at
    ``HBM_BYTES_PER_SECOND``; the tiles pass computes every
    row of the tiles a query block visits for all its queries and heads at ``TILE_FLOPS``, a
    block visiting the rows up to its largest pick: ``T - min(S, T) / 2`` rows on average (half
    the table when the queries span it, as in a prefill; all of it for a few queries at its
    end, as in decoding).

    **Arguments:** ``gather`` (``"rows"``, ``"resident"`` or ``"tiles"``), the queries
    ``seq``, the ``sets``
    (``(table rows T, index columns k)`` each), the (padded) ``heads``, the keys' and values'
    (padded) ``width`` summed, the ``tile`` and the query block ``qb``.

    **Returns:** the modelled seconds of the forward.
    """
    if gather == "rows":
        return sum(ROW_SECONDS * seq * k for _, k in sets)
    if gather == "resident":
        per_row = COPY_SECONDS + heads * width * 2 / ROWS_FLOPS
        return sum(seq * k * per_row + rows * width * 2 / HBM_BYTES_PER_SECOND for rows, k in sets)
    blocks = -(-seq // qb)
    total = 0.0
    for rows, _ in sets:
        visited = (rows - min(seq, rows) / 2) / tile + 0.5  # tiles, the last one partly
        total += blocks * visited * qb * heads * tile * width * 2 / TILE_FLOPS
    return total
