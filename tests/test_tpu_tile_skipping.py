"""Tile skipping (issue 54, item 4; docs/kernels.md, "Tile skipping") compiled by Mosaic and run
on a TPU, where the visit lists' SMEM blocks and scalar reads meet Mosaic's own layouts (the
CPU's interpret mode does not check them): V3.2 DSA reads (128 heads over a 576-wide latent
whose first 512 features are the values, ``test_tpu_attention.V32``'s sizes: 1024 queries at
the end of 4096 tokens, 8 tiles of 512) with local picks, as trained indexers pick (each
query's 512 most recent tokens and four heavy regions of 128, at tokens 0, 1300, 2100 and 2600:
tiles 1 and 3 picked by no block, tile 2 between picked ones), for the tiles design (gradients
in VMEM and in HBM) and V3.2's automatic design from 16k (rows copied from a resident table,
the backward's tiles from rows, gradients in HBM): outputs, ``lse`` and every gradient against
``XlaAttention`` on the CPU (``test_tpu_attention.compare``), and bitwise those of the same
kernel visiting every tile (``skip_tiles=False``) on the chip. bfloat16.

Collected everywhere; skipped unless a TPU is present. Run on a TPU machine::

    JAX_PLATFORMS=tpu,cpu python -m pytest -q tests/test_tpu_tile_skipping.py
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_tpu_attention import V32, Problem, compare, loss_and_grads

from csa_eqx import MosaicAttention

pytestmark = pytest.mark.skipif(
    not any(d.platform == "tpu" for d in jax.devices()),
    reason="needs a TPU: JAX_PLATFORMS=tpu,cpu python -m pytest -q tests/test_tpu_tile_skipping.py",
)

REGIONS = (0, 1300, 2100, 2600)  # the heavy regions' first tokens


@dataclasses.dataclass(frozen=True)
class LocalProblem(Problem):
    """``Problem`` with local picks: half a query's picks its most recent tokens, the rest in
    four heavy regions (``REGIONS``); ``-1`` where the query does not see a pick."""

    def inputs(self, dtype, seed: int = 0) -> dict:
        arrays = super().inputs(dtype, seed)
        s, t, k = self.queries, self.entries, self.picks
        visible = (t - s + 1 + np.arange(s))[:, None]
        col = np.arange(k)[None, :]
        recent, span = k // 2, (k - k // 2) // len(REGIONS)
        heavy = np.asarray(REGIONS)[np.clip((col - recent) // span, 0, 3)] + (col - recent) % span
        picks = np.where(col < recent, visible - 1 - col, heavy)
        arrays["picks"] = np.where((picks >= 0) & (picks < visible), picks, -1)[None].astype(
            np.int32
        )
        return arrays


LOCAL = LocalProblem(**{f.name: getattr(V32, f.name) for f in dataclasses.fields(V32)})
DESIGNS = {
    "tiles": MosaicAttention(gather="tiles"),
    "tiles-hbm-gradients": MosaicAttention(gather="tiles", gradients="hbm"),
    "rows-resident-backward-as-tiles": MosaicAttention(
        gather="rows", resident=True, gradients="hbm"
    ),
}


@pytest.mark.parametrize("design", list(DESIGNS))
def test_tile_skipping_on_the_chip(design):
    """Against ``XlaAttention`` on the CPU, and bitwise without skipping on the chip."""
    kernel = DESIGNS[design]
    compare(kernel, LOCAL, "bfloat16")
    arrays = jax.device_put(LOCAL.inputs(np.dtype(jnp.bfloat16)), jax.devices("tpu")[0])
    got = loss_and_grads(kernel, LOCAL, arrays)
    want = loss_and_grads(dataclasses.replace(kernel, skip_tiles=False), LOCAL, arrays)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
