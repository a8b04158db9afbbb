"""The ``csa-eqx`` command: a short training run with resume, inspect, and argument errors."""

import io
import json

import pytest

from csa_eqx.demo.checkpoint import read_checkpoint
from csa_eqx.demo.cli import main
from csa_eqx.demo.train import TrainConfig, train

TINY = dict(
    seq_len=96,
    start_seq_len=96,
    batch_size=4,
    n_pairs=4,
    n_keys=4,
    dense_steps=3,
    warmup_steps=2,
    sparse_steps=3,
    index_topk=4,
    sliding_window=8,
    hidden_size=32,
    eval_every=2,
    eval_batches=1,
    checkpoint_every=2,
)


def test_train_smoke_and_resume(tmp_path):
    cfg = TrainConfig(name="smoke", **TINY)
    partial = train(cfg, tmp_path / "smoke", io.StringIO(), stop_after=4)
    assert not partial["finished"] and partial["step"] == 4
    header, _ = read_checkpoint(tmp_path / "smoke" / "checkpoint.eqx")
    assert (header["step"], header["phase"]) == (4, "warmup")  # the phase of step 4's optimizer
    out = io.StringIO()
    report = train(cfg, tmp_path / "smoke", out)  # resumes from step 4
    assert report["finished"] and report["step"] == cfg.total_steps
    saved = json.loads((tmp_path / "smoke" / "report.json").read_text())
    for key in ("retrieval_accuracy", "indexer_recall", "wall_seconds", "config", "history"):
        assert key in saved
    assert 0.0 <= saved["retrieval_accuracy"] <= 1.0 and 0.0 <= saved["indexer_recall"] <= 1.0
    assert saved["config"]["seq_len"] == 96
    steps = [h["step"] for h in saved["history"]]
    assert steps == sorted(set(steps)) and steps[-1] == cfg.total_steps
    assert {h["phase"] for h in saved["history"]} == {"dense", "warmup", "sparse"}
    for plot in ("loss.png", "recall.png", "selections.png"):
        assert (tmp_path / "smoke" / plot).stat().st_size > 1000
    assert f"{cfg.total_steps}/{cfg.total_steps}" in out.getvalue()


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
