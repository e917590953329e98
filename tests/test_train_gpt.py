"""helpers.cli.train_gpt: its switches, refusals, schedule, a short run, bit-identical resume, and its runs under
torchrun (DDP and FSDP against one process on the same global batch, a SIGKILLed run resumed)."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import compat
from helpers.checkpoint import read_checkpoint, states_equal
from helpers.cli.train_gpt import NOT_SHAPING, Config, build, lr_factor, main, parse_args, train
from helpers.preemption import PREEMPTED_EXIT_CODE, StopRequest
from helpers.processes import wait_for_lines

ROOT = Path(__file__).resolve().parent.parent
SHARDS_ON_CPU, NO_SHARDING_WHY = compat.fsdp2_runs_on("cpu")


@pytest.fixture(autouse=True)
def corpus_cache(tmp_path_factory, monkeypatch):
    """Every corpus these tests build is cached in a folder of the tests, never in the project's data/."""
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path_factory.getbasetemp() / "data"))


def tiny(text_file: Path, **changes) -> Config:
    """A run of a few seconds: a 2-layer GPT of width 32 at context 32."""
    settings = dict(
        text=str(text_file),
        block_size=32,
        n_layer=2,
        n_head=2,
        n_embd=32,
        batch_size=4,
        steps=12,
        warmup=2,
        log_every=4,
        eval_every=6,
        eval_batches=2,
        sample_tokens=0,
        progress=False,
        threads=1,
    )
    return Config(**{**settings, **changes})


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"accumulation": 1.5}, "accumulation must be a positive int"),
        ({"seed": 2**32}, r"seed must be an int in \[0, 4294967295\]"),
        ({"seed": -1}, "seed must be"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"strategy": "zero3"}, "strategy must be one of"),
        ({"lr": 0}, "lr must be a positive number"),
        ({"grad_clip": -1.0}, "grad_clip must be a number in"),
        ({"save_every": 5}, "save_every=5 needs out"),
        ({"dropout": 1.0}, "dropout"),
        ({"global_batch": -8}, "global_batch must be an int >= 0"),
        ({"global_batch": 8, "accumulation": 2}, "accumulation=2 with global_batch=8: give one of them"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(changes, match):
    with pytest.raises(ValueError, match=match):
        Config(**changes)


def test_the_seed_range_ends_at_2_to_the_32_minus_1():
    assert Config(seed=2**32 - 1).seed == 2**32 - 1


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_a_precision_the_cpu_cannot_do_fails_at_once_naming_what_it_offers(text_file, precision):
    with pytest.raises(ValueError, match=rf"precision='{precision}' is not available on cpu; this device offers"):
        build(tiny(text_file, precision=precision), torch.device("cpu"))


def test_pinned_memory_without_a_gpu_is_refused(text_file):
    with pytest.raises(ValueError, match="pin_memory=True speeds up copies to a CUDA GPU"):
        build(tiny(text_file, pin_memory=True), torch.device("cpu"))


def test_compiling_where_the_compiler_gets_the_gradients_wrong_is_refused(text_file, monkeypatch):
    monkeypatch.setattr(compat, "compiled_gpt_gradients_right", lambda device_type: (False, "torch 2.6's compiler"))
    with pytest.raises(ValueError, match="compile=True: torch 2.6's compiler"):
        build(tiny(text_file, compile=True), torch.device("cpu"))


def test_help_documents_every_switch(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(Config):
        assert f"--{field.name.replace('_', '-')}" in shown
    assert "lesson 06" in shown and "lesson 10" in shown and "lesson 13" in shown
    from helpers.cli.options import field_comments

    assert set(field_comments(Config)) == {field.name for field in dataclasses.fields(Config)}  # each has its help


def test_the_command_line_gives_the_config_and_refuses_a_bad_value(capsys):
    config = parse_args(["--precision", "bf16", "--compile", "--steps", "7", "--text", "a.txt", "--threads", "2"])
    assert (config.precision, config.compile, config.steps, config.text, config.threads) == (
        "bf16",
        True,
        7,
        "a.txt",
        2,
    )
    with pytest.raises(SystemExit):
        parse_args(["--batch-size", "0"])
    assert "batch_size must be a positive int, got 0" in capsys.readouterr().err


def test_a_global_batch_sets_the_accumulation_for_each_world_size_and_frees_the_resume_from_it(text_file):
    config = tiny(text_file, batch_size=4, global_batch=16)
    assert [config.accumulation_on(ranks) for ranks in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ValueError, match="global_batch=16 is not a whole number of micro-batches of batch_size=4 on 3"):
        config.accumulation_on(3)
    assert config.recorded(1) == config.recorded(2) and "world_size" not in config.recorded(2)
    plain = tiny(text_file, batch_size=4, accumulation=2)
    assert plain.accumulation_on(4) == 2 and plain.recorded(2)["world_size"] == 2 != plain.recorded(1)["world_size"]
    run = build(config, torch.device("cpu"))
    assert run.accumulation == 4 and run.tokens_per_step == 16 * config.block_size


def test_warm_up_then_cosine_to_min_lr():
    config = Config(steps=100, warmup=10, lr=1e-3, min_lr=1e-4)
    assert lr_factor(0, config) == pytest.approx(0.1)
    assert lr_factor(9, config) == pytest.approx(1.0)  # the last warm-up step reaches the peak
    assert lr_factor(10, config) == pytest.approx(1.0)  # the cosine starts at the peak
    assert lr_factor(55, config) == pytest.approx(0.55)  # half-way down: the middle of peak and floor
    assert lr_factor(100, config) == pytest.approx(0.1)  # the floor, min_lr / lr
    assert lr_factor(10_000, config) == pytest.approx(0.1)
    assert lr_factor(0, Config(warmup=0)) == pytest.approx(1.0)


def test_shaping_settings_leave_out_only_where_and_how_a_run_reports():
    shaping = Config().shaping()
    assert set(shaping) | set(NOT_SHAPING) == {field.name for field in dataclasses.fields(Config)}
    assert {"seed", "precision", "compile", "steps", "batch_size", "accumulation"} <= set(shaping)


def test_a_short_run_learns_logs_evaluates_and_writes_its_files(text_file, tmp_path, capsys):
    result = train(tiny(text_file, out=str(tmp_path), save_every=6, sample_tokens=20))
    history = result["history"]
    assert len(history["losses"]) == 12 and [row["step"] for row in history["log"]] == [4, 8, 12]
    assert [row["step"] for row in history["evals"]] == [6, 12]
    assert history["losses"][-1] < history["losses"][0]
    assert all(row["tokens_per_s"] > 0 and row["mfu"] > 0 for row in history["log"])
    assert history["evals"][-1]["tokens"] == 12 * 4 * 32
    assert len(history["sample"]) >= 4  # 'def ' and what followed, decoded
    shown = capsys.readouterr().out
    assert "unigram baseline" in shown and "tokens/s" in shown and "MFU" in shown
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000006.pt", "step-00000012.pt"]
    assert json.loads((tmp_path / "history.json").read_text())["losses"] == history["losses"]
    assert any((tmp_path / "tensorboard").iterdir())


def test_a_run_resumed_from_its_checkpoint_ends_bit_identical(text_file, tmp_path, one_thread):
    config = tiny(text_file, out=str(tmp_path), save_every=6, dropout=0.1, accumulation=2)
    straight = train(config)["history"]
    final = tmp_path / "checkpoints" / "step-00000012.pt"
    reference = read_checkpoint(final)
    final.unlink()  # as if the run had been stopped after step 6
    resumed = train(config)["history"]
    assert resumed["start"] == 6
    assert resumed["losses"] == straight["losses"][6:]
    again = read_checkpoint(final)
    for part in ("model", "optimizer", "scheduler", "scaler"):
        assert states_equal(again[part], reference[part]), part


class StopAfter(StopRequest):
    """A stop request that comes in during step `step` (as a SIGTERM would)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.calls = step, 0

    def agreed(self, device="cpu") -> bool:
        self.calls += 1
        return self.calls >= self.step


def test_a_stop_request_saves_after_its_step_and_the_next_launch_resumes_bit_identical(text_file, tmp_path, one_thread):
    config = tiny(text_file, out=str(tmp_path / "stopped"), save_every=100, dropout=0.1)
    straight = train(dataclasses.replace(config, out=str(tmp_path / "straight")))["history"]
    stopped = train(config, stop=StopAfter(5))["history"]
    assert stopped["preempted_at"] == 5 and len(stopped["losses"]) == 5 and "sample" not in stopped
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["step-00000005.pt"]
    resumed = train(config)["history"]
    assert resumed["start"] == 5 and resumed["losses"] == straight["losses"][5:]
    final = [read_checkpoint(tmp_path / name / "checkpoints" / "step-00000012.pt") for name in ("straight", "stopped")]
    for part in ("model", "optimizer", "scheduler", "scaler"):
        assert states_equal(final[0][part], final[1][part]), part


def test_a_stop_request_without_a_checkpoint_folder_says_the_run_is_lost(text_file, capsys):
    history = train(tiny(text_file), stop=StopAfter(3))["history"]
    assert history["preempted_at"] == 3
    assert "stopped on request after step 3, with no checkpoint" in capsys.readouterr().out


def test_a_folder_holding_a_run_with_other_settings_is_refused(text_file, tmp_path):
    train(tiny(text_file, out=str(tmp_path), save_every=6))
    with pytest.raises(ValueError, match=r"holds a run with other settings \(lr: saved 0.003, asked 0.001\)"):
        train(tiny(text_file, out=str(tmp_path), save_every=6, lr=1e-3))


def test_main_reports_a_bad_setting_as_one_line(text_file, capsys):
    with pytest.raises(SystemExit, match="train_gpt: error: precision='fp16' is not available on cpu"):
        main(["--text", str(text_file), "--precision", "fp16", "--steps", "1", "--no-progress"])


def _command(text_file: Path, *args: str, ranks: int = 0) -> list[str]:
    options = [
        "--text",
        str(text_file),
        "--block-size",
        "32",
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--steps",
        "12",
        "--warmup",
        "2",
        "--log-every",
        "1",
        "--eval-every",
        "6",
        "--eval-batches",
        "2",
        "--sample-tokens",
        "0",
        "--no-progress",
        "--threads",
        "1",
        *args,
    ]
    if not ranks:
        return [sys.executable, "-m", "helpers.cli.train_gpt", *options]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [*launcher, "-m", "helpers.cli.train_gpt", *options]


def _run(command: list[str], env: dict) -> str:
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def _env(tmp_path: Path) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", COURSE_DATA_DIR=str(tmp_path / "data"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.skipif(not SHARDS_ON_CPU, reason=NO_SHARDING_WHY))]
)
def test_two_ranks_give_the_losses_of_one_process_on_the_same_global_batch(text_file, tmp_path, strategy):
    env = _env(tmp_path)
    _run(_command(text_file, "--batch-size", "8", "--out", str(tmp_path / "one")), env)
    _run(_command(text_file, "--strategy", strategy, "--batch-size", "4", "--out", str(tmp_path / "two"), ranks=2), env)
    one, two = (json.loads((tmp_path / name / "history.json").read_text()) for name in ("one", "two"))
    assert two["world_size"] == 2 and len(two["losses"]) == 12
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=0, atol=1e-5)
    evals = [row["val_loss"] for row in one["evals"]], [row["val_loss"] for row in two["evals"]]
    torch.testing.assert_close(torch.tensor(evals[1]), torch.tensor(evals[0]), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_sigterm_at_random_points_saves_exits_75_and_the_next_launch_resumes_bit_identical(text_file, tmp_path):
    env, rng = _env(tmp_path), random.Random(0)
    straight = tmp_path / "straight"
    _run(_command(text_file, "--out", str(straight), "--save-every", "100", "--dropout", "0.1"), env)
    reference = read_checkpoint(straight / "checkpoints" / "step-00000012.pt")
    for attempt in range(2):
        folder = tmp_path / f"stopped-{attempt}"
        command = _command(text_file, "--out", str(folder), "--save-every", "100", "--dropout", "0.1")
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            assert wait_for_lines(process, "step ", count=rng.randint(1, 8))  # --log-every 1: a line per step
            process.send_signal(signal.SIGTERM)
            output = process.communicate(timeout=60)[0]
        finally:
            process.kill()
        if process.returncode == 0:  # the signal came after the last step: nothing to resume
            continue
        assert process.returncode == PREEMPTED_EXIT_CODE, output[-2000:]
        assert "stopped on request after step" in output
        again = _run(command, env)
        assert "resumed at step" in again
        final = read_checkpoint(folder / "checkpoints" / "step-00000012.pt")
        for part in ("model", "optimizer", "scheduler", "scaler"):
            assert states_equal(final[part], reference[part]), part


@pytest.mark.slow
def test_a_run_killed_with_sigkill_and_started_again_ends_bit_identical(text_file, tmp_path):
    env = _env(tmp_path)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _run(_command(text_file, "--out", str(straight), "--save-every", "3", "--dropout", "0.1"), env)
    command = _command(text_file, "--out", str(killed), "--save-every", "3", "--dropout", "0.1")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for_lines(process, "saved step", count=2)  # steps 3 and 6 are on disk
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    output = _run(command, env)
    assert "resumed at step" in output
    reference, again = (read_checkpoint(folder / "checkpoints" / "step-00000012.pt") for folder in (straight, killed))
    for part in ("model", "optimizer", "scheduler", "scaler"):
        assert states_equal(again[part], reference[part]), part
