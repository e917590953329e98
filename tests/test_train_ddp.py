"""helpers.cli.train_ddp under `torchrun --standalone --nproc_per_node=2`: rank-0 logs, plain checkpoint, twin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import compat
from helpers.checkpoint import load_checkpoint
from helpers.cli.train_ddp import main, parse_args
from helpers.models import MLP
from helpers.workers.common import TrainConfig, mlp, train_validation_split
from helpers.workers.training import train_one_process

# FSDP2 on CPU ranks needs torch 2.7 (helpers.compat); on the floor torch these run where a GPU per rank exists
SHARDS_ON_CPU, NO_SHARDING_WHY = compat.fsdp2_runs_on("cpu")
needs_fsdp2_on_cpu = pytest.mark.skipif(not SHARDS_ON_CPU, reason=NO_SHARDING_WHY)

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(*args: str) -> list[str]:
    """The `torchrun` next to this Python (the virtual environment's), else `python -m torch.distributed.run`."""
    script = Path(sys.executable).with_name("torchrun")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc_per_node=2", "-m", "helpers.cli.train_ddp", *args]


@pytest.mark.slow
def test_torchrun_two_ranks_trains_logs_once_and_saves_a_plain_checkpoint(tmp_path):
    epochs, batch, seed = 2, 16, 3
    env = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(
        _torchrun(
            "--epochs",
            str(epochs),
            "--batch-size",
            str(batch),
            "--seed",
            str(seed),
            "--lr",
            "0.05",
            "--out",
            str(tmp_path),
            "--no-progress",
        ),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    lines = completed.stdout.splitlines()
    assert sum(line.startswith("epoch ") for line in lines) == epochs  # rank 0 only, not once per rank
    assert any(line.startswith("world_size=2 backend=gloo") for line in lines) or torch.cuda.device_count() >= 2

    checkpoint = torch.load(tmp_path / "model.pt", map_location="cpu", weights_only=True)
    assert not any(key.startswith("module.") for key in checkpoint["model"])
    model = MLP(64, (64,), 10)
    model.load_state_dict(checkpoint["model"])  # strict
    assert checkpoint["epoch"] == epochs and "state" in checkpoint["optimizer"]
    loaded = load_checkpoint(tmp_path / "model.pt", MLP(64, (64,), 10), restore_rng=False)  # the course's loader
    assert loaded["epoch"] == epochs and loaded["extra"]["world_size"] == 2

    record = json.loads((tmp_path / "history.json").read_text())
    assert record["world_size"] == 2 and len(record["history"]) == epochs
    train_size, val_size = (len(part) for part in train_validation_split(seed))
    assert record["history"][-1]["samples_seen"] == 2 * -(-train_size // 2)  # the training split, padded to even

    # The same run in one process, on the same global batches, ends in the same place.
    twin_history, twin = train_one_process(TrainConfig(epochs=epochs, batch_size=batch, seed=seed, lr=0.05), 2)
    twin_accuracies = [row["val_accuracy"] for row in twin_history]
    for name, value in twin.state_dict().items():
        torch.testing.assert_close(checkpoint["model"][name], value, rtol=1e-4, atol=1e-5)
    assert twin_accuracies == pytest.approx([row["val_accuracy"] for row in record["history"]], abs=2 / val_size)


def test_plain_python_trains_as_a_world_of_one(tmp_path, capsys):
    watched = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {key: os.environ.get(key) for key in watched}
    seed = 2**32 - 1  # the largest seed a notebook accepts
    main(["--epochs", "1", "--batch-size", "64", "--seed", str(seed), "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert "world_size=1" in out and "epoch 1:" in out
    assert {key: os.environ.get(key) for key in watched} == before  # nothing leaked into this process
    state = torch.load(tmp_path / "model.pt", map_location="cpu", weights_only=True)["model"]
    MLP(64, (64,), 10).load_state_dict(state)
    start = mlp(seed, TrainConfig().hidden).state_dict()
    assert any(not torch.equal(state[name], value) for name, value in start.items())  # it trained


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epochs", "0"], "epochs must be a positive int"),
        (["--batch-size", "-2"], "batch_size must be a positive int"),
        (["--lr", "0"], "lr must be a positive number"),
        (["--momentum", "1.5"], "momentum must be a number in [0, 1)"),
        (["--backend", "udp"], "invalid choice"),
        (["--strategy", "zero3"], "invalid choice"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_strategy_is_part_of_the_config_defaults_to_ddp_and_is_checked_once():
    config, overwrite = parse_args(["--epochs", "2"])
    assert config.strategy == "ddp" and config.epochs == 2 and not overwrite
    assert parse_args(["--strategy", "fsdp"])[0].strategy == "fsdp"
    with pytest.raises(ValueError, match="strategy must be one of \\['ddp', 'fsdp'\\], got 'zero3'"):
        TrainConfig(strategy="zero3")  # refused before any process group is joined


def test_a_folder_holding_another_run_is_refused_naming_the_settings(tmp_path):
    main(["--epochs", "1", "--batch-size", "64", "--seed", "5", "--out", str(tmp_path), "--no-progress"])
    with pytest.raises(SystemExit, match=r"seed: the folder's 5, asked 9\): pass --overwrite"):
        main(["--epochs", "1", "--batch-size", "64", "--seed", "9", "--out", str(tmp_path), "--no-progress"])
    with pytest.raises(SystemExit, match=r"epochs: the folder's 1, asked 2"):
        main(["--epochs", "2", "--batch-size", "64", "--seed", "5", "--out", str(tmp_path), "--no-progress"])
    main(["--epochs", "1", "--batch-size", "64", "--seed", "5", "--out", str(tmp_path), "--no-progress"])  # the same
    main(["--epochs", "1", "--batch-size", "64", "--seed", "9", "--out", str(tmp_path), "--no-progress", "--overwrite"])
    assert json.loads((tmp_path / "history.json").read_text())["config"]["seed"] == 9


@pytest.mark.slow
@needs_fsdp2_on_cpu
def test_torchrun_two_ranks_with_fsdp_saves_a_whole_model_that_matches_the_twin(tmp_path):
    epochs, batch, seed = 1, 16, 3
    args = ["--strategy", "fsdp", "--epochs", str(epochs), "--batch-size", str(batch), "--seed", str(seed)]
    completed = subprocess.run(
        _torchrun(*args, "--out", str(tmp_path), "--no-progress"),
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-3000:]
    lines = completed.stdout.splitlines()
    assert sum(line.startswith("epoch ") for line in lines) == epochs
    assert any(line.startswith("world_size=2 ") and "strategy=fsdp" in line for line in lines)

    checkpoint = torch.load(tmp_path / "model.pt", map_location="cpu", weights_only=True)
    MLP(64, (64,), 10).load_state_dict(checkpoint["model"])  # strict: whole tensors, plain names
    assert sorted(checkpoint["optimizer"]["state"]) == [0, 1, 2, 3]  # SGD's momentum, whole, for a plain optimizer
    loaded = load_checkpoint(tmp_path / "model.pt", MLP(64, (64,), 10), restore_rng=False)
    assert loaded["extra"]["strategy"] == "fsdp" and loaded["extra"]["world_size"] == 2
    assert json.loads((tmp_path / "history.json").read_text())["strategy"] == "fsdp"

    _, twin = train_one_process(TrainConfig(epochs=epochs, batch_size=batch, seed=seed), 2)
    for name, value in twin.state_dict().items():
        torch.testing.assert_close(checkpoint["model"][name], value, rtol=1e-4, atol=1e-5)


def test_train_validation_split_is_disjoint_complete_and_seeded():
    train, val = train_validation_split(5)
    assert sorted(train.indices + val.indices) == list(range(1347)) and len(val) == 269  # 20% of 1347 digits
    assert train_validation_split(5)[1].indices == val.indices != train_validation_split(6)[1].indices


def test_train_config_checks_hidden_widths():
    with pytest.raises(ValueError, match="hidden must be a non-empty tuple of positive ints"):
        TrainConfig(hidden=(0,))


def test_train_one_process_follows_the_global_batches_and_restores_threads():
    config = TrainConfig(epochs=2, batch_size=16, seed=2**32 - 1)
    threads = torch.get_num_threads()
    history, model = train_one_process(config, 2, threads=1)
    assert torch.get_num_threads() == threads
    assert [row["epoch"] for row in history] == [1, 2] and all(0 <= row["val_accuracy"] <= 1 for row in history)
    again, same = train_one_process(config, 2)
    assert [row["val_accuracy"] for row in again] == [row["val_accuracy"] for row in history]
    for name, value in same.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[name])  # thread count: rounding at most
    _, nudged = train_one_process(config, 2, nudge=0.5)
    assert not torch.allclose(nudged.state_dict()["1.weight"], model.state_dict()["1.weight"])
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        train_one_process(config, 0)


def test_train_one_process_restores_the_thread_count_when_training_fails(monkeypatch):
    from helpers.workers import training

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    threads = torch.get_num_threads()
    monkeypatch.setattr(training, "train_epoch", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        train_one_process(TrainConfig(epochs=1), 2, threads=threads + 1)
    assert torch.get_num_threads() == threads
