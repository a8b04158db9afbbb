"""Training runs that cannot be lost: SIGKILL at any instant resumes to the same result; unusable
checkpoints, non-finite losses and unwritable folders give one clear error.

The kill test runs ``csa-eqx train`` in real processes. The trainer's fault hook
(``CSA_EQX_DEMO_KILL_AT=STEP:SITE``, see ``csa_eqx.demo.checkpoint.kill_point``) makes a process
SIGKILL itself at a chosen instant: after a step, half-way through writing a file, after the
file is complete but before its rename, after the rename, while writing the report and after the
plots. Each process dies at one instant and the next resumes from what is on disk; two chains
of kills follow an uninterrupted run side by side, and each chain's final checkpoint (model and
optimizer state) and history must equal the uninterrupted run's bitwise. A persistent
compilation cache, filled by the uninterrupted run as it goes, keeps a resumed process at ~3-7 s
of CPU instead of ~35 s with its compiles (measured on a 2-core CPU): the run's own cache when
``make test`` gives one (``JAX_COMPILATION_CACHE_DIR``), else one in ``tmp_path``. The
uninterrupted run is ``python -m csa_eqx.demo.cli train``; a chain's processes are forked, one
at a time, from a process of the chain's own that imported the trainer once (``FORKER``): each
is a new process whose JAX backend starts in it, running the same ``csa_eqx.demo.cli.main``,
without the ~1.4 s of CPU that importing csa_eqx costs every new interpreter (24 times).
"""

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
from child_env import child_env
from demo_helpers import TINY, tiny_config

from csa_eqx.demo.checkpoint import (
    KILL_AT,
    RunError,
    read_checkpoint,
    save_checkpoint,
    write_atomic,
)
from csa_eqx.demo.cli import main
from csa_eqx.demo.train import CHECKPOINT, TrainConfig, train

# dense steps 1-2, warm-up 3-4, sparse 5-6: steps 2 and 4 end a phase
FLAGS = [*TINY, "--layers=csa", "--controls=none"]
STEPS = 6
C, H, R = CHECKPOINT, "history.json", "report.json"
CHAINS = (
    [
        (1, "step"),
        (2, f"{C}:partial"),
        (2, f"{C}:replaced"),  # resume from the last dense step's checkpoint
        (3, f"{H}:partial"),
        (4, f"{C}:written"),
        (4, f"{H}:replaced"),  # resume from the last warm-up step's checkpoint
        (5, f"{C}:partial"),
        (6, "step"),
        (6, f"{C}:replaced"),
        (6, f"{R}:partial"),
        (6, "plots"),
    ],
    [
        (1, f"{C}:written"),
        (2, "step"),
        (2, f"{H}:replaced"),
        (3, f"{C}:partial"),
        (4, "step"),
        (4, f"{C}:replaced"),
        (5, f"{H}:partial"),
        (6, f"{C}:partial"),
        (6, f"{C}:written"),
        (6, f"{H}:replaced"),
        (6, f"{R}:replaced"),
    ],
)


def train_argv(runs: Path, name: str) -> list[str]:
    """``csa-eqx train``'s arguments: 8 simulated CPU devices (the demo's default is 4), as in
    ``tests/conftest.py``, so that the uninterrupted run compiles the programs of
    ``test_cli``'s in-process smoke run, which ``make test``'s compilation cache then serves."""
    return ["train", f"--runs={runs}", f"--name={name}", "--devices=8", *FLAGS]


