"""Training-state checkpoints: atomic save, safe checked load, RNG states, data position, keep-last-k-and-best.

    save_checkpoint(path, model, optimizer, scheduler, scaler, step=step, extra={"sampler": sampler.state_dict(n)})
    state = load_checkpoint(path, model, optimizer, scheduler, scaler)

A save writes a temporary file in the same folder, fsyncs it and renames it over the target, so a crash
leaves the previous checkpoint intact; a save that fails (a full disk, no permission) raises
`CheckpointWriteError` naming the file and the cause, and leaves no temporary file. A load always uses
`torch.load(weights_only=True)`: tensors, numbers, strings and plain containers, never code that runs when
the file is opened. `CheckpointManager.load_latest` resumes from the newest file that reads, setting
unreadable newer ones aside (`step-….pt.corrupt`) with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import pickle
import random
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Sampler

from .checks import check_int
from .memory import format_bytes
from .timing import format_table

FORMAT = "helpers.checkpoint/2"  # 2: python and numpy RNG states stored as tuples, no best_metric
_SAFE_LEAVES = (str, int, float, bool, type(None), torch.Tensor, torch.Size, torch.dtype, torch.device)
_TEMP_MARK = ".tmp-"
_PARTS = ("optimizer", "scheduler", "scaler")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: unreadable, not a checkpoint, or made for another model."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint file whose bytes cannot be read back: empty, truncated or corrupted (a bad copy, a disk error)."""


class CheckpointWriteError(OSError):
    """A save that failed (a full disk, no permission): the message names the file and the cause; `errno` is kept."""

    def __str__(self) -> str:
        return str(self.strerror)


class SkippedCheckpointWarning(UserWarning):
    """An unreadable checkpoint was skipped (and set aside) while looking for the newest one that loads."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside DistributedDataParallel / DataParallel (`.module`) and torch.compile (`_orig_mod`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):  # torch._dynamo OptimizedModule
            model = inner
        else:
            return model


def states_equal(a: Any, b: Any) -> bool:
    """Bit-identical states: nested dicts, lists and tuples alike, tensors equal in value (compared on the CPU)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(states_equal(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def capture_rng_state(generator: torch.Generator | None = None) -> dict:
    """The states of python's `random`, numpy, torch (CPU, CUDA, MPS) and an optional DataLoader generator.

    Stored as tensors and tuples of numbers (numpy's key array as a list), so they load with weights_only=True.
    """
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, np.asarray(keys).tolist(), int(position), int(has_gauss), float(cached_gaussian)),
        "torch": torch.get_rng_state(),
        # Only once CUDA is in use: asking earlier would start a CUDA context just to save default states.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "mps": torch.mps.get_rng_state() if torch.backends.mps.is_available() else None,
        "generator": generator.get_state() if generator is not None else None,
    }


