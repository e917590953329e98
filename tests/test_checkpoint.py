"""helpers.checkpoint and helpers.cli.resume: atomic saves, safe checked loads, exact resume, SIGKILL at any moment."""

import contextlib
import os
import pickle
import queue
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import REFERENCE_RUN as RUN
from helpers import checkpoint as ckpt
from helpers.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ResumableSampler,
    capture_rng_state,
    load_checkpoint,
    read_checkpoint,
    restore_rng_state,
    save_checkpoint,
    unwrap_model,
)
from helpers.cli.resume import train
from helpers.distributed import teardown_process_group
from helpers.models import MLP

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "helpers.cli.resume"]


def _training_objects(seed: int = 0, hidden=(32,)):
    torch.manual_seed(seed)
    model = MLP(64, hidden, 10, dropout=0.2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    return model, optimizer, scheduler, scaler


def _one_step(model, optimizer, scheduler):
    loss = nn.functional.cross_entropy(model(torch.rand(8, 64)), torch.randint(0, 10, (8,)))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def test_public_states_equal_compares_nested_optimizer_states_bit_for_bit():
    model, optimizer, scheduler, _ = _training_objects()
    _one_step(model, optimizer, scheduler)
    state = optimizer.state_dict()
    copied = pickle.loads(pickle.dumps(state))
    assert ckpt.states_equal(state, copied) and ckpt.states_equal([1, (2.0, "a")], [1, [2.0, "a"]])
    copied["state"][0]["exp_avg"][0] += 1.0
    assert not ckpt.states_equal(state, copied)
    assert not ckpt.states_equal({"w": torch.ones(2)}, {"w": [1.0, 1.0]})  # a tensor equals only a tensor
    assert not ckpt.states_equal([1, 2], [1, 2, 3]) and not ckpt.states_equal({"a": 1}, {"b": 1})
    assert not ckpt.states_equal({"w": torch.ones(3)}, {"w": torch.tensor([1.0, 1.0, 1.0 + 1e-7])})
    if torch.cuda.is_available():  # a GPU checkpoint's tensors against the CPU's
        assert ckpt.states_equal({"w": torch.ones(3).cuda()}, {"w": torch.ones(3)})


def _optimizer_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa["param_groups"] == sb["param_groups"] and all(
        ckpt.states_equal(sa["state"][i], sb["state"][i]) for i in sa["state"]
    )


# ------------------------------------------------------------------------------------------- unwrapping


def test_unwrap_model_strips_data_parallel_and_compile_wrappers():
    model = MLP(64, (8,), 10)
    assert unwrap_model(model) is model
    assert unwrap_model(nn.DataParallel(model)) is model
    compiled = torch.compile(model)
    assert unwrap_model(compiled) is model
    assert unwrap_model(torch.compile(nn.DataParallel(model))) is model
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())  # what saving the wrapper would store


def test_unwrap_model_strips_distributed_data_parallel(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = MLP(64, (8,), 10)
        ddp = nn.parallel.DistributedDataParallel(model)
        assert unwrap_model(ddp) is model
        path = save_checkpoint(tmp_path / "ddp.pt", ddp)
        keys = list(read_checkpoint(path)["model"])
        assert keys and not any(k.startswith("module.") for k in keys)
    finally:
        teardown_process_group()  # a barrier first: torch 2.6's gloo may hang without one


def test_unwrap_model_rejects_non_modules():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        unwrap_model("model")


# -------------------------------------------------------------------------------------- save and load


def test_round_trip_restores_every_part_and_every_random_stream(tmp_path):
    model, optimizer, scheduler, scaler = _training_objects(0)
    for _ in range(3):
        _one_step(model, optimizer, scheduler)
    generator = torch.Generator().manual_seed(5)
    torch.rand(3, generator=generator)
    path = save_checkpoint(
        tmp_path / "run.pt",
        torch.compile(model),
        optimizer,
        scheduler,
        scaler,
        epoch=2,
        step=3,
        metric=0.25,
        generator=generator,
        extra={"note": "hi", "values": [1, 2.5]},
    )
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(4), torch.rand(4, generator=generator))
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}

    fresh_model, fresh_optimizer, fresh_scheduler, fresh_scaler = _training_objects(1)
    fresh_generator = torch.Generator().manual_seed(99)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = load_checkpoint(
        path, fresh_model, fresh_optimizer, fresh_scheduler, fresh_scaler, generator=fresh_generator
    )
    draws = (random.random(), float(np.random.rand()), torch.rand(4), torch.rand(4, generator=fresh_generator))

    assert (state["epoch"], state["step"], state["metric"]) == (2, 3, 0.25)
    assert state["extra"] == {"note": "hi", "values": [1, 2.5]}
    assert ckpt.states_equal(fresh_model.state_dict(), expected_model)
    assert _optimizer_states_equal(fresh_optimizer, optimizer)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_scaler.state_dict() == scaler.state_dict()
    assert draws[:2] == expected_draws[:2]
    assert torch.equal(draws[2], expected_draws[2]) and torch.equal(draws[3], expected_draws[3])