def environment(cache: Path) -> dict[str, str]:
    env = child_env(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    env.pop(KILL_AT, None)
    return env


def start_uninterrupted(runs: Path, cache: Path) -> subprocess.Popen:
    """``python -m csa_eqx.demo.cli train`` in a subprocess, to its end."""
    cmd = [sys.executable, "-m", "csa_eqx.demo.cli", *train_argv(runs, "reference")]
    return subprocess.Popen(
        cmd, env=environment(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


# A chain's server: imports the trainer (not JAX's backend: no XLA threads yet), then for each
# request line forks a process that runs ``csa_eqx.demo.cli.main`` (killing itself at the
# request's instant, if any) with its output in a log file, waits for it and answers with its
# exit status (negative: the signal that ended it, as ``Popen.returncode``).
FORKER = f"""
import json, os, sys, traceback
from csa_eqx.demo import cli, train  # what every run imports, imported once

for line in sys.stdin:
    argv, kill, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if kill:
                os.environ[{KILL_AT!r}] = kill
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            code = cli.main(argv)
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Chain:
    """One chain's processes, one at a time, forked by the chain's ``FORKER``."""

    def __init__(self, runs: Path, name: str, cache: Path):
        self.argv, self.log = train_argv(runs, name), runs.parent / f"{name}.log"
        self.server = subprocess.Popen(
            [sys.executable, "-c", FORKER],
            env=environment(cache),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.kill: tuple[int, str] | None = None
        self.started = 0.0

    def start(self, kill: tuple[int, str] | None) -> None:
        self.kill, self.started = kill, time.monotonic()
        instant = f"{kill[0]}:{kill[1]}" if kill else None
        self.server.stdin.write(json.dumps([self.argv, instant, str(self.log)]) + "\n")
        self.server.stdin.flush()

    def done(self) -> bool:
        """Whether the process has ended (its exit status is waiting)."""
        assert time.monotonic() - self.started < 600, f"kill at {self.kill}: still running"
        return bool(select.select([self.server.stdout], [], [], 0)[0])

    def finish(self) -> None:
        answer = self.server.stdout.readline()
        assert answer, f"the chain's server ended (exit {self.server.wait()})"
        check_exit(int(answer), self.kill, self.log.read_text())


def check_exit(code: int, kill: tuple[int, str] | None, out: str) -> None:
    expected = -signal.SIGKILL if kill else 0
    assert code == expected, f"kill at {kill}: exit {code}\n{out}"


def saved_step(run: Path) -> int:
    """The step of the checkpoint on disk (0 when there is none); it must always be readable."""
    return read_checkpoint(run / C)[0]["step"] if (run / C).exists() else 0


def expected_step(kill: tuple[int, str]) -> int:
    """The checkpoint a kill at ``kill`` must leave: the new one once it was renamed."""
    step, site = kill
    before_rename = site == "step" or site in (f"{C}:partial", f"{C}:written")
    return step - 1 if before_rename else step


def without_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k != "tokens_per_second"} for h in history]


def outcome(run: Path) -> tuple:
    header, payload = read_checkpoint(run / C)
    report = json.loads((run / R).read_text())
    history = json.loads((run / H).read_text())
    assert (
        without_timing(history)
        == without_timing(header["history"])
        == without_timing(report["history"])
    )
    final = {k: report[k] for k in ("step", "finished", "retrieval_accuracy", "indexer_recall")}
    config = {**header["config"], "name": None}  # each run has its own name
    header = {**header, "config": config, "history": without_timing(header["history"])}
    return header, payload, final


def ready(kill: tuple[int, str] | None, reference: subprocess.Popen, ref_run: Path) -> bool:
    """Whether the uninterrupted run has compiled everything a process killed at ``kill``
    needs (it fills the compilation cache as it goes; its checkpoint says how far it is)."""
    if reference.poll() is not None:
        return True
    return kill is not None and kill[0] < STEPS and saved_step(ref_run) >= kill[0]


def follow(chains: dict, plans: dict, reference: subprocess.Popen, runs: Path) -> int:
    """Run each chain's plan, one process at a time per chain, each once the uninterrupted run
    is ``ready`` for it, and check what each kill leaves on disk; **returns** the kills."""
    running: set[str] = set()
    kills = 0
    while plans or running:  # the chains follow the uninterrupted run, one process each
        for name in list(running):
            if not chains[name].done():
                continue
            chains[name].finish()
            running.remove(name)
            kill = chains[name].kill
            if kill:
                kills += 1
                assert saved_step(runs / name) == expected_step(kill), kill
                if kill[1] == f"{C}:partial":  # the half-written file is left beside
                    assert (runs / name / f"{C}.tmp").stat().st_size > 0
                if (runs / name / H).exists():  # never half-written
                    json.loads((runs / name / H).read_text())
        for name, plan in list(plans.items()):
            if name not in running and ready(plan[0], reference, runs / "reference"):
                chains[name].start(plan.pop(0))
                running.add(name)
                if not plan:
                    del plans[name]
        time.sleep(0.1)
    return kills


@pytest.mark.slow
def test_sigkill_at_any_instant_resumes_to_the_uninterrupted_result(tmp_path):
    cache = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or tmp_path / "jax-cache")
    runs = tmp_path / "runs"
    reference = start_uninterrupted(runs, cache)
    plans = {f"chain{i}": [*chain, None] for i, chain in enumerate(CHAINS)}  # None: finish
    chains = {name: Chain(runs, name, cache) for name in plans}
    try:
        kills = follow(chains, plans, reference, runs)
    finally:  # a server ends once its input does (after the process it is waiting for)
        for chain in chains.values():
            chain.server.stdin.close()
    for chain in chains.values():
        assert chain.server.wait(timeout=60) == 0
    out, _ = reference.communicate(timeout=600)
    check_exit(reference.returncode, None, out)
    assert kills >= 20
    expected = outcome(runs / "reference")
    assert expected[2]["step"] == STEPS and expected[2]["finished"]
    history = expected[0]["history"]  # one record per step, evaluations at steps 3 and 6
    assert [h["phase"] for h in history] == ["dense"] * 2 + ["warmup"] * 2 + ["sparse"] * 2
    assert [h["step"] for h in history if "retrieval_accuracy" in h] == [3, 6]
    for name in (f"chain{i}" for i in range(len(CHAINS))):
        header, payload, final = outcome(runs / name)
        assert header == expected[0]
        assert payload == expected[1]  # model and optimizer state, bitwise
        assert final == expected[2]


# ---- unusable checkpoints: one message naming the file and the choices ----

SMALL = tiny_config(
    "--warmup-steps=0", "--sparse-steps=0", "--layers=csa", "--controls=none", name="small"
)


def fake_checkpoint(path: Path, cfg: TrainConfig = SMALL, **header) -> None:
    """A well-formed checkpoint whose payload is not this model's (a 3-vector)."""
    fields = dict(step=1, phase="dense", config=dataclasses.asdict(cfg), history=[])
    save_checkpoint(path, (jnp.zeros(3),), **{**fields, **header})


def corrupt(kind: str, path: Path) -> None:
    fake_checkpoint(path)
    data = path.read_bytes()
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(data[: len(data) - 10])
    elif kind == "header":
        path.write_bytes(b"\x93NUMPY garbage\n" + data)
    elif kind == "flipped":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif kind == "old-format":  # the layout before format versions: {"step", "config"} + leaves
        header = {"step": 1, "config": dataclasses.asdict(SMALL)}
        path.write_bytes(json.dumps(header).encode() + b"\n" + data.partition(b"\n")[2])
    elif kind == "other-config":
        fake_checkpoint(path, dataclasses.replace(SMALL, seq_len=128))
    elif kind == "bad-step":
        fake_checkpoint(path, step=99)
    elif kind == "other-arrays":
        pass  # well-formed, but the payload is not the model's
    elif kind == "folder":
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("empty", "the file is empty"),
        ("truncated", "the file is truncated"),
        ("header", "its header is truncated or corrupt"),
        ("flipped", "checksum mismatch"),
        ("old-format", "written by another csa_eqx version"),
        ("other-config", "different configuration (differs in ['seq_len'])"),
        ("bad-step", "step 99"),
        ("other-arrays", "its arrays do not fit this model"),
        ("folder", "it cannot be read"),
    ],
)
def test_unusable_checkpoint_names_the_file_and_the_choices(kind, reason, tmp_path):
    path = tmp_path / "small" / CHECKPOINT
    path.parent.mkdir()
    corrupt(kind, path)
    with pytest.raises(RunError) as err:
        train(SMALL, tmp_path / "small", sys.stdout)
    message = str(err.value)
    assert message.startswith(f"cannot resume from {path}: ") and reason in message
    assert "new --name" in message and f"delete {path}" in message


def test_cli_reports_an_unusable_checkpoint_once(tmp_path, capsys):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / CHECKPOINT).write_bytes(b"")
    assert main(["train", "--runs", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert f"cannot resume from {tmp_path / 'demo' / CHECKPOINT}: the file is empty" in err


def test_non_finite_loss_stops_with_the_last_good_checkpoint(tmp_path, capsys):
    """A learning rate of 1e38 makes the first update's weights ~1e38 (finite: the checkpoint of
    step 1 is written) and the second step's loss non-finite."""
    argv = ["train", "--runs", str(tmp_path), "--name", "nan"]
    flags = [*TINY, "--dense-steps=3", "--warmup-steps=0", "--sparse-steps=0", "--lr=1e38"]
    assert main([*argv, *flags, "--layers=csa", "--controls=none"]) == 1
    err = capsys.readouterr().err
    ckpt = tmp_path / "nan" / CHECKPOINT
    assert "non-finite training at step 2 (dense phase)" in err
    assert f"the last good checkpoint {ckpt} (step 1) is kept" in err and "--lr" in err
    assert read_checkpoint(ckpt)[0]["step"] == 1


@pytest.mark.parametrize("where", ["runs-is-a-file", "run-is-a-file", "under-a-file"])
def test_run_folder_that_cannot_be_written(where, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    runs = {"runs-is-a-file": blocker, "run-is-a-file": tmp_path, "under-a-file": blocker / "x"}
    if where == "run-is-a-file":
        (tmp_path / "demo").write_text("not a folder")
    assert main(["train", "--runs", str(runs[where])]) == 1
    err = capsys.readouterr().err
    assert f"cannot write to the folder {runs[where] / 'demo'}" in err and "Traceback" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_run_folder(tmp_path, capsys):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo").chmod(0o500)
    assert main(["train", "--runs", str(tmp_path)]) == 1
    assert "Permission denied" in capsys.readouterr().err


def test_library_refuses_a_run_name_outside_the_runs_folder():
    for name in ("../x", "/abs", "a/b", ".hidden", ""):
        with pytest.raises(ValueError, match="run name must be one folder name"):
            TrainConfig(name=name)


def test_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "history.json"
    path.write_text("[1]")
    (tmp_path / "history.json.tmp").mkdir()  # the temporary file cannot be created
    with pytest.raises(RunError, match=f"cannot write {path}: .*the previous history.json"):
        write_atomic(path, b"[1, 2]", step=2)
    assert path.read_text() == "[1]"
    write_atomic(tmp_path / "other.json", b"[3]", step=2)
    assert (tmp_path / "other.json").read_text() == "[3]"
    assert not (tmp_path / "other.json.tmp").exists()
