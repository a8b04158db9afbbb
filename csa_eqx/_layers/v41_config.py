"""The DeepSeek-V4.1 attention stack's architecture and its sharing schedule (docs/v41.md):
which layer compresses the KV, which runs an indexer, which reuses whose results.

V4.1 layers are not independent: a *KV source* compresses the KV and publishes its entries and
index keys, an *index source* publishes a top-k selection, a *candidate source* also publishes
a block pre-filter, and every other compressed layer reuses what the latest sources published.
So the config describes the whole stack, and each layer's role is resolved from it
(``V41AttentionConfig.role``). Wrong wiring raises ``V41WiringError`` (a ``ValueError``) when
the config is built.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from .._config import V4FamilyConfig, _non_negative, _require

__all__ = ["V41AttentionConfig", "V41WiringError", "V41Role"]

V41Role = Literal["sliding", "full", "reindex", "reuse"]


class V41WiringError(ValueError):
    """A V4.1 sharing schedule that cannot run: a layer reads something no earlier layer
    publishes, or reads it at the wrong ratio or size. The message names the layer and the
    rule."""


def _layer_ids(cfg, field: str) -> None:
    v = getattr(cfg, field)
    if isinstance(v, list):
        v = tuple(v)
        object.__setattr__(cfg, field, v)
    _require(
        isinstance(v, tuple)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        and list(v) == sorted(set(v)),
        field,
        "must be increasing distinct layer indices",
        v,
    )


@dataclasses.dataclass(frozen=True)
class V41AttentionConfig(V4FamilyConfig):
    """A DeepSeek-V4.1 attention stack's architecture (docs/v41.md): the per-layer sizes, all
    equal across layers (``V4FamilyConfig``'s, with the release's defaults), and the sharing
    schedule. How a layer runs is ``csa_eqx.Execution``.

    Field names follow csa_eqx's V4 config (``hidden_size``, ``num_heads``, ...); the schedule
    uses DeepSeek's names (HF: ``kv_source_layer_ids``, ``index_source_layer_ids``,
    ``candidate_source_layer_id``).

    **Arguments:**

    - ``compress_ratios``: per layer, 0 (sliding window only) or the tokens per compressed entry
        ``m`` (the release uses 1 and 2).
    - ``kv_source_layers``: the layers that own a compressor (and the index keys' projection).
    - ``index_source_layers``: the layers that own an indexer and publish a selection; each
        KV source must be one.
    - ``candidate_source_layer``: the index source that also publishes the candidate blocks
        (``-1``: no pre-filter); every later index source selects among them.
    - ``candidate_topk_blocks`` (``Nb``), ``candidate_block_size`` (``bc``): the pre-filter keeps
        ``Nb`` blocks of ``bc`` entries per query; ``Nb·bc >= index_topk`` is required.
    - the sizes: as in ``V4FamilyConfig`` (``index_*``: the indexer's heads, head dim, ``k``).

    Every field is checked in ``__post_init__``: a ``ValueError`` names the field, the rule and the
    value; a wiring error is a ``V41WiringError`` naming the layer.
    """

    hidden_size: int = 5120
    q_lora_rank: int = 1280
    index_n_heads: int = 32
    rms_norm_eps: float = 1e-20
    compress_ratios: tuple[int, ...] | list[int] = (0, 2, 2, 1, 1, 1)
    kv_source_layers: tuple[int, ...] | list[int] = (1, 3)
    index_source_layers: tuple[int, ...] | list[int] = (1, 3, 4)
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0

    def __post_init__(self):
        super().__post_init__()
        _non_negative(self, "candidate_topk_blocks", "candidate_block_size")
        if isinstance(self.compress_ratios, list):
            object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        self._check_schedule()

    def _check_schedule(self) -> None:
        ratios = self.compress_ratios
        _require(
            isinstance(ratios, tuple)
            and len(ratios) > 0
            and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ratios),
            "compress_ratios",
            "must be a non-empty list of ints >= 0",
            ratios,
        )
        n = len(ratios)
        for field in ("kv_source_layers", "index_source_layers"):
            _layer_ids(self, field)
            for i in getattr(self, field):
                if not 0 <= i < n:
                    raise V41WiringError(f"{field}: layer {i} is not in the stack of {n} layers")
                if ratios[i] == 0:
                    raise V41WiringError(
                        f"{field}: layer {i} has compress ratio 0 (a sliding layer has no "
                        "compressed entries to compress or select)"
                    )
        kv, index = set(self.kv_source_layers), set(self.index_source_layers)
        for i in sorted(kv - index):
            raise V41WiringError(
                f"layer {i} is a KV source but not an index source: nothing would compute the "
                "index keys' selection of its entries (add it to index_source_layers)"
            )
        for i, m in enumerate(ratios):
            if m == 0:
                continue
            src = self.kv_source(i)
            if src is None:
                raise V41WiringError(
                    f"layer {i} ({self.role(i)}, ratio {m}) has no KV source at or before it "
                    f"(kv_source_layers={list(self.kv_source_layers)})"
                )
            if ratios[src] != m:
                raise V41WiringError(
                    f"layer {i} has compress ratio {m} but reads the entries of its KV source, "
                    f"layer {src}, of ratio {ratios[src]}"
                )
            sel = self.index_source(i)
            if sel is None or sel < src:
                raise V41WiringError(
                    f"layer {i} would reuse the selection of layer {sel}, which selects among "
                    f"another KV source's entries than layer {src}'s"
                )
        c = self.candidate_source_layer
        _require(
            isinstance(c, int) and not isinstance(c, bool) and c >= -1,
            "candidate_source_layer",
            "must be -1 (off) or a layer index",
            c,
        )
        if c < 0:
            return
        if c not in index:
            raise V41WiringError(
                f"candidate_source_layer {c} is not an index source "
                f"(index_source_layers={list(self.index_source_layers)})"
            )
        nb, bc, k = self.candidate_topk_blocks, self.candidate_block_size, self.index_topk
        _require(nb > 0, "candidate_topk_blocks", "must be > 0 with a candidate source", nb)
        _require(bc > 0, "candidate_block_size", "must be > 0 with a candidate source", bc)
        _require(
            nb * bc >= k,
            "candidate_topk_blocks",
            f"times candidate_block_size={bc} must be at least index_topk={k} (else a "
            "consumer's top-k could run out of candidates)",
            nb,
        )
        for i in self.index_source_layers:
            if i > c and self.kv_source(i) != self.kv_source(c):
                raise V41WiringError(
                    f"index source {i} uses the candidates of layer {c}, which are over the "
                    f"entries of KV source {self.kv_source(c)}, but it reads KV source "
                    f"{self.kv_source(i)}"
                )

    @property
    def num_layers(self) -> int:
        """**Returns:** the number of layers in the stack."""
        return len(self.compress_ratios)

    def _latest(self, layers: tuple[int, ...], i: int) -> int | None:
        earlier = [j for j in layers if j <= i]
        return earlier[-1] if earlier else None

    def kv_source(self, i: int) -> int | None:
        """**Arguments:** a layer index ``i``.

        **Returns:** the latest KV source at or before ``i`` (``None`` for a sliding layer or
        when there is none)."""
        return None if self.compress_ratios[i] == 0 else self._latest(self.kv_source_layers, i)

    def index_source(self, i: int) -> int | None:
        """**Arguments:** a layer index ``i``.

        **Returns:** the latest index source at or before ``i``, whose selection layer ``i``
        attends (``None`` for a sliding layer or when there is none)."""
        return None if self.compress_ratios[i] == 0 else self._latest(self.index_source_layers, i)

    def role(self, i: int) -> V41Role:
        """**Arguments:** a layer index ``i``.

        **Returns:** ``"sliding"`` (ratio 0), ``"full"`` (a KV source: compressor, index keys and
        indexer), ``"reindex"`` (an index source reading the latest KV source's entries and
        keys) or ``"reuse"`` (the latest KV source's entries and index source's selection)."""
        if self.compress_ratios[i] == 0:
            return "sliding"
        if i in self.kv_source_layers:
            return "full"
        return "reindex" if i in self.index_source_layers else "reuse"

    def is_candidate_source(self, i: int) -> bool:
        """**Returns:** whether layer ``i`` publishes the candidate blocks."""
        return i == self.candidate_source_layer

    def uses_candidates(self, i: int) -> bool:
        """**Returns:** whether layer ``i`` is an index source restricted to the candidates (an
        index source after the candidate source)."""
        return 0 <= self.candidate_source_layer < i and i in self.index_source_layers
