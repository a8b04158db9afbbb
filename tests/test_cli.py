"""The ``csa-eqx`` command: a short training run with resume, inspect, and argument errors."""

import io
import json
import os
import subprocess
import sys

import pytest
from child_env import child_env
from demo_helpers import tiny_config

from csa_eqx.demo.checkpoint import read_checkpoint
from csa_eqx.demo.cli import _simulated_devices, main, summary
from csa_eqx.demo.train import TrainConfig, targets_met, train


def test_train_smoke_resume_and_controls(tmp_path):
    # one CSA layer (the layer kinds' training is tested in the layer tests): the main run's
    # programs (8 devices) are those of test_train_faults' uninterrupted `csa-eqx train
    # --devices=8` run, which `make test`'s compilation cache then serves; both controls
    cfg = tiny_config("--layers=csa", name="smoke")
    run = tmp_path / "smoke"
    partial = train(cfg, run, io.StringIO(), stop_after=4)
    assert not partial["finished"] and partial["step"] == 4 and partial["controls"] == {}
    header, _ = read_checkpoint(run / "checkpoint.eqx")
    assert (header["step"], header["phase"]) == (4, "warmup")  # the phase of step 4's optimizer
    out = io.StringIO()
    report = train(cfg, run, out)  # resumes from step 4, then runs the controls
    assert report["finished"] and report["step"] == cfg.total_steps
    saved = json.loads((run / "report.json").read_text())
    for key in ("retrieval_accuracy", "indexer_recall", "wall_seconds", "config", "history"):
        assert key in saved
    assert 0.0 <= saved["retrieval_accuracy"] <= 1.0 and 0.0 <= saved["indexer_recall"] <= 1.0
    assert saved["targets_met"] == targets_met(saved)
    assert saved["config"]["seq_len"] == 64
    history = saved["history"]  # one record per step, with the loss, KL and batch accuracy
    assert [h["step"] for h in history] == list(range(1, cfg.total_steps + 1))
    assert [h["phase"] for h in history] == ["dense"] * 2 + ["warmup"] * 2 + ["sparse"] * 2
    assert all({"ce", "kl", "accuracy", "seq_len"} <= set(h) for h in history)
    assert [h["step"] for h in history if "retrieval_accuracy" in h] == [3, 6]
    for plot in ("loss.png", "recall.png", "selections.png", "controls.png"):
        assert (run / plot).stat().st_size > 1000
    assert f"{cfg.total_steps}/{cfg.total_steps}" in out.getvalue()
    controls = saved["controls"]
    assert set(controls) == {"sliding", "dense"}
    sliding = json.loads((run / "control-sliding" / "report.json").read_text())
    assert sliding["config"]["variant"] == "sliding" and sliding["indexer_recall"] is None
    assert controls["sliding"]["retrieval_accuracy"] == sliding["retrieval_accuracy"]
    dense = json.loads((run / "control-dense" / "report.json").read_text())
    assert len(dense["history"]) == len(history)  # the same budget
    assert 0.0 <= controls["dense"]["indexer_recall"] <= 1.0


# XLA's CPU pools once the backend runs, in a process that asked for 4 devices as `train` does
POOLS = """
import os, sys
from csa_eqx.demo.cli import _simulated_devices
_simulated_devices(4)
import jax
assert jax.device_count() == 4
names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
print(sum("XLAEigen" in name for name in names))
"""


def test_train_gives_xlas_cpu_pool_room_for_concurrent_collectives(monkeypatch):
    # a pool of one thread per device deadlocks (see ``_simulated_devices``)
    env = child_env(JAX_PLATFORMS="cpu")
    env.pop("PJRT_NPROC", None)
    out = subprocess.run(
        [sys.executable, "-c", POOLS], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout) == max(os.cpu_count(), 16)
    monkeypatch.setenv("PJRT_NPROC", "6")  # one the user sized is kept
    _simulated_devices(4)  # (this process's backend runs: its devices stay as they are)
    assert os.environ["PJRT_NPROC"] == "6"


def test_summary_says_whether_the_targets_were_met(tmp_path):
    report = {"retrieval_accuracy": 0.95, "indexer_recall": 0.5, "wall_seconds": 3.0}
    report["controls"] = {"sliding": {"retrieval_accuracy": 0.06}}
    report["targets_met"] = targets_met(report)
    text = summary(report, tmp_path)
    assert "control sliding: retrieval_accuracy=0.060" in text
    assert text.splitlines()[-1] == (
        "targets NOT met (retrieval_accuracy >= 0.9, indexer_recall >= 0.9)"
    )
    report.update(indexer_recall=0.9, targets_met=True)
    assert summary(report, tmp_path).endswith(
        "targets met (retrieval_accuracy >= 0.9, indexer_recall >= 0.9)"
    )


