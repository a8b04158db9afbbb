"""``TrainConfig``: everything a demo training run depends on (saved in every checkpoint and
checked on resume)."""

from __future__ import annotations

import dataclasses
import math
import re

from .. import Execution, ShardedSelection
from .models import LMConfig
from .tasks import RetrievalTask

__all__ = [
    "CONTROLS",
    "LOSS_WINDOW",
    "PHASES",
    "SCHEDULES",
    "TARGETS",
    "TrainConfig",
    "check_run_name",
    "check_learning_rate",
]

PHASES = ("dense", "warmup", "sparse")
# What a run trains: the recipe ("csa"), or a control with the same model size, data and steps:
# every layer a sliding-window layer (cannot see the stored pair: near chance), or the CSA
# layers attending to every visible compressed entry in every phase (the upper bound).
VARIANTS = ("csa", "sliding", "dense")
# each family's default schedule: a CSA layer, a sliding one, an HCA one (V4); a V4.1 KV source
# (the candidate source), a sliding layer, and a reindex layer within its candidates
SCHEDULES = {"v4": ("csa", "sliding", "hca"), "v41": ("full", "sliding", "reindex")}
CONTROLS = VARIANTS[1:]
TARGETS = {"retrieval_accuracy": 0.9, "indexer_recall": 0.9}  # what `make demo` must reach
LOSS_WINDOW = 5  # steps averaged for the answer loss at the end of a phase (one batch is noisy)

_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_run_name(name: str) -> str:
    """``name`` if it is one plain folder name (letters, digits, ``_ . -``, not starting with a
    dot), so that ``RUNS/NAME`` stays inside ``RUNS``; otherwise a ``ValueError``."""
    if not _RUN_NAME.fullmatch(name):
        raise ValueError(
            "run name must be one folder name of letters, digits, '_', '.' or '-', not "
            f"starting with '.' or '-', so the run stays inside the runs folder (got {name!r})"
        )
    return name


