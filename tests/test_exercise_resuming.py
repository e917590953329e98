"""The save-and-resume exercise gives each kind of mistake its own hint."""

import io
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.exercises.resuming import check_training_checkpoint


class WithoutOptimizer:
    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save(
            {
                "model": model.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "epoch": epoch,
                "position": position,
            },
            path,
        )

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        return state["epoch"], state["position"]


class WithoutRandomState:
    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "position": position,
            },
            path,
        )

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        return state["epoch"], state["position"]


class WithoutScheduler:
    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "epoch": epoch,
                "position": position,
            },
            path,
        )

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        return state["epoch"], state["position"]


class RestartingTheEpoch:
    """Saves everything but resumes at the start of the epoch it stopped in (fine only at an epoch boundary)."""

    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "epoch": epoch,
            },
            path,
        )

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        return state["epoch"], 0


class WithNumpyArrays(WithoutRandomState):
    """Saves numpy's random state as numpy returns it: an array that weights_only=True refuses."""

    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save({"model": model.state_dict(), "numpy": np.random.get_state(), "epoch": epoch}, path)


class Complete(WithoutOptimizer):
    """Saves and restores everything, but writes the file in place with torch.save(state, path)."""

    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "epoch": epoch,
                "position": position,
            },
            path,
        )

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        return state["epoch"], state["position"]


class RemovesTheOldFileFirst(Complete):
    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        Path(path).unlink(missing_ok=True)  # for a moment there is no checkpoint at all, then half of one
        super().save(path, model, optimizer, scheduler, epoch=epoch, position=position)


class CopiesTheTemporaryFileOver(Complete):
    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        temporary = Path(f"{path}.tmp")
        super().save(temporary, model, optimizer, scheduler, epoch=epoch, position=position)
        shutil.copyfile(temporary, path)  # rewrites path in place: a crash during the copy leaves half a file


class ResumesWithoutTheState(Complete):
    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        torch.set_rng_state(state["rng"])
        return state["epoch"], state["position"]  # optimizer and scheduler saved, but never loaded back


class ThroughANamedTemporaryFile(Complete):
    """Atomic without fsync: tempfile in the same folder, then os.replace (Path.replace)."""

    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        with tempfile.NamedTemporaryFile(dir=Path(path).parent, delete=False) as file:
            super().save(file, model, optimizer, scheduler, epoch=epoch, position=position)
        Path(file.name).replace(path)


class SyncedThroughANamedTemporaryFile(Complete):
    """tempfile in the same folder, flushed and fsynced, then Path.replace."""

    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        with tempfile.NamedTemporaryFile(dir=Path(path).parent, delete=False) as file:
            super().save(file, model, optimizer, scheduler, epoch=epoch, position=position)
            file.flush()
            os.fsync(file.fileno())
        Path(file.name).replace(path)


class LoadsAnything(SyncedThroughANamedTemporaryFile):
    """Atomic and synced, and resumes with weights_only=False: any pickled object, code included, would load."""

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        return state["epoch"], state["position"]


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (WithoutOptimizer, "the optimizer state was not restored"),
    (WithoutRandomState, "the random state was not restored"),
    (WithoutScheduler, "the scheduler was not restored"),
    (RestartingTheEpoch, r"resume returned \(1, 0\).*the place in the data"),
    (WithNumpyArrays, "does not load with torch.load.path, weights_only=True."),
    (Complete, "a save interrupted half-way through torch.save .* left half a file, which does not load"),
    (RemovesTheOldFileFirst, "a save interrupted half-way through torch.save .* left half a file"),
    (CopiesTheTemporaryFileOver, "save rewrote the file at path in place"),
    (ResumesWithoutTheState, "the optimizer state was not restored"),
    (ThroughANamedTemporaryFile, "save never called os.fsync"),
    (LoadsAnything, "resume loaded with weights_only=False"),
]


RIGHT = [SyncedThroughANamedTemporaryFile]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_training_checkpoint(wrong)


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_training_checkpoint.check(right).startswith("✓ TrainingCheckpoint: resumed")


def test_the_crash_is_simulated_only_inside_the_check():
    """torch.save is put back after the interrupted save, whatever the learner's save did."""
    from helpers.exercises.resuming import _crash_half_way_through_torch_save, _CrashDuringSave

    real = torch.save
    with pytest.raises(_CrashDuringSave), _crash_half_way_through_torch_save() as crashed:
        torch.save({"x": torch.ones(3)}, io.BytesIO())
    assert crashed == [True] and torch.save is real