def restore_rng_state(state: Mapping[str, Any], generator: torch.Generator | None = None) -> None:
    """Put back the states from `capture_rng_state` (the generator's too, when one is passed)."""
    if generator is not None and state.get("generator") is None:
        raise ValueError("a generator was passed, but the saved RNG state holds none (saved without generator=...)")
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu())
    if torch.cuda.is_available():
        # A checkpoint from a machine with more GPUs restores as many devices as are visible here.
        for index, cuda_state in enumerate((state.get("cuda") or [])[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)
    if state.get("mps") is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"].cpu())
    if generator is not None:
        generator.set_state(state["generator"].cpu())


class ResumableSampler(Sampler[int]):
    """Epoch e visits the samples in the order `randperm` draws from a generator seeded with `seed + e`.

    As with DistributedSampler, the order depends only on (seed, epoch), so the data position is two ints:
    the loop passes the samples it consumed this epoch to `state_dict` (DataLoader workers prefetch, so the
    sampler cannot know), and `load_state_dict` makes the next iteration restart that epoch part-way.
    """

    def __init__(self, num_samples: int, *, seed: int = 0) -> None:
        check_int("num_samples", num_samples)
        check_int("seed", seed, minimum=0)
        self.num_samples, self.seed = num_samples, seed
        self.epoch = -1  # the epoch being iterated (-1: none yet)
        self._next = (0, 0)  # (epoch, offset) where the next iteration starts

    def __len__(self) -> int:
        return self.num_samples - self._next[1]

    def __iter__(self) -> Iterator[int]:
        self.epoch, offset = self._next
        self._next = (self.epoch + 1, 0)
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter(order[offset:].tolist())

    def state_dict(self, consumed: int) -> dict:
        """Where to restart: this epoch, `consumed` samples in (the next epoch once all are consumed)."""
        check_int("consumed", consumed, minimum=0, maximum=self.num_samples)
        if self.epoch < 0 or consumed == self.num_samples:
            return {"epoch": self.epoch + 1, "offset": 0}
        return {"epoch": self.epoch, "offset": consumed}

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration start at `state`'s epoch, its first `offset` samples skipped."""
        epoch, offset = state.get("epoch", -1), state.get("offset", -1)
        if not (epoch >= 0 and 0 <= offset < self.num_samples):
            raise ValueError(
                f"state must be a dict from ResumableSampler.state_dict with epoch >= 0 and offset in "
                f"[0, {self.num_samples}), got {state!r}"
            )
        self._next = (int(epoch), int(offset))


def _check_plain(value: Any, where: str) -> None:
    """Raise TypeError unless `value` is what weights_only=True loads (tensors, numbers, strings, containers)."""
    if isinstance(value, _SAFE_LEAVES):
        return
    if not isinstance(value, (Mapping, list, tuple)):
        raise TypeError(
            f"{where} must hold only tensors, numbers, strings, None and dicts/lists/tuples of them "
            f"(what weights_only=True loads), got {type(value).__name__}"
        )
    for key, item in value.items() if isinstance(value, Mapping) else enumerate(value):
        if not isinstance(key, (str, int)):
            raise TypeError(f"{where} keys must be str or int, got {type(key).__name__} {key!r}")
        _check_plain(item, f"{where}[{key!r}]")


class _WriteRecorder:
    """The file object torch.save writes to: remembers an OSError from a write, which torch reports only as
    `RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...`."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        try:
            self.handle.flush()
        except OSError as error:
            self.error = error
            raise


def _open_new(temp: Path) -> IO[bytes]:
    """Create `temp` for writing; fails if it exists. os.open with 0o666 honours the umask, as a plain open()
    would (tempfile would make it 0o600)."""
    return os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), "wb")


def _write_error(path: Path, cause: OSError) -> CheckpointWriteError:
    """The error for a failed save: which file, why (the OS's words), the free space, and what to do."""
    reason = cause.strerror or str(cause) or type(cause).__name__
    name = errno.errorcode.get(cause.errno, "") if cause.errno is not None else ""
    free = ""
    if cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        advice = "make the folder writable or save somewhere else"
    else:
        advice = "fix the cause and save again"
        if cause.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            advice = "free some space or save to another disk, then save again"
        with contextlib.suppress(OSError, StopIteration):
            folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())
            free = f"; {format_bytes(shutil.disk_usage(folder).free)} free on the disk holding {folder}"
    return CheckpointWriteError(
        cause.errno,
        f"cannot write checkpoint {path}: {reason}{f' ({name})' if name else ''}{free}. Earlier checkpoints "
        f"are untouched and no temporary file is left; {advice}.",
    )


def _atomic_write(path: Path, write: Callable[[Any], Any]) -> Path:
    """write(handle) into a temporary file next to `path`, fsync it, rename it over `path`, fsync the folder.

    An OSError on the way (raised as such, or hidden inside torch.save's RuntimeError) becomes a
    CheckpointWriteError naming `path`; the temporary file is removed whatever happened.
    """
    temp = path.parent / f".{path.name}{_TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    recorder: _WriteRecorder | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _open_new(temp) as handle:
            recorder = _WriteRecorder(handle)
            write(recorder)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        if isinstance(error, CheckpointWriteError):
            raise
        cause = error if isinstance(error, OSError) else None
        if isinstance(error, RuntimeError) and recorder is not None:
            cause = recorder.error
        if cause is None:
            raise
        raise _write_error(path, cause) from error
    with contextlib.suppress(OSError):  # makes the rename itself durable; folders cannot be opened on Windows
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    *,
    epoch: int = 0,
    step: int = 0,
    metric: float | None = None,
    generator: torch.Generator | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Atomically write model, optimizer, scheduler, scaler, counters, metric and every RNG state to `path`.

    The model is unwrapped first (no `module.` / `_orig_mod.` prefixes). `extra` must hold plain values
    (tensors, numbers, strings, lists, dicts) so the file still loads with weights_only=True.
    """
    check_int("epoch", epoch, minimum=0)
    check_int("step", step, minimum=0)
    if metric is not None and (isinstance(metric, bool) or not isinstance(metric, (int, float)) or math.isnan(metric)):
        raise ValueError(f"metric must be a number (not NaN) or None, got {metric!r}")
    _check_plain(extra or {}, "extra")
    parts = dict(zip(_PARTS, (optimizer, scheduler, scaler)))
    payload = {
        "format": FORMAT,
        # the release that wrote it, named when another cannot use it (a str: a TorchVersion would not load with
        # weights_only=True)
        "torch": str(torch.__version__),
        "model": unwrap_model(model).state_dict(),
        **{name: part.state_dict() if part is not None else None for name, part in parts.items()},
        "epoch": epoch,
        "step": step,
        "metric": metric,
        "rng": capture_rng_state(generator),
        "extra": dict(extra or {}),
    }
    return _atomic_write(Path(path), lambda handle: torch.save(payload, handle))


def read_checkpoint(path: str | Path, *, map_location: Any = "cpu") -> dict:
    """The raw contents of a checkpoint file, read with weights_only=True; clear errors naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} " + ("is not a file" if path.exists() else "does not exist"))
    size = path.stat().st_size
    if size == 0:
        raise UnreadableCheckpointError(
            f"checkpoint {path} is empty (0 bytes): an interrupted copy or a non-atomic write?"
        )
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except PermissionError:
        raise  # names the file already, and the file may be fine: not "corrupted"
    except Exception as error:  # random bytes make the unpickler fail in any way: IndexError, TypeError, struct.error
        # The weights-only unpickler says what it objected to in the error it wraps.
        inner = error.__context__ if str(error.__context__ or "").strip() else error
        reason = " ".join(str(inner).split())[:300] or type(error).__name__
        if isinstance(error, pickle.UnpicklingError) and "global" in reason.lower():
            raise CheckpointError(
                f"checkpoint {path} was refused by torch.load(weights_only=True): it holds objects other than "
                f"tensors and plain values, which could run code when unpickled ({reason}). Only if you trust "
                f"where the file came from, allow the named classes with torch.serialization.add_safe_globals([...])."
            ) from error
        if "Attempting to deserialize object on" in str(error):
            raise CheckpointError(
                f"checkpoint {path} holds tensors saved on a device this machine does not have "
                f"({str(error).splitlines()[0]}); load it with map_location='cpu' (the default "
                f"of load_checkpoint) or another device here"
            ) from error
        raise UnreadableCheckpointError(
            f"checkpoint {path} ({size} bytes) cannot be read: truncated or corrupted "
            f"({type(error).__name__}: {reason})"
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "model" not in payload:
        found = sorted(map(str, payload))[:8] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"checkpoint {path} was not written by save_checkpoint (expected format {FORMAT!r}; found {found})"
        )
    return payload