def check_learning_rate(value: float, what: str = "learning rate") -> float:
    """``value`` if it is a finite positive number; otherwise a ``ValueError`` naming
    ``what`` it is."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite positive number (got {value})")
    return value


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on (saved in the report and checked on resume)."""

    name: str = "demo"
    seq_len: int = 512
    start_seq_len: int = 32
    batch_size: int = 32
    n_pairs: int = 1
    n_keys: int = 1
    n_values: int = 16
    dense_steps: int = 60
    warmup_steps: int = 6
    sparse_steps: int = 12
    learning_rate: float = 3e-3
    # the sparse phase's peak rate, as a fraction of learning_rate: the rate the dense phase
    # ends with (restarting at learning_rate made the near-zero loss jump ~1000x)
    sparse_lr_scale: float = 0.1
    lr_warmup_steps: int = 10  # per phase: linear warm-up, then cosine decay to 10% at its end
    grad_clip: float = 1.0  # global gradient-norm clip
    short_batch_scale: int = 4  # rows shorter than seq_len come in up to 4x larger batches
    index_topk: int = 8
    sliding_window: int = 16
    hidden_size: int = 128
    # the attention schedule: V4 / V3.2 layer kinds, or V4.1 roles (``family="v41"``); () = the
    # family's default (SCHEDULES)
    layers: tuple[str, ...] = ()
    family: str = "v4"
    mesh: tuple[int, int] = (0, 0)  # (data, tensor); (0, 0) = automatic over local devices
    eval_every: int = 50
    eval_batches: int = 4  # held-out batches per evaluation (4 x 32 queries by default)
    checkpoint_every: int = 50
    seed: int = 0
    variant: str = "csa"
    controls: tuple[str, ...] = CONTROLS  # control runs after a "csa" run (see VARIANTS)

    def __post_init__(self):
        check_run_name(self.name)
        for f in (
            "seq_len",
            "batch_size",
            "n_pairs",
            "n_keys",
            "n_values",
            "start_seq_len",
            "index_topk",
            "sliding_window",
            "hidden_size",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "short_batch_scale",
        ):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive (got {getattr(self, f)})")
        if not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ValueError(f"grad_clip must be a finite positive number (got {self.grad_clip})")
        for f in ("dense_steps", "warmup_steps", "sparse_steps", "lr_warmup_steps"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0 (got {getattr(self, f)})")
        for f, what in (("learning_rate", "learning rate"), ("sparse_lr_scale", "scale")):
            try:
                check_learning_rate(getattr(self, f), what)
            except ValueError as err:
                raise ValueError(f"{f}: {err}") from None
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS} (got {self.variant!r})")
        if not set(self.controls) <= set(CONTROLS) or len(set(self.controls)) < len(self.controls):
            raise ValueError(
                f"controls must be distinct names from {CONTROLS} (got {self.controls})"
            )
        if self.controls and self.variant != "csa":
            raise ValueError(f"a {self.variant!r} control run has no controls of its own")
        self.model_config()  # the task and the model check their own fields
        if self.dense_steps:
            try:
                self.task(self.curriculum()[0])
            except ValueError as err:
                raise ValueError(
                    f"start_seq_len={self.start_seq_len} is too short: {err}"
                ) from None

    @property
    def schedule(self) -> tuple[str, ...]:
        """**Returns:** the attention schedule: ``layers``, or the family's default."""
        return self.layers or SCHEDULES.get(self.family, ())

    @property
    def total_steps(self) -> int:
        return self.dense_steps + self.warmup_steps + self.sparse_steps

    def control(self, variant: str) -> TrainConfig:
        """The control run ``variant`` of this run: same sizes, data, steps and curriculum."""
        return dataclasses.replace(
            self, name=f"{self.name}-{variant}", variant=variant, controls=()
        )

    def stage(self, phase: str) -> str:
        """The CSA layers' training stage in ``phase``: dense until the sparse phase (the
        ``dense`` control stays dense)."""
        return "sparse" if phase == "sparse" and self.variant == "csa" else "dense"

    def phase_at(self, step: int) -> str:
        """The phase that training step ``step`` (0-based) runs in."""
        if step < self.dense_steps:
            return "dense"
        return "warmup" if step < self.dense_steps + self.warmup_steps else "sparse"

    def curriculum(self) -> list[int]:
        """The row lengths of the dense phase: ``start_seq_len`` doubled up to ``seq_len``."""
        lengths = [min(self.start_seq_len, self.seq_len)]
        while lengths[-1] < self.seq_len:
            lengths.append(min(2 * lengths[-1], self.seq_len))
        return lengths

    def seq_len_at(self, step: int) -> int:
        """Curriculum: the dense phase starts at ``start_seq_len`` for half of its steps (a
        retrieval circuit is found far faster in short rows), then doubles the length in equal
        shares of the other half up to ``seq_len``; the later phases use ``seq_len``."""
        lengths = self.curriculum()
        if step >= self.dense_steps:
            return self.seq_len
        half = self.dense_steps // 2
        if step < half or len(lengths) == 1:
            return lengths[0]
        rest = lengths[1:]
        return rest[(step - half) * len(rest) // (self.dense_steps - half)]

    def batch_at(self, step: int) -> int:
        """Rows per batch at ``step``: shorter rows come in larger batches (``seq_len /
        length`` times, at most ``short_batch_scale``), so the curriculum's early steps see
        more answers for about the same work per step."""
        return self.batch_size * min(self.short_batch_scale, self.seq_len // self.seq_len_at(step))

    def phase_steps(self, phase: str) -> int:
        """How many steps ``phase`` lasts."""
        return {"dense": self.dense_steps, "warmup": self.warmup_steps}.get(
            phase, self.sparse_steps
        )

    def peak_learning_rate(self, phase: str) -> float:
        """The peak of ``phase``'s schedule: ``learning_rate``, times ``sparse_lr_scale`` in
        the sparse phase."""
        return self.learning_rate * (self.sparse_lr_scale if phase == "sparse" else 1.0)

    def task(self, seq_len: int | None = None) -> RetrievalTask:
        """The retrieval task at ``seq_len`` (default: the full length). Every stored pair is
        more than ``sliding_window`` tokens before the first query."""
        return RetrievalTask(
            seq_len=seq_len or self.seq_len,
            n_pairs=self.n_pairs,
            n_queries=self.n_pairs,
            n_keys=self.n_keys,
            n_values=self.n_values,
            min_distance=self.sliding_window + 2 * self.n_pairs + 2,
            seed=self.seed,
        )

    def model_config(self, mesh_axes=("data", "tensor")) -> LMConfig:
        """The ``DecoderLM`` this run trains (sharded top-k, selection saved for backward)."""
        d = self.hidden_size
        base = LMConfig(vocab_size=self.task().vocab_size)
        layers = self.schedule
        layers = layers if self.variant != "sliding" else ("sliding",) * len(layers)
        attention = dataclasses.replace(
            base.attention,
            hidden_size=d,
            sliding_window=self.sliding_window,
            index_topk=self.index_topk,
        )
        selection = ShardedSelection(tensor_axis=mesh_axes[1], data_axis=mesh_axes[0])
        execution = Execution(selection=selection, save_selection=True)
        return dataclasses.replace(
            base, layers=layers, family=self.family, attention=attention, execution=execution
        )