def test_rng_state_round_trips_on_its_own():
    generator = torch.Generator().manual_seed(0)
    state = capture_rng_state(generator)
    first = (random.random(), np.random.randn(), torch.randn(2), torch.randn(2, generator=generator))
    restore_rng_state(state, generator)
    second = (random.random(), np.random.randn(), torch.randn(2), torch.randn(2, generator=generator))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    with pytest.raises(ValueError, match="holds none"):
        restore_rng_state(capture_rng_state(), generator)


def test_saved_keys_have_no_wrapper_prefix_and_prefixed_files_still_load(tmp_path):
    model = MLP(64, (8,), 10)
    path = save_checkpoint(tmp_path / "a.pt", nn.DataParallel(torch.compile(model)))
    assert list(read_checkpoint(path)["model"]) == list(model.state_dict())
    # A file someone else wrote from a DDP model: every key starts with "module.".
    payload = read_checkpoint(path)
    payload["model"] = {f"module.{k}": v for k, v in payload["model"].items()}
    torch.save(payload, tmp_path / "prefixed.pt")
    other = MLP(64, (8,), 10)
    load_checkpoint(tmp_path / "prefixed.pt", other)
    assert ckpt.states_equal(other.state_dict(), model.state_dict())


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    model = MLP(64, (8,), 10)
    path = save_checkpoint(tmp_path / "run.pt", model, step=1)
    before = path.read_bytes()

    def broken_save(obj, handle):
        handle.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, model, step=2)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt"]


def test_the_temporary_file_is_flushed_and_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """A rename before the data reaches the disk can leave a renamed but empty file after a power cut."""
    calls: list[str] = []
    real_open, real_fsync, real_replace = ckpt._open_new, os.fsync, os.replace

    class Recorded:
        def __init__(self, handle) -> None:
            self.handle = handle

        def write(self, data) -> int:
            calls.append("write")
            return self.handle.write(data)

        def flush(self) -> None:
            calls.append("flush")
            self.handle.flush()

        def fileno(self) -> int:
            return self.handle.fileno()

        def __enter__(self):
            return self

        def __exit__(self, *exc_info) -> None:
            self.handle.close()

    def fsync(fd: int) -> None:
        calls.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(source, target) -> None:
        calls.append("replace")
        real_replace(source, target)

    monkeypatch.setattr(ckpt, "_open_new", lambda temp: Recorded(real_open(temp)))
    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    monkeypatch.setattr(ckpt.os, "replace", replace)
    save_checkpoint(tmp_path / "run.pt", MLP(64, (8,), 10))
    last_write, file_sync = max(i for i, call in enumerate(calls) if call == "write"), calls.index("fsync file")
    assert "flush" in calls[last_write:file_sync], f"not flushed between the last write and the fsync: {calls}"
    assert calls[file_sync:] == ["fsync file", "replace", "fsync folder"], calls


def test_save_honours_the_umask_like_a_plain_open(tmp_path):
    path = save_checkpoint(tmp_path / "run.pt", MLP(64, (8,), 10))
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_load_with_map_location_puts_tensors_where_asked(tmp_path):
    model = MLP(64, (8,), 10)
    path = save_checkpoint(tmp_path / "run.pt", model)
    assert all(t.device.type == "cpu" for t in read_checkpoint(path, map_location="cpu")["model"].values())
    assert all(t.device.type == "meta" for t in read_checkpoint(path, map_location="meta")["model"].values())


