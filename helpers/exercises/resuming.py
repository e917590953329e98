"""Saving and resuming: write the save and the resume of a training run, so that a run stopped and resumed ends
bit-identical to one that never stopped."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from helpers.checkpoint import states_equal
from helpers.data import DigitsDataset
from helpers.models import MLP

from . import exercise


class ReferenceTrainingCheckpoint:
    """Save everything the next training step depends on, and put it back into freshly built objects."""

    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        """Write the state to `path` atomically; it loads with torch.load(path, weights_only=True)."""
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),  # the dropout masks to come
            "epoch": epoch,
            "position": position,
        }
        temporary = Path(path).with_name(f".{Path(path).name}.tmp")
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)  # the old file or the new one, never half of one

    def resume(self, path, model, optimizer, scheduler):
        """Load `path` into these objects and the random state; return (epoch, position) to go on from."""
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        return state["epoch"], state["position"]


# The check's run: an MLP with dropout on the first 192 training digits, AdamW, a cosine schedule, batches of 16
# (12 steps per epoch), each epoch's order drawn from a generator seeded with SEED + epoch. It stops after step 12
# (an epoch boundary) and after step 17 (mid-epoch).
SAMPLES, BATCH, STEPS, SEED, STOPS = 192, 16, 30, 5, (12, 17)


def _build() -> tuple:
    torch.manual_seed(SEED)
    model = MLP(64, (32,), 10, dropout=0.3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=1e-4)
    return model, optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)


def _train(run: tuple, data: tuple, epoch: int, position: int, stop: int) -> tuple[int, int]:
    """Train from (epoch, position) until `stop` steps are done; return where the data stands then."""
    (model, optimizer, scheduler), (images, targets) = run, data
    step = epoch * (SAMPLES // BATCH) + position // BATCH
    model.train()
    while step < stop:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(position, SAMPLES, BATCH):
            batch = order[start : start + BATCH]
            loss = F.cross_entropy(model(images[batch]), targets[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step, position = step + 1, start + len(batch)
            if position == SAMPLES:  # the epoch is over: the next one starts at its beginning
                epoch, position = epoch + 1, 0
            if step == stop:
                break
    return epoch, position


def _stop_and_resume(training_checkpoint: Callable, data: tuple, stop: int, straight: dict) -> None:
    """Train to `stop`, save, resume into fresh objects in a fresh random state, train to the end; check each part."""
    stopped = _build()
    epoch, position = _train(stopped, data, 0, 0, stop)
    rng_at_stop = torch.get_rng_state()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.pt"
        training_checkpoint().save(path, *stopped, epoch=epoch, position=position)
        try:
            torch.load(path, weights_only=True)
        except Exception as error:
            raise AssertionError(
                f"hint: the file does not load with torch.load(path, weights_only=True) ({type(error).__name__}): "
                "store only tensors, numbers, strings and lists/dicts of them (state_dict()s are such)"
            ) from None
        fresh = _build()
        torch.manual_seed(SEED + 1000 + stop)  # another process: its random state is not the stopped run's
        with _watching_torch_load() as loads:
            where = training_checkpoint().resume(path, *fresh)  # a new object: nothing carried over in memory
    assert loads, "hint: resume never called torch.load: read the file at path with torch.load(path, weights_only=True)"
    assert all(weights_only is not False for weights_only in loads), (
        "hint: resume loaded with weights_only=False, which unpickles anything, code included, from a file that may "
        "not be yours; the state_dict()s and RNG state load with weights_only=True (the default since torch 2.6)"
    )
    parts = dict(zip(("model", "optimizer", "scheduler"), zip(stopped, fresh)))
    assert states_equal(parts["model"][0].state_dict(), parts["model"][1].state_dict()), (
        "hint: the resumed model's weights are not the stopped run's: save model.state_dict(), load_state_dict it"
    )
    assert states_equal(parts["optimizer"][0].state_dict(), parts["optimizer"][1].state_dict()), (
        "hint: the optimizer state was not restored: AdamW's moment estimates and step counts live in "
        "optimizer.state_dict(); without them the next steps differ"
    )
    assert states_equal(parts["scheduler"][0].state_dict(), parts["scheduler"][1].state_dict()), (
        "hint: the scheduler was not restored: the cosine schedule starts again at its first learning rate; "
        "save scheduler.state_dict() and load it back"
    )
    assert torch.equal(torch.get_rng_state(), rng_at_stop), (
        "hint: the random state was not restored, so the dropout masks after the resume differ: save "
        "torch.get_rng_state() and put it back with torch.set_rng_state()"
    )
    assert isinstance(where, (tuple, list)) and len(where) == 2 and tuple(where) == (epoch, position), (
        f"hint: resume returned {where!r}, but the run stopped in epoch {epoch} with {position} samples of that "
        "epoch's order used: the place in the data; save both and return (epoch, position)"
    )
    _train(fresh, data, epoch, position, STEPS)
    assert states_equal(fresh[0].state_dict(), straight), (
        "hint: every part was restored, yet the run ended elsewhere: does resume change anything after loading?"
    )


class _CrashDuringSave(BaseException):
    """The check's stand-in for a kill or power cut half-way through torch.save (a BaseException, as
    KeyboardInterrupt is, so that an `except Exception` in the learner's save does not swallow it)."""


