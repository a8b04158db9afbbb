"""Tiny demo runs shared by the trainer's tests (seconds each): dense steps 1-2, warm-up 3-4,
sparse 5-6; evaluations at steps 3 and 6."""

import shlex

from csa_eqx.demo.cli import build_parser, train_config
from csa_eqx.demo.config import TrainConfig

TINY = shlex.split(
    "--seq-len=64 --start-seq-len=64 --batch-size=4 --pairs=2 --keys=4 --values=4 "
    "--dense-steps=2 --warmup-steps=2 --sparse-steps=2 --topk=4 --window=8 --hidden=32 "
    "--eval-every=3 --eval-batches=1 --checkpoint-every=1"
)


def tiny_config(*flags: str, name: str = "tiny") -> TrainConfig:
    """The ``TrainConfig`` that ``csa-eqx train`` builds from ``TINY`` plus ``flags``."""
    return train_config(build_parser().parse_args(["train", *TINY, *flags, f"--name={name}"]))