def test_a_file_labelled_as_saved_on_a_gpu_needs_map_location_without_one(tmp_path):
    from unittest import mock

    model = MLP(64, (8,), 10)
    with mock.patch("torch.serialization.location_tag", lambda storage: "cuda:0"):  # as a GPU run writes them
        path = save_checkpoint(tmp_path / "gpu.pt", model)
    if not torch.cuda.is_available():
        with pytest.raises(
            CheckpointError, match=r"gpu\.pt holds tensors saved on a device this machine does not have"
        ):
            load_checkpoint(path, MLP(64, (8,), 10), map_location=None)
    other = MLP(64, (8,), 10)
    load_checkpoint(path, other)  # map_location="cpu" by default
    assert ckpt.states_equal(other.state_dict(), model.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to save a GPU checkpoint")
def test_a_gpu_checkpoint_loads_on_cpu(tmp_path):
    model, optimizer, _, _ = _training_objects(0)
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loss = model(torch.rand(4, 64, device="cuda")).sum()
    loss.backward()
    optimizer.step()
    path = save_checkpoint(tmp_path / "gpu.pt", model, optimizer)
    cpu_model = MLP(64, (32,), 10, dropout=0.2)
    cpu_optimizer = torch.optim.AdamW(cpu_model.parameters(), lr=0.01)
    load_checkpoint(path, cpu_model, cpu_optimizer, map_location="cpu")
    assert all(torch.equal(a.cpu(), b) for a, b in zip(model.state_dict().values(), cpu_model.state_dict().values()))
    assert all(
        v.device.type == "cpu" for s in cpu_optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )


# --------------------------------------------------------------------------------------- bad files


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt does not exist"):
        load_checkpoint(tmp_path / "nope.pt", MLP())


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "zeroed_middle"])
def test_damaged_files_fail_with_a_clear_error_naming_the_file(tmp_path, damage):
    path = save_checkpoint(tmp_path / "run.pt", MLP(64, (32,), 10))
    data = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(random.Random(0).randbytes(len(data)))
    else:  # wipe the zip directory and the records around it
        path.write_bytes(data[:100] + bytes(len(data) - 200) + data[-100:])
    with pytest.raises(CheckpointError, match=r"run\.pt") as error:
        load_checkpoint(path, MLP(64, (32,), 10))
    assert any(word in str(error.value) for word in ("empty", "truncated or corrupted"))


def test_a_file_that_is_not_a_checkpoint_is_named_as_such(tmp_path):
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"other\.pt was not written by save_checkpoint"):
        load_checkpoint(tmp_path / "other.pt", MLP())


def test_a_checkpoint_of_another_model_lists_keys_and_shapes(tmp_path):
    path = save_checkpoint(tmp_path / "small.pt", MLP(64, (32,), 10))
    with pytest.raises(
        CheckpointError, match=r"small\.pt.*shape mismatches: 1\.weight: file \(32, 64\) vs model \(16, 64\)"
    ):
        load_checkpoint(path, MLP(64, (16,), 10))
    with pytest.raises(
        CheckpointError,
        match=r"missing keys: 4\.weight, 4\.bias, 7\.weight, 7\.bias; unexpected keys: 3\.weight, 3\.bias",
    ):
        load_checkpoint(path, MLP(64, (32, 16), 10, dropout=0.1))
    model = MLP(64, (16,), 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError):
        load_checkpoint(path, model)
    assert ckpt.states_equal(model.state_dict(), before)  # nothing was changed before the error


def test_optimizer_or_generator_that_do_not_fit_are_reported(tmp_path):
    model, optimizer, scheduler, _ = _training_objects(0)
    path = save_checkpoint(tmp_path / "run.pt", model, optimizer)
    other = torch.optim.AdamW([{"params": [model[1].weight]}, {"params": [model[1].bias]}], lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[1].weight.add_(1.0)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"run\.pt: its optimizer state does not fit"):
        load_checkpoint(path, model, other)
    assert ckpt.states_equal(model.state_dict(), changed) and not ckpt.states_equal(changed, before)
    with pytest.raises(CheckpointError, match="holds no scheduler state"):
        load_checkpoint(path, model, optimizer, scheduler)
    with pytest.raises(CheckpointError, match="holds no generator state"):
        load_checkpoint(path, model, generator=torch.Generator())


# ----------------------------------------------------------------------------------------- security