def _releases(payload: Mapping[str, Any]) -> str:
    """'; written by torch A, read by torch B' where the two differ, for an error: a release's change may be why."""
    wrote = payload.get("torch")
    if wrote == torch.__version__:
        return ""
    writer = f"torch {wrote}" if wrote else "a torch release the file does not record"
    return f"; written by {writer}, read by torch {torch.__version__}"


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    *,
    generator: torch.Generator | None = None,
    map_location: Any = "cpu",
    restore_rng: bool = True,
) -> dict:
    """Load a save_checkpoint file into the given objects (and RNG states); return epoch, step and the rest.

    `map_location` (default "cpu") lets a GPU checkpoint load on a machine without one. A wrong file fails
    naming missing / unexpected keys and shape mismatches, before anything is changed. `restore_rng=False`
    leaves the global random states alone (not the generator).
    """
    payload = read_checkpoint(path, map_location=map_location)
    state = dict(payload["model"])
    # A file saved from a wrapper (DDP, torch.compile) by other code: every key starts with `module.` / `_orig_mod.`.
    while state and (prefix := next((p for p in ("module.", "_orig_mod.") if all(k.startswith(p) for k in state)), "")):
        state = {key[len(prefix) :]: value for key, value in state.items()}
    expected = unwrap_model(model).state_dict()
    problems = {
        "missing keys": [key for key in expected if key not in state],
        "unexpected keys": [key for key in state if key not in expected],
        "shape mismatches": [
            f"{key}: file {tuple(state[key].shape)} vs model {tuple(value.shape)}"
            for key, value in expected.items()
            if isinstance(state.get(key), torch.Tensor) and state[key].shape != value.shape
        ],
    }
    if any(problems.values()):
        listed = {
            kind: ", ".join(items[:6]) + (f", ... ({len(items)} in all)" if len(items) > 6 else "")
            for kind, items in problems.items()
            if items
        }
        raise CheckpointError(
            f"checkpoint {path} does not fit the model {type(unwrap_model(model)).__name__} (is "
            "it a checkpoint of a different model?); "
            + "; ".join(f"{kind}: {items}" for kind, items in listed.items())
            + _releases(payload)
        )
    if generator is not None and (payload.get("rng") or {}).get("generator") is None:
        raise CheckpointError(
            f"checkpoint {path} holds no generator state (it was saved without generator=...), "
            "but a generator was passed to restore"
        )
    # The optimizer first: it checks its parameter groups before changing anything (the model stays untouched).
    for name, target in zip(_PARTS, (optimizer, scheduler, scaler)):
        if target is None:
            continue
        if payload.get(name) is None:
            raise CheckpointError(
                f"checkpoint {path} holds no {name} state (it was saved without a {name}), "
                f"but a {name} was passed to load it into"
            )
        try:
            target.load_state_dict(payload[name])
        except (ValueError, KeyError, RuntimeError, TypeError) as error:
            raise CheckpointError(
                f"checkpoint {path}: its {name} state does not fit the {name} passed "
                f"({type(error).__name__}: {str(error).strip().splitlines()[0]}){_releases(payload)}"
            ) from error
    unwrap_model(model).load_state_dict(state)
    if restore_rng:
        restore_rng_state(payload["rng"], generator)
    elif generator is not None:
        generator.set_state(payload["rng"]["generator"].cpu())
    loaded = {key: payload[key] for key in ("epoch", "step", "metric", "extra")}
    return {"path": Path(path), **loaded, "torch": payload.get("torch")}