def test_control_configs():
    cfg = TrainConfig(layers=("csa", "sliding", "hca"))
    sliding = cfg.model_config().layers, cfg.control("sliding").model_config().layers
    assert sliding == (("csa", "sliding", "hca"), ("sliding",) * 3)
    dense = cfg.control("dense")
    assert [dense.stage(p) for p in ("dense", "warmup", "sparse")] == ["dense"] * 3
    assert [cfg.stage(p) for p in ("dense", "warmup", "sparse")] == ["dense", "dense", "sparse"]
    assert (dense.seq_len_at(10), dense.total_steps) == (cfg.seq_len_at(10), cfg.total_steps)
    v41 = TrainConfig(family="v41")  # the family's default schedule
    assert v41.model_config().layers == ("full", "sliding", "reindex")
    assert v41.control("sliding").model_config().layers == ("sliding",) * 3
    with pytest.raises(ValueError, match="has no controls of its own"):
        TrainConfig(variant="dense")
    with pytest.raises(ValueError, match="controls must be distinct names"):
        TrainConfig(controls=("sliding", "sliding"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--seq-len", "0"], "positive"),
        (["train", "--mesh", "3"], "DATAxTENSOR"),
        (["train", "--dense-steps", "-1"], ">= 0"),
        (["train", "--mesh", "0x2"], "0x0"),
        (["train", "--lr", "-1"], "argument --lr: learning rate must be a finite positive"),
        (["train", "--lr", "0"], "argument --lr: learning rate must be a finite positive"),
        (["train", "--lr", "nan"], "argument --lr: learning rate must be a finite positive"),
        (["train", "--lr", "inf"], "argument --lr: learning rate must be a finite positive"),
        (["train", "--name", "../../x"], "argument --name: run name must be one folder name"),
        (["train", "--name", "/tmp/x"], "argument --name: run name must be one folder name"),
        (["train", "--name", ".."], "argument --name: run name must be one folder name"),
        (["train", "--name", ""], "argument --name: run name must be one folder name"),
        (["train", "--controls", "full"], "argument --controls: controls must be 'none' or"),
        (["train", "--family", "v5"], "argument --family: must be one of v4, v41"),
        (["inspect", "--preset", "v5"], "invalid choice"),
        (["inspect", "--layer", "mla"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "40", "--pairs", "16", "--keys", "16"], "seq_len=40"),
        (["--pairs", "8", "--keys", "4"], "n_keys"),
        (["--pairs", "4", "--keys", "16"], "start_seq_len=32 is too short: seq_len=32 leaves"),
    ],
)
def test_train_reports_bad_config(argv, message, tmp_path, capsys):
    assert main(["train", "--runs", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_inspect(capsys):
    assert main(["inspect", "--layer", "hca", "--preset", "tiny", "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "compressor.kv_proj" in out and "forward+backward" in out and "total" in out


def test_inspect_v4_pro_uses_the_released_sizes():
    from csa_eqx.demo.inspect import layer_for

    layer = layer_for("csa", "v4-pro")
    assert (layer.config.hidden_size, layer.config.num_heads, layer.config.index_topk) == (
        7168,
        128,
        1024,
    )
    assert layer_for("hca", "tiny").config.compress_rate == 8
    assert layer_for("dsa", "v4-pro").config.index_topk == 2048  # DeepSeek-V3.2's own sizes


def test_bench_outside_a_checkout_names_what_is_missing(tmp_path, capsys):
    assert main(["bench", "--quick", "--repo", str(tmp_path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no benchmarks/run_all.py in {tmp_path}" in err and "--repo" in err


def test_bench_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "out").write_text("a file")
    assert main(["bench", "--quick", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write to the folder {tmp_path / 'out'}" in err and "(--out)" in err


@pytest.mark.parametrize("command", ["train", "bench"])
def test_without_the_demo_extra_says_how_to_install_it(command, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "optax" else real(name, *a)
    )
    assert main([command]) == 2
    err = capsys.readouterr().err
    assert (
        f"csa-eqx {command}: error: needs the demo extra (missing: optax)" in err
        and "pip install 'csa_eqx[demo]'" in err
    )