class _Malicious:
    """Unpickling this calls os.mkdir(marker): a stand-in for any code an attacker would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("container", ["torch.save", "plain pickle"])
def test_a_file_whose_pickle_runs_code_is_refused_and_the_code_does_not_run(tmp_path, container):
    marker = tmp_path / "code_ran"
    payload = read_checkpoint(save_checkpoint(tmp_path / "good.pt", MLP(64, (8,), 10)))
    payload["extra"] = {"innocent": _Malicious(marker)}
    path = tmp_path / "evil.pt"
    if container == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as handle:
            pickle.dump({"format": ckpt.FORMAT, "model": {}, "extra": payload["extra"]}, handle, protocol=2)

    with pytest.raises(CheckpointError, match=r"evil\.pt was refused by torch\.load\(weights_only=True\).*mkdir"):
        load_checkpoint(path, MLP(64, (8,), 10))
    assert not marker.exists()
    # The control: the same file opened the old, unsafe way does run the code.
    # A plain pickle is no torch file (RuntimeError), but the code ran while torch was finding that out.
    with contextlib.suppress(RuntimeError):
        torch.load(path, weights_only=False)
    assert marker.exists()


# ------------------------------------------------------------------------------------------ bad args


def test_save_rejects_bad_arguments_early(tmp_path):
    model = MLP(64, (8,), 10)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        save_checkpoint(tmp_path / "a.pt", {"w": 1})
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        save_checkpoint(tmp_path / "a.pt", model, epoch=-1)
    with pytest.raises(ValueError, match="step must be an int >= 0, got 1.5"):
        save_checkpoint(tmp_path / "a.pt", model, step=1.5)
    with pytest.raises(ValueError, match="metric must be a number"):
        save_checkpoint(tmp_path / "a.pt", model, metric=float("nan"))
    with pytest.raises(TypeError, match=r"extra\['fn'\] must hold only"):
        save_checkpoint(tmp_path / "a.pt", model, extra={"fn": lambda: 1})
    assert not any(tmp_path.iterdir())


def test_manager_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep_last must be a positive int, got 0"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="mode must be 'min'"):
        CheckpointManager(tmp_path, mode="avg")


# ------------------------------------------------------------------------------------------ manager


def test_manager_keeps_the_last_k_and_the_best(tmp_path):
    model = MLP(64, (8,), 10)
    manager = CheckpointManager(tmp_path, keep_last=2, mode="min")
    metrics = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.6, 5: 0.4}
    weights = {}
    for step, metric in metrics.items():
        with torch.no_grad():
            model[1].weight.fill_(step)
        weights[step] = model[1].weight.clone()
        manager.save(model, step=step, metric=metric)
    assert [p.name for p in manager.checkpoints()] == ["step-00000004.pt", "step-00000005.pt"]
    assert manager.latest().name == "step-00000005.pt"
    best = read_checkpoint(manager.best())
    assert best["step"] == 2 and best["metric"] == 0.3 and torch.equal(best["model"]["1.weight"], weights[2])
    # A new manager on the same folder remembers the best metric: 0.35 does not replace best.pt, 0.1 does.
    again = CheckpointManager(tmp_path, keep_last=2)
    assert again.best_metric == 0.3
    again.save(model, step=6, metric=0.35)
    assert read_checkpoint(again.best())["step"] == 2
    again.save(model, step=7, metric=0.1)
    assert read_checkpoint(again.best())["step"] == 7 and again.best_metric == 0.1


def test_manager_orders_steps_by_number_beyond_eight_digits(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    model = MLP(64, (8,), 10)
    for step in (99_999_999, 100_000_000, 100_000_001):
        manager.save(model, step=step)
    assert [read_checkpoint(p)["step"] for p in manager.checkpoints()] == [100_000_000, 100_000_001]


def test_manager_mode_max_and_stale_temporary_files(tmp_path):
    (tmp_path / f".step-00000007.pt{ckpt._TEMP_MARK}123-abcd").write_bytes(b"left by a killed save")
    manager = CheckpointManager(tmp_path, mode="max")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    model = MLP(64, (8,), 10)
    manager.save(model, step=1, metric=0.5)
    manager.save(model, step=2, metric=0.7)
    manager.save(model, step=3, metric=0.6)
    assert read_checkpoint(manager.best())["step"] == 2
    assert load_checkpoint(manager.latest(), MLP(64, (8,), 10))["step"] == 3
    assert CheckpointManager(tmp_path / "empty").latest() is None


# ------------------------------------------------------------------------------------ the sampler


def test_resumable_sampler_continues_the_same_order_mid_epoch():
    straight = ResumableSampler(10, seed=0)
    epochs = [list(straight) for _ in range(3)]
    assert sorted(epochs[0]) == list(range(10)) and epochs[0] != epochs[1]
    assert epochs[1] == torch.randperm(10, generator=torch.Generator().manual_seed(0 + 1)).tolist()

    sampler = ResumableSampler(10, seed=0)
    list(sampler)
    iter(sampler)  # the second epoch started; 4 of its samples were used
    state = sampler.state_dict(consumed=4)
    assert state == {"epoch": 1, "offset": 4}
    resumed = ResumableSampler(10, seed=0)
    resumed.load_state_dict(state)
    assert len(resumed) == 6
    assert list(resumed) == epochs[1][4:] and resumed.epoch == 1
    assert list(resumed) == epochs[2] and len(resumed) == 10


def test_resumable_sampler_at_an_epoch_end_starts_the_next_epoch_and_takes_any_seed():
    for seed in (7, 2**32 - 1):
        straight = ResumableSampler(7, seed=seed)
        epochs = [list(straight) for _ in range(2)]
        sampler = ResumableSampler(7, seed=seed)
        assert sampler.state_dict(0) == {"epoch": 0, "offset": 0}  # nothing iterated yet
        list(sampler)
        resumed = ResumableSampler(7, seed=seed)
        resumed.load_state_dict(sampler.state_dict(consumed=7))
        assert list(resumed) == epochs[1]


def test_resumable_sampler_rejects_bad_input():
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        ResumableSampler(0)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        ResumableSampler(3, seed=-1)
    sampler = ResumableSampler(3)
    with pytest.raises(ValueError, match=r"consumed must be an int in \[0, 3\], got 4"):
        sampler.state_dict(4)
    with pytest.raises(ValueError, match="state must be a dict"):
        sampler.load_state_dict({"offset": 1})
    with pytest.raises(ValueError, match=r"offset in \[0, 3\)"):
        sampler.load_state_dict({"epoch": 0, "offset": 3})


def test_train_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        train(tmp_path, steps=0)
    with pytest.raises(ValueError, match="stop_after must be at most steps=5, got 9"):
        train(tmp_path, steps=5, stop_after=9)
    with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\)"):
        train(tmp_path, dropout=1.0)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32\)"):
        train(tmp_path, seed=2**32)


# ----------------------------------------------------------------------------- resume: lose nothing


def _cli(folder: Path) -> list[str]:
    return [
        "--folder",
        str(folder),
        "--steps",
        str(RUN["steps"]),
        "--save-every",
        str(RUN["save_every"]),
        "--seed",
        str(RUN["seed"]),
        "--threads",
        "1",
    ]


def _assert_same_final_state(folder: Path, straight: dict) -> None:
    latest = CheckpointManager(folder).latest()
    assert latest is not None, f"no checkpoint in {folder}"
    final = read_checkpoint(latest)
    assert final["step"] == RUN["steps"]
    assert ckpt.states_equal(final["model"], straight["model"].state_dict()), "weights differ from the straight run"
    optimizer = straight["optimizer"].state_dict()
    assert final["optimizer"]["state"].keys() == optimizer["state"].keys()
    assert all(ckpt.states_equal(final["optimizer"]["state"][i], optimizer["state"][i]) for i in optimizer["state"])
    assert final["scheduler"] == straight["scheduler"].state_dict()
    assert final["scaler"] == straight["scaler"].state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("stop_after, where", [(36, "epoch boundary"), (50, "mid-epoch")])
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path, straight_run, one_thread, stop_after, where):
    first = train(tmp_path, stop_after=stop_after, **RUN)
    assert first["steps_done"] == stop_after
    sampler_state = read_checkpoint(first["manager"].latest())["extra"]["sampler"]
    assert sampler_state == (
        {"epoch": 1, "offset": 0} if where == "epoch boundary" else {"epoch": 1, "offset": (stop_after - 36) * 32}
    )
    del first  # nothing of the first part survives except the files
    done = subprocess.run([*CLI, *_cli(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {stop_after}" in done.stdout
    _assert_same_final_state(tmp_path, straight_run)


def test_extra_saves_do_not_change_the_run(tmp_path, straight_run, one_thread):
    """Saving (and evaluating for the best metric) at other steps must not touch the random streams."""
    other = train(tmp_path, **{**RUN, "save_every": 7})
    assert ckpt.states_equal(other["model"].state_dict(), straight_run["model"].state_dict())


def test_a_resumed_run_differs_when_a_random_state_is_not_restored(tmp_path, straight_run, one_thread):
    """The control: without the global RNG states (dropout masks) the resumed run ends elsewhere."""
    train(tmp_path, stop_after=50, **RUN)
    latest = CheckpointManager(tmp_path).latest()
    payload = read_checkpoint(latest)
    payload["rng"]["torch"] = torch.manual_seed(12345).get_state()
    torch.save(payload, latest)
    resumed = train(tmp_path, **RUN)
    assert resumed["resumed_from"] == 50
    assert not ckpt.states_equal(resumed["model"].state_dict(), straight_run["model"].state_dict())


# ------------------------------------------------------------------------------- SIGKILL at any moment

# Runs helpers.cli.resume, but pauses (and says so) inside its first save: half-way through writing the
# temporary file ("write"), or with the temporary file complete, just before the rename ("rename").
_PAUSING_RUNNER = """
import io, os, sys, time
import torch
import helpers.cli.resume
where, argv = sys.argv[1], sys.argv[2:]
def pause():
    print("PAUSED-IN-SAVE", where, flush=True)
    time.sleep(120)
