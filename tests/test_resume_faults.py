"""Checkpoints that survive faults: an unreadable newest file is skipped and set aside on resume, a failed
write (full disk, no permission) says which file and why, and make_loader refuses a missing dataset."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REFERENCE_RUN as RUN
from helpers import checkpoint as ckpt
from helpers.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointWriteError,
    SkippedCheckpointWarning,
    read_checkpoint,
    save_checkpoint,
    states_equal,
)
from helpers.cli.resume import train
from helpers.data import make_loader
from helpers.models import MLP

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "helpers.cli.resume"]


def _damage(path: Path, how: str) -> None:
    """A bad copy or a disk error: the file cut in half, emptied, or overwritten with other bytes."""
    data = path.read_bytes()
    damaged = {"truncated": data[: len(data) // 2], "empty": b"", "garbage": os.urandom(len(data))}[how]
    path.write_bytes(damaged)


def _three_checkpoints(folder: Path) -> tuple[CheckpointManager, dict[int, dict]]:
    """A manager holding steps 1, 2 and 3, each of another model; returns the saved weights by step."""
    manager = CheckpointManager(folder, keep_last=5)
    weights = {}
    for step in (1, 2, 3):
        model = MLP(64, (8,), 10)
        manager.save(model, step=step)
        weights[step] = {key: value.clone() for key, value in model.state_dict().items()}
    return manager, weights


# ----------------------------------------------------------------------------- resume past a bad file


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage"])
def test_manager_skips_an_unreadable_newest_file_sets_it_aside_and_loads_the_one_before(tmp_path, how):
    manager, weights = _three_checkpoints(tmp_path)
    newest = manager.latest()
    assert newest is not None
    _damage(newest, how)
    damaged_bytes = newest.read_bytes()
    model = MLP(64, (8,), 10)
    with pytest.warns(SkippedCheckpointWarning, match=r"step-00000003\.pt.*(truncated or corrupted|empty)"):
        state = manager.load_latest(model)
    assert state is not None and state["step"] == 2
    assert states_equal(model.state_dict(), weights[2])
    moved = tmp_path / "step-00000003.pt.corrupt"
    assert moved.read_bytes() == damaged_bytes, "the bad file must be set aside, not deleted"
    assert [p.name for p in manager.checkpoints()] == ["step-00000001.pt", "step-00000002.pt"]
    assert manager.skipped == [{"path": newest, "moved_to": moved, "reason": manager.skipped[0]["reason"]}]
    assert str(newest) in manager.skipped[0]["reason"]


def test_several_bad_files_are_all_set_aside_and_none_left_means_a_fresh_start(tmp_path):
    manager, weights = _three_checkpoints(tmp_path)
    for path in manager.checkpoints()[1:]:
        _damage(path, "truncated")
    model = MLP(64, (8,), 10)
    with pytest.warns(SkippedCheckpointWarning):
        state = manager.load_latest(model)
    assert state is not None and state["step"] == 1 and states_equal(model.state_dict(), weights[1])
    assert len(manager.skipped) == 2
    _damage(tmp_path / "step-00000001.pt", "empty")
    with pytest.warns(SkippedCheckpointWarning, match=r"step-00000001\.pt"):
        assert manager.load_latest(MLP(64, (8,), 10)) is None
    assert manager.checkpoints() == []
    assert sorted(p.name for p in tmp_path.glob("*.corrupt")) == [f"step-0000000{i}.pt.corrupt" for i in (1, 2, 3)]


def test_a_second_bad_file_of_the_same_name_does_not_overwrite_the_first_one_set_aside(tmp_path):
    manager = CheckpointManager(tmp_path)
    model = MLP(64, (8,), 10)
    for _ in range(2):
        _damage(manager.save(model, step=5), "truncated")
        with pytest.warns(SkippedCheckpointWarning):
            assert manager.load_latest(model) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005.pt.corrupt", "step-00000005.pt.corrupt-2"]


def test_a_file_that_reads_but_does_not_fit_is_raised_not_skipped(tmp_path):
    """An older file would not fit either: a wrong model is the learner's to fix, so nothing is set aside."""
    manager, _ = _three_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="does not fit the model"):
        manager.load_latest(MLP(64, (16,), 10))
    assert len(manager.checkpoints()) == 3 and manager.skipped == []