class CheckpointManager:
    """Checkpoints in one folder as `step-<step>.pt`: keeps the last `keep_last`, and the best as `best.pt`.

    One process writes to a folder at a time; a manager opening it removes temporary files of killed saves.
    `load_latest` resumes from the newest step file that reads; an unreadable best.pt is set aside too.
    """

    def __init__(self, folder: str | Path, *, keep_last: int = 3, mode: str = "min") -> None:
        check_int("keep_last", keep_last)
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' (lower metric is better) or 'max', got {mode!r}")
        self.folder, self.keep_last, self.mode = Path(folder), keep_last, mode
        self.best_path = self.folder / "best.pt"
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(f".*{_TEMP_MARK}*"):
            stale.unlink(missing_ok=True)
        self.skipped: list[dict] = []  # what load_latest (or opening) set aside: path, moved_to, reason
        self.best_metric: float | None = None
        if self.best_path.exists():
            try:
                self.best_metric = read_checkpoint(self.best_path)["metric"]
            except UnreadableCheckpointError as error:
                self._set_aside(self.best_path, error)  # the next save with a metric writes a new best.pt

    def checkpoints(self) -> list[Path]:
        """The step checkpoints in the folder, oldest first."""
        found = [path for path in self.folder.iterdir() if re.fullmatch(r"step-\d{8,}\.pt", path.name)]
        return sorted(found, key=lambda path: int(path.stem[len("step-") :]))

    def latest(self) -> Path | None:
        """The newest step checkpoint, or None."""
        return next(reversed(self.checkpoints()), None)

    def best(self) -> Path | None:
        """The best checkpoint, or None when no metric was ever given."""
        return self.best_path if self.best_path.exists() else None

    def load_latest(self, model: nn.Module, *parts: Any, **options: Any) -> dict | None:
        """load_checkpoint from the newest step file that reads; None when none does (or there is none).

        A newer file that cannot be read (empty, truncated, corrupted) is renamed `<name>.corrupt`, never
        deleted, with a SkippedCheckpointWarning saying which file and why; `self.skipped` lists them.
        Other errors (a checkpoint of another model, an unsafe file) are raised: an older file would not help.
        `parts` are the optimizer, scheduler and scaler; `options` as for load_checkpoint.
        """
        for path in reversed(self.checkpoints()):
            try:
                return load_checkpoint(path, model, *parts, **options)
            except UnreadableCheckpointError as error:  # raised before anything was changed
                self._set_aside(path, error)
        return None

    def _set_aside(self, path: Path, error: Exception) -> Path:
        """Rename an unreadable file to `<name>.corrupt` (`.corrupt-2`, ... if taken), record it and warn."""
        moved_to, number = path.with_name(path.name + ".corrupt"), 1
        while moved_to.exists():
            number += 1
            moved_to = path.with_name(f"{path.name}.corrupt-{number}")
        os.replace(path, moved_to)
        self.skipped.append({"path": path, "moved_to": moved_to, "reason": str(error)})
        warnings.warn(f"{error}; skipped, and set aside as {moved_to.name}", SkippedCheckpointWarning, stacklevel=3)
        return moved_to

    def save(self, model: nn.Module, *parts: Any, step: int, metric: float | None = None, **options: Any) -> Path:
        """save_checkpoint to step-<step>.pt; copy it to best.pt when `metric` improves; keep the last k step files.

        `parts` are the optimizer, scheduler and scaler; `options` epoch, generator and extra, as for save_checkpoint.
        """
        path = save_checkpoint(self.folder / f"step-{step:08d}.pt", model, *parts, step=step, metric=metric, **options)
        best = self.best_metric
        if metric is not None and (best is None or (metric < best if self.mode == "min" else metric > best)):
            # A copy put in place by an atomic rename, so it survives when the step file is deleted.
            _atomic_write(self.best_path, lambda handle: handle.write(path.read_bytes()))
            self.best_metric = metric
        for old in self.checkpoints()[: -self.keep_last]:
            old.unlink(missing_ok=True)
        return path