@contextlib.contextmanager
def _crash_half_way_through_torch_save() -> Iterator[list[bool]]:
    """While inside, torch.save writes the first half of its bytes where it was told, then crashes."""
    real_save = torch.save
    crashed: list[bool] = []

    def half_save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        half = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as file:
                file.write(half)
        else:
            f.write(half)
        crashed.append(True)
        raise _CrashDuringSave

    torch.save = half_save
    try:
        yield crashed
    finally:
        torch.save = real_save


@contextlib.contextmanager
def _watching_torch_load() -> Iterator[list]:
    """While inside, each torch.load call records its weights_only argument (None when left to the default)."""
    real_load, calls = torch.load, []

    def load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    torch.load = load
    try:
        yield calls
    finally:
        torch.load = real_load


@contextlib.contextmanager
def _watching_fsync() -> Iterator[list[int]]:
    """While inside, os.fsync and os.fdatasync record the file descriptors they are given (and still sync them)."""
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync") if hasattr(os, name)}
    synced: list[int] = []

    def recording(name):
        def sync(fd):
            synced.append(fd)
            return real[name](fd)

        return sync

    for name in real:
        setattr(os, name, recording(name))
    try:
        yield synced
    finally:
        for name, function in real.items():
            setattr(os, name, function)


HINT_ATOMIC = (
    "write to a temporary file in the same folder, flush and os.fsync it, then os.replace(temporary, path): a reader "
    "then sees the old file or the new one, never half of one"
)


def _interrupted_save(training_checkpoint: Callable) -> None:
    """Save, crash half-way through a second save, and save again: the file at `path` must load after the crash, and a
    complete save must put a new file there by a rename, not rewrite the old one in place."""
    run = _build()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.pt"
        training_checkpoint().save(path, *run, epoch=0, position=0)
        with _crash_half_way_through_torch_save() as crashed, contextlib.suppress(_CrashDuringSave):
            training_checkpoint().save(path, *run, epoch=0, position=BATCH)
        try:
            torch.load(path, weights_only=True)
        except Exception:
            left = "half a file, which does not load," if path.exists() else "no file"
            raise AssertionError(
                f"hint: a save interrupted half-way{' through torch.save' if crashed else ''} (as by a crash or a "
                f"kill) left {left} at path, where the last good checkpoint was: {HINT_ATOMIC}"
            ) from None
        before = path.stat().st_ino
        with _watching_fsync() as synced:
            training_checkpoint().save(path, *run, epoch=0, position=2 * BATCH)
        assert before == 0 or path.stat().st_ino != before, (  # 0: a file system without inode numbers
            "hint: save rewrote the file at path in place (the same file, not a new one renamed over it), so a crash "
            f"during the write leaves half a checkpoint: {HINT_ATOMIC}"
        )
        assert synced, (
            "hint: save never called os.fsync: the rename can reach the disk before the file's bytes do, and a power "
            "cut then leaves an empty or partial checkpoint under the new name; after writing, file.flush() and "
            "os.fsync(file.fileno()), then os.replace"
        )


@exercise("TrainingCheckpoint", reference=ReferenceTrainingCheckpoint)
def check_training_checkpoint(training_checkpoint: Callable) -> str:
    """Stopped after step 12 (an epoch boundary) and 17 (mid-epoch): resumed, the run ends bit-identical; and a save
    that crashes half-way leaves the previous file loadable."""
    digits = DigitsDataset("train")
    data = (digits.images[:SAMPLES], digits.targets[:SAMPLES])
    straight_run = _build()
    _train(straight_run, data, 0, 0, STEPS)
    straight = straight_run[0].state_dict()
    for stop in STOPS:
        _stop_and_resume(training_checkpoint, data, stop, straight)
    _interrupted_save(training_checkpoint)
    return (
        "✓ TrainingCheckpoint: resumed at an epoch end and mid-epoch, bit-identical; a save crashed half-way "
        "left the old file"
    )