def test_a_file_without_read_permission_is_raised_not_set_aside(tmp_path, monkeypatch):
    manager, _ = _three_checkpoints(tmp_path)

    def refused(path, **_):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(ckpt.torch, "load", refused)
    with pytest.raises(PermissionError, match="step-00000003.pt"):
        manager.load_latest(MLP(64, (8,), 10))
    assert len(manager.checkpoints()) == 3 and not list(tmp_path.glob("*.corrupt"))


def test_an_unreadable_best_file_is_set_aside_when_the_folder_is_opened(tmp_path):
    manager = CheckpointManager(tmp_path)
    model = MLP(64, (8,), 10)
    manager.save(model, step=1, metric=0.5)
    _damage(manager.best_path, "truncated")
    with pytest.warns(SkippedCheckpointWarning, match=r"best\.pt"):
        reopened = CheckpointManager(tmp_path)
    assert reopened.best_metric is None and reopened.best() is None
    assert (tmp_path / "best.pt.corrupt").exists()
    reopened.save(model, step=2, metric=0.7)  # the next metric makes a new best.pt
    assert read_checkpoint(tmp_path / "best.pt")["step"] == 2


def _assert_same_weights_as(folder: Path, straight: dict) -> None:
    latest = CheckpointManager(folder).latest()
    assert latest is not None, f"no checkpoint in {folder}"
    final = read_checkpoint(latest)
    assert final["step"] == RUN["steps"]
    assert states_equal(final["model"], straight["model"].state_dict()), "weights differ from the straight run"
    assert states_equal(final["optimizer"], straight["optimizer"].state_dict())


def test_train_resumes_past_a_corrupt_newest_checkpoint_bit_identically(tmp_path, straight_run, one_thread, capsys):
    train(tmp_path, stop_after=50, **RUN)
    _damage(tmp_path / "step-00000050.pt", "truncated")
    capsys.readouterr()
    with pytest.warns(SkippedCheckpointWarning):
        resumed = train(tmp_path, **RUN)
    printed = capsys.readouterr().out
    assert resumed["resumed_from"] == 40
    assert "skipped " + str(tmp_path / "step-00000050.pt") in printed and "truncated or corrupted" in printed
    assert (tmp_path / "step-00000050.pt.corrupt").exists()
    _assert_same_weights_as(tmp_path, straight_run)


@pytest.mark.slow
def test_the_command_line_run_resumes_past_a_corrupt_newest_checkpoint(tmp_path, straight_run, one_thread):
    train(tmp_path, stop_after=50, **RUN)
    _damage(tmp_path / "step-00000050.pt", "garbage")
    options = [f"--{key.replace('_', '-')}={value}" for key, value in RUN.items()]
    done = subprocess.run(
        [*CLI, "--folder", str(tmp_path), *options, "--threads", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert f"skipped {tmp_path / 'step-00000050.pt'} (set aside as step-00000050.pt.corrupt)" in done.stdout
    assert "resumed from 40" in done.stdout
    assert "SkippedCheckpointWarning" not in done.stderr, "the command prints one line per skipped file, not two"
    _assert_same_weights_as(tmp_path, straight_run)


# ----------------------------------------------------------------------------- a write that fails


class _FullDisk:
    """A file on a disk with `room` bytes left: the write that does not fit raises ENOSPC, as the OS does."""

    def __init__(self, handle, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()

    def fileno(self) -> int:
        return self.handle.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.handle.close()


def _full_disk(monkeypatch, room: int) -> None:
    real_open = ckpt._open_new
    monkeypatch.setattr(ckpt, "_open_new", lambda temp: _FullDisk(real_open(temp), room))


@pytest.mark.parametrize("room", [0, 5_000])
def test_a_full_disk_names_the_file_and_the_cause_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch, room):
    """torch.save itself turns the OSError into `RuntimeError: ... unexpected pos ...`; the save says why."""
    manager = CheckpointManager(tmp_path, keep_last=2)
    model = MLP(64, (64, 64), 10)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        manager.save(model, optimizer, step=step, metric=1.0 / step)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    _full_disk(monkeypatch, room)
    with pytest.raises(CheckpointWriteError) as caught:
        manager.save(model, optimizer, step=3, metric=0.1)
    message = str(caught.value)
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value, OSError)
    assert str(tmp_path / "step-00000003.pt") in message and "No space left on device" in message
    assert "free on the disk" in message and "inline_container" not in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before, "earlier files changed or a temp file left"


def test_a_full_disk_found_at_fsync_is_reported_the_same_way(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "run.pt", MLP(64, (8,), 10), step=1)
    before = path.read_bytes()

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt.os, "fsync", no_space)
    with pytest.raises(CheckpointWriteError, match=r"run\.pt: No space left on device"):
        save_checkpoint(path, MLP(64, (8,), 10), step=2)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["run.pt"]