RUN_PARTS = ("model", "optimizer", "scheduler", "scaler")  # what a run is made of, for the two functions below


def same_training_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two runs (mappings holding their model, optimizer, scheduler and scaler) are in bit-identical states."""
    missing = sorted({part for part in RUN_PARTS if part not in a or part not in b})
    if missing:
        raise ValueError(f"both runs must hold {list(RUN_PARTS)}; missing {missing}")
    return all(states_equal(a[part].state_dict(), b[part].state_dict()) for part in RUN_PARTS)


def resume_table(reference: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> str:
    """Resumed runs against `reference`, a run that never stopped: the step each resumed from, its largest weight
    difference, whether all its states are bit-identical and, where every run holds its `losses`, whether they are."""
    if not runs:
        raise ValueError("runs must name at least one resumed run")
    weights = nn.utils.parameters_to_vector(reference["model"].parameters()).detach()
    with_losses = "losses" in reference and all("losses" in run for run in runs.values())
    rows = []
    for name, run in runs.items():
        gap = (nn.utils.parameters_to_vector(run["model"].parameters()).detach() - weights).abs().max().item()
        row = {"run": name, "resumed from step": run.get("resumed_from"), "largest weight difference": gap}
        if with_losses:
            row["same losses"] = run["losses"] == reference["losses"]
        rows.append(row | {"all states bit-identical": same_training_state(reference, run)})
    return format_table(rows, list(rows[0]), formats={"largest weight difference": "{:.3g}"})