if where == "write":
    original_save = torch.save
    def half_save(obj, handle):
        buffer = io.BytesIO()
        original_save(obj, buffer)
        handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        handle.flush()
        pause()
    torch.save = half_save
else:
    original_replace = os.replace
    def paused_replace(*args):
        pause()
        return original_replace(*args)
    os.replace = paused_replace
helpers.cli.resume.main(argv)
"""


class _Running:
    """A subprocess whose stdout lines arrive on a queue, so the test can wait for a line with a timeout."""

    def __init__(self, command: list[str]) -> None:
        self.process: subprocess.Popen[str] = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, prefix: str, count: int = 1, timeout: float = 240) -> bool:
        """True once `count` lines starting with `prefix` arrived; False if the process ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                return False
            if line.startswith(prefix):
                count -= 1
                if count == 0:
                    return True
        self.process.kill()
        assert self.process.stderr is not None
        raise AssertionError(
            f"no line starting with {prefix!r} within {timeout} s; stderr: {self.process.stderr.read()}"
        )

    def kill(self) -> bool:
        """SIGKILL (no cleanup of any kind runs); True if the process was still running."""
        alive = self.process.poll() is None
        if alive:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)
        return alive


def _every_checkpoint_loads(folder: Path) -> int:
    """Load each step file and best.pt into fresh objects of the run; return the newest step."""
    files = CheckpointManager(folder).checkpoints()
    assert files, "no checkpoint left after the kill"
    for path in files + sorted(folder.glob("best.pt")):
        model = MLP(64, (64, 64), 10, dropout=0.1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=RUN["steps"])
        load_checkpoint(path, model, optimizer, scheduler, torch.amp.GradScaler("cpu"), generator=torch.Generator())
    return read_checkpoint(files[-1])["step"]


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_a_loadable_checkpoint_and_resume_reaches_the_same_weights(tmp_path, straight_run):
    # The random moments come from a seeded generator: the seed and the moments are printed (pytest shows
    # them when the test fails); rerun with KILL_TEST_SEED=<seed> to pick the same ones.
    seed = int(os.environ.get("KILL_TEST_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    print(f"KILL_TEST_SEED={seed}")
    plain = [*CLI, *_cli(tmp_path)]
    plan = [
        ("random", plain),
        ("write", [sys.executable, "-c", _PAUSING_RUNNER, "write", *_cli(tmp_path)]),
        ("rename", [sys.executable, "-c", _PAUSING_RUNNER, "rename", *_cli(tmp_path)]),
        ("random", plain),
    ]
    newest = 0
    for number, (how, command) in enumerate(plan, 1):
        running = _Running(command)
        if how == "random":
            # After this launch's 1st to 3rd save (so a checkpoint exists and most of the run is still
            # ahead), at a random moment within the next few steps: maybe in training, maybe in a save.
            saves, pause_s = rng.randint(1, 3), rng.uniform(0.0, 0.03)
            print(f"launch {number}: kill after save #{saves} of this launch + {1e3 * pause_s:.1f} ms")
            started = running.wait_for("saved step", count=saves)
            time.sleep(pause_s)
        else:
            print(f"launch {number}: kill while paused in a save ({how})")
            started = running.wait_for("PAUSED-IN-SAVE")
        killed = running.kill()
        context = f"(KILL_TEST_SEED={seed}, launch {number}, {how})"
        assert started, f"the run ended before the moment to kill it {context}: {running.process.stderr.read()}"
        if how != "random":
            assert killed, context
            temporary = [p for p in tmp_path.iterdir() if ckpt._TEMP_MARK in p.name]
            assert temporary, f"the kill was meant to land inside a save {context}"
        step = _every_checkpoint_loads(tmp_path)
        print(f"  killed={killed}; newest loadable checkpoint: step {step}")
        assert step >= newest, context
        newest = step
    finished = subprocess.run(plain, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert not any(ckpt._TEMP_MARK in p.name for p in tmp_path.iterdir())
    _assert_same_final_state(tmp_path, straight_run)


# ------------------------------------------------------------------------------- resume: the run it was asked for


def test_resuming_twice_at_steps_that_are_no_checkpoint_interval_ends_bit_identical(tmp_path, straight_run, one_thread):
    """Stops at 23 and 47 (not multiples of save_every, one mid-epoch in each epoch): each stop saves its step, and
    each resume continues from that step's sample, not from the epoch's start."""
    first = train(tmp_path, stop_after=23, **RUN)
    assert read_checkpoint(first["manager"].latest())["step"] == 23  # the stop's own save, not step 20's
    second = train(tmp_path, stop_after=47, **RUN)
    assert second["resumed_from"] == 23 and read_checkpoint(second["manager"].latest())["step"] == 47
    assert read_checkpoint(second["manager"].latest())["extra"]["sampler"] == {"epoch": 1, "offset": (47 - 36) * 32}
    last = train(tmp_path, **RUN)
    assert last["resumed_from"] == 47 and last["steps_done"] == RUN["steps"]
    assert ckpt.states_equal(last["model"].state_dict(), straight_run["model"].state_dict())
    assert ckpt.states_equal(last["optimizer"].state_dict(), straight_run["optimizer"].state_dict())


@pytest.fixture()
def rates_used(monkeypatch):
    """The learning rate of every AdamW step taken while the test runs, read as the step begins."""
    used: list[float] = []
    original = torch.optim.AdamW.step
    monkeypatch.setattr(
        torch.optim.AdamW,
        "step",
        lambda self, *a, **k: used.append(self.param_groups[0]["lr"]) or original(self, *a, **k),
    )
    return used


def test_every_step_uses_the_learning_rate_of_the_cosine_schedule(tmp_path, rates_used, one_thread):
    """The scheduler steps after the optimizer: step k (from 0) runs at lr * (1 + cos(pi k / steps)) / 2."""
    import math

    used = rates_used
    train(tmp_path, steps=12, save_every=5, seed=1)
    assert used == pytest.approx([3e-3 * (1 + math.cos(math.pi * k / 12)) / 2 for k in range(12)], rel=1e-12)


def test_a_resume_with_other_settings_is_refused_naming_each_setting_and_both_values(tmp_path, one_thread):
    from helpers.cli.resume import RunSettingsError

    train(tmp_path, steps=20, save_every=10, seed=5, stop_after=10)
    with pytest.raises(
        RunSettingsError, match=r"seed: the checkpoint's 5, asked 9; steps: the checkpoint's 20, asked 40"
    ):
        train(tmp_path, steps=40, save_every=10, seed=9)
    with pytest.raises(RunSettingsError, match=r"dropout: the checkpoint's 0.1, asked 0.3"):
        train(tmp_path, steps=20, save_every=10, seed=5, dropout=0.3)
    with pytest.raises(RunSettingsError, match="only steps may grow"):
        train(tmp_path, steps=40, save_every=10, seed=9, on_mismatch="extend")
    assert read_checkpoint(CheckpointManager(tmp_path).latest())["step"] == 10  # nothing was trained or written
    same = train(tmp_path, steps=20, save_every=5, seed=5)  # save_every only says where checkpoints land
    assert same["resumed_from"] == 10 and same["steps_done"] == 20


def test_as_saved_continues_with_the_checkpoint_s_settings(tmp_path, one_thread):
    straight = train(tmp_path / "straight", steps=20, save_every=10, seed=5)
    train(tmp_path / "run", steps=20, save_every=10, seed=5, stop_after=10)
    resumed = train(tmp_path / "run", steps=40, save_every=10, seed=9, on_mismatch="as-saved")
    assert resumed["settings"]["seed"] == 5 and resumed["steps_done"] == 20
    assert ckpt.states_equal(resumed["model"].state_dict(), straight["model"].state_dict())


def test_extend_lengthens_the_run_along_the_longer_cosine(tmp_path, rates_used, one_thread):
    import math

    train(tmp_path, steps=20, save_every=10, seed=5)  # done: its cosine has reached 0
    used = rates_used
    used.clear()  # only the extension's steps
    longer = train(tmp_path, steps=40, save_every=10, seed=5, on_mismatch="extend")
    assert longer["resumed_from"] == 20 and longer["steps_done"] == 40 and longer["settings"]["steps"] == 40
    assert used == pytest.approx([3e-3 * (1 + math.cos(math.pi * k / 40)) / 2 for k in range(20, 40)], rel=1e-9)
    assert read_checkpoint(CheckpointManager(tmp_path).latest())["extra"]["settings"]["steps"] == 40


@pytest.mark.slow
def test_the_command_line_refuses_other_settings_and_says_how_to_go_on(tmp_path):
    subprocess.run(
        [*CLI, "--folder", str(tmp_path), "--steps", "20", "--seed", "5"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    done = subprocess.run(
        [*CLI, "--folder", str(tmp_path), "--steps", "40", "--seed", "9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "seed: the checkpoint's 5, asked 9; steps: the checkpoint's 20, asked 40" in done.stderr
    assert "--as-saved" in done.stderr and "--extend" in done.stderr
    extended = subprocess.run(
        [*CLI, "--folder", str(tmp_path), "--steps", "40", "--seed", "5", "--extend"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert extended.returncode == 0 and "done: step 40 (resumed from 20)" in extended.stdout


def test_a_checkpoint_is_flushed_and_synced_before_it_is_renamed(tmp_path, monkeypatch):
    """Mistake: the temporary file renamed over the checkpoint before its bytes reached the disk."""
    from helpers import checkpoint

    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: calls.append(("fsync", fd)) or real_fsync(fd))
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: calls.append(("replace", str(b))) or real_replace(a, b))
    target = tmp_path / "model.pt"
    checkpoint.save_checkpoint(target, nn.Linear(2, 2), epoch=0, step=0)
    names = [name for name, _ in calls]
    assert names[:2] == ["fsync", "replace"], calls  # the file's own fsync, then the rename (then the folder's)
    assert calls[1][1] == str(target)


# ------------------------------------------------------------------------ comparing runs, the command line's pieces


def _run(seed: int) -> dict:
    model, optimizer, scheduler, scaler = _training_objects(seed)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}


def test_same_training_state_compares_every_part_bit_for_bit():
    a, b = _run(0), _run(0)
    assert ckpt.same_training_state(a, b)
    _one_step(b["model"], b["optimizer"], b["scheduler"])
    assert not ckpt.same_training_state(a, b)
    c = _run(0)
    c["optimizer"].param_groups[0]["lr"] = 0.5  # the weights equal, the optimizer's state not
    assert not ckpt.same_training_state(a, c)
    with pytest.raises(ValueError, match=r"missing \['scaler'\]"):
        ckpt.same_training_state(a, {key: value for key, value in a.items() if key != "scaler"})


def test_resume_table_shows_each_run_s_resume_step_weight_gap_and_whether_it_is_identical():
    reference, same, other = _run(0), _run(0), _run(1)
    table = ckpt.resume_table(reference, {"same": same | {"resumed_from": 7}, "other": other})
    header, _, same_row, other_row = table.splitlines()
    assert header.split() == ["run", "resumed", "from", "step", "largest", "weight", "difference", "all", "states",
                              "bit-identical"]  # fmt: skip
    assert same_row.split() == ["same", "7", "0", "True"]
    assert other_row.split()[-1] == "False" and float(other_row.split()[-2]) > 0
    with_losses = ckpt.resume_table(reference | {"losses": [1.0]}, {"same": same | {"losses": [1.0]}})
    assert "same losses" in with_losses and with_losses.splitlines()[-1].split()[-2:] == ["True", "True"]
    with pytest.raises(ValueError, match="at least one"):
        ckpt.resume_table(reference, {})


@pytest.mark.slow
def test_command_line_runs_train_in_a_fresh_process_with_the_settings_given(tmp_path):
    from helpers.cli.resume import command_line

    command = command_line(tmp_path, steps=2, save_every=1, seed=5, dropout=0.0, threads=1)
    assert command[:3] == [sys.executable, "-m", "helpers.cli.resume"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "done: step 2 (resumed from None)"
    assert read_checkpoint(tmp_path / "step-00000002.pt")["extra"]["settings"]["seed"] == 5


def test_validation_losses_reads_every_save_a_run_printed(tmp_path, capsys, one_thread):
    from helpers.cli.resume import validation_losses

    train(tmp_path, steps=4, save_every=2, seed=1)
    losses = validation_losses(capsys.readouterr().out + "a line that is no save\n")
    assert list(losses) == [2, 4]
    assert losses[4] == pytest.approx(read_checkpoint(tmp_path / "step-00000004.pt")["metric"], abs=1e-6)
    assert validation_losses("saved step 3 x.pt (validation loss nan)")[3] != 0  # nan parses (and is not 0)
    assert validation_losses("") == {}


def test_a_dataloader_pass_draws_from_the_global_random_stream_unless_it_has_its_own_generator():
    """Notebook 11: why the command-line run gives each DataLoader its own generator (the dropout masks come from
    the global stream, so a resumed run would draw other masks)."""
    from torch.utils.data import DataLoader, TensorDataset

    def next_numbers_after_one_pass(**loader_options):
        torch.manual_seed(0)
        _ = list(DataLoader(TensorDataset(torch.zeros(4)), batch_size=2, **loader_options))
        return torch.rand(3)

    torch.manual_seed(0)
    untouched = torch.rand(3)
    assert not torch.equal(next_numbers_after_one_pass(), untouched)
    assert torch.equal(next_numbers_after_one_pass(generator=torch.Generator()), untouched)