def test_no_permission_names_the_checkpoint_and_the_cause(tmp_path, monkeypatch):
    def refused(temp):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(temp))

    monkeypatch.setattr(ckpt, "_open_new", refused)
    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint .*run\.pt: Permission denied") as caught:
        save_checkpoint(tmp_path / "run.pt", MLP(64, (8,), 10))
    assert caught.value.errno == errno.EACCES and "writable" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def _read_only_folders_refuse_writes(folder: Path) -> bool:
    """False where folder modes do not bite: root (with CAP_DAC_OVERRIDE), Windows."""
    probe = folder / "probe"
    probe.mkdir()
    probe.chmod(0o555)
    try:
        (probe / "file").write_bytes(b"")
        return False
    except PermissionError:
        return True
    finally:
        probe.chmod(0o755)
        (probe / "file").unlink(missing_ok=True)
        probe.rmdir()


def test_a_read_only_folder_names_the_checkpoint_and_keeps_the_old_one(tmp_path):
    if not _read_only_folders_refuse_writes(tmp_path):
        pytest.skip("a read-only folder still takes writes here (root, or Windows)")
    path = save_checkpoint(tmp_path / "run.pt", MLP(64, (8,), 10), step=1)
    before = path.read_bytes()
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(CheckpointWriteError, match=r"run\.pt: Permission denied"):
            save_checkpoint(path, MLP(64, (8,), 10), step=2)
    finally:
        tmp_path.chmod(0o755)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["run.pt"]


def test_errors_that_are_not_about_the_disk_pass_through_unchanged(tmp_path, monkeypatch):
    def broken(obj, handle):
        raise TypeError("cannot pickle this")

    monkeypatch.setattr(ckpt.torch, "save", broken)
    with pytest.raises(TypeError, match="cannot pickle this"):
        save_checkpoint(tmp_path / "run.pt", MLP(64, (8,), 10))
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- a missing dataset


@pytest.mark.parametrize("dataset", [None, 42, iter([1, 2, 3])], ids=["None", "int", "iterator"])
def test_make_loader_refuses_what_is_not_a_dataset_naming_the_parameter(dataset):
    with pytest.raises(TypeError, match=r"^dataset must be a dataset .*got "):
        make_loader(dataset, batch_size=8)


@pytest.mark.parametrize(
    "error", [IndexError("pop from empty list"), TypeError("bad"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "x")]
)
def test_any_error_the_unpickler_raises_on_random_bytes_makes_the_file_unreadable(tmp_path, monkeypatch, error):
    """Random bytes can make torch.load's weights-only unpickler fail in any way (an IndexError, seen on torch 2.15)."""
    model = MLP(64, (8,), 10)
    path = ckpt.save_checkpoint(tmp_path / "step-00000001.pt", model, step=1)

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(ckpt.torch, "load", fail)
    with pytest.raises(ckpt.UnreadableCheckpointError, match="truncated or corrupted"):
        ckpt.read_checkpoint(path)
