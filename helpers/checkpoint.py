"""Training-state checkpoints: atomic save, safe checked load, RNG states, data position, keep-last-k-and-best.

    save_checkpoint(path, model, optimizer, scheduler, scaler, step=step, extra={"sampler": sampler.state_dict(n)})
    state = load_checkpoint(path, model, optimizer, scheduler, scaler)

A save writes a temporary file in the same folder, fsyncs it and renames it over the target, so a crash
leaves the previous checkpoint intact. A load always uses `torch.load(weights_only=True)`: tensors,
numbers, strings and plain containers, never code that runs when the file is opened.
"""
from __future__ import annotations

import contextlib
import math
import os
import pickle
import random
import re
import secrets
import shutil
import zipfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch import nn
from torch.utils.data import Sampler

FORMAT = "helpers.checkpoint/2"  # 2: python and numpy RNG states stored as tuples, no best_metric
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SAFE_LEAVES = (str, int, float, bool, type(None), torch.Tensor, torch.Size, torch.dtype, torch.device)
_TEMP_MARK = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: unreadable, not a checkpoint, or made for another model."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside DistributedDataParallel / DataParallel (`.module`) and torch.compile (`_orig_mod`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch._dynamo OptimizedModule
            model = model._orig_mod
        else:
            return model


def _strip_wrapper_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Drop `module.` / `_orig_mod.` prefixes while every key carries one (a file saved from a wrapper)."""
    state = dict(state_dict)
    while state and (prefix := next((p for p in _WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)):
        state = {key[len(prefix):]: value for key, value in state.items()}
    return state


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def _check_generator(generator: Any) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def capture_rng_state(generator: torch.Generator | None = None) -> dict:
    """The states of python's `random`, numpy, torch (CPU, CUDA, MPS) and an optional DataLoader generator.

    Stored as tensors and tuples of numbers (numpy's key array as a list), so they load with weights_only=True.
    """
    _check_generator(generator)
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), int(position), int(has_gauss), float(cached_gaussian)),
        "torch": torch.get_rng_state(),
        # Only once CUDA is in use: asking earlier would start a CUDA context just to save default states.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "mps": torch.mps.get_rng_state() if _mps_available() else None,
        "generator": generator.get_state() if generator is not None else None,
    }


def restore_rng_state(state: Mapping[str, Any], generator: torch.Generator | None = None) -> None:
    """Put back the states from `capture_rng_state` (the generator's too, when one is passed)."""
    if not isinstance(state, Mapping) or not {"python", "numpy", "torch"} <= set(state):
        raise ValueError("state must be a dict from capture_rng_state with keys 'python', 'numpy' and 'torch'")
    _check_generator(generator)
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
    if state.get("mps") is not None and _mps_available():
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
        for name, value, low in (("num_samples", num_samples, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.num_samples, self.seed = num_samples, seed
        self.epoch = -1           # the epoch being iterated (-1: none yet)
        self._next = (0, 0)       # (epoch, offset) where the next iteration starts

    def __len__(self) -> int:
        return self.num_samples - self._next[1]

    def __iter__(self) -> Iterator[int]:
        self.epoch, offset = self._next
        self._next = (self.epoch + 1, 0)
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter(order[offset:].tolist())

    def state_dict(self, consumed: int) -> dict:
        """Where to restart: this epoch, `consumed` samples in (the next epoch once all are consumed)."""
        if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= self.num_samples:
            raise ValueError(f"consumed must be an int in [0, {self.num_samples}], got {consumed!r}")
        if self.epoch < 0 or consumed == self.num_samples:
            return {"epoch": self.epoch + 1, "offset": 0}
        return {"epoch": self.epoch, "offset": consumed}

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration start at `state`'s epoch, its first `offset` samples skipped."""
        if not isinstance(state, dict) or not {"epoch", "offset"} <= set(state):
            raise ValueError("state must be a dict from ResumableSampler.state_dict with epoch and offset")
        if not 0 <= state["offset"] < self.num_samples or state["epoch"] < 0:
            raise ValueError(f"state must have epoch >= 0 and offset in [0, {self.num_samples}), got {state!r}")
        self._next = (int(state["epoch"]), int(state["offset"]))


def _check_plain(value: Any, where: str) -> None:
    """Raise TypeError unless `value` is what weights_only=True loads (tensors, numbers, strings, containers)."""
    if isinstance(value, _SAFE_LEAVES):
        return
    if not isinstance(value, (Mapping, list, tuple)):
        raise TypeError(f"{where} must hold only tensors, numbers, strings, None and dicts/lists/tuples of them "
                        f"(what weights_only=True loads), got {type(value).__name__}")
    for key, item in value.items() if isinstance(value, Mapping) else enumerate(value):
        if not isinstance(key, (str, int)):
            raise TypeError(f"{where} keys must be str or int, got {type(key).__name__} {key!r}")
        _check_plain(item, f"{where}[{key!r}]")


def _check_counts_and_metric(metric: Any, **counts: Any) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if metric is not None and (isinstance(metric, bool) or not isinstance(metric, (int, float)) or math.isnan(metric)):
        raise ValueError(f"metric must be a number (not NaN) or None, got {metric!r}")


def _check_objects(model, optimizer, scheduler, scaler, generator) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    for name, value in (("scheduler", scheduler), ("scaler", scaler)):
        if value is not None and not all(callable(getattr(value, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(f"{name} must have state_dict() and load_state_dict() or be None, got {type(value).__name__}")
    _check_generator(generator)


def _check_path(path: Any, name: str = "path") -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or a Path, got {type(path).__name__}")
    return Path(path)


def _fsync_folder(folder: Path) -> None:
    """Make a rename itself durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """torch.save to a temporary file next to `path`, flush + fsync, rename over `path`, fsync the folder."""
    path = _check_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f".{path.name}{_TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    # os.open with 0o666 honours the umask, as a plain open() would (tempfile would make it 0o600).
    handle = os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), "wb")
    try:
        with handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler=None, scaler=None, *, epoch: int = 0, step: int = 0, metric: float | None = None,
                    generator: torch.Generator | None = None, extra: Mapping[str, Any] | None = None) -> Path:
    """Atomically write model, optimizer, scheduler, scaler, counters, metric and every RNG state to `path`.

    The model is unwrapped first (no `module.` / `_orig_mod.` prefixes). `extra` must hold plain values
    (tensors, numbers, strings, lists, dicts) so the file still loads with weights_only=True.
    """
    _check_path(path)
    _check_objects(model, optimizer, scheduler, scaler, generator)
    _check_counts_and_metric(metric, epoch=epoch, step=step)
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    _check_plain(extra or {}, "extra")
    return atomic_torch_save({
        "format": FORMAT, "model": unwrap_model(model).state_dict(),
        **{name: part.state_dict() if part is not None else None
           for name, part in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler))},
        "epoch": epoch, "step": step, "metric": metric,
        "rng": capture_rng_state(generator), "extra": dict(extra or {}),
    }, path)


def _reason(error: BaseException) -> str:
    """One line saying why torch.load failed; for the weights-only unpickler, what it objected to."""
    inner = error.__context__
    if isinstance(error, pickle.UnpicklingError) and isinstance(inner, Exception) and str(inner).strip():
        text = str(inner)
    else:
        text = str(error).split("WeightsUnpickler error:", 1)[-1].split("Check the documentation", 1)[0]
    text = " ".join(text.split()).split(" Please use", 1)[0].strip()
    return text or type(error).__name__


def read_checkpoint(path: str | Path, *, map_location: Any = "cpu") -> dict:
    """The raw contents of a checkpoint file, read with weights_only=True; clear errors naming the file."""
    path = _check_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} " + ("is not a file" if path.exists() else "does not exist"))
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): an interrupted copy or a non-atomic write?")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError,
            KeyError) as error:
        reason = _reason(error)
        if isinstance(error, pickle.UnpicklingError) and "global" in reason.lower():
            raise CheckpointError(
                f"checkpoint {path} was refused by torch.load(weights_only=True): it holds objects other than "
                f"tensors and plain values, which could run code when unpickled ({reason}). Only if you trust "
                f"where the file came from, allow the named classes with torch.serialization.add_safe_globals([...])."
            ) from error
        if "Attempting to deserialize object on" in str(error):
            raise CheckpointError(f"checkpoint {path} holds tensors saved on a device this machine does not have "
                                  f"({str(error).splitlines()[0]}); load it with map_location='cpu' (the default "
                                  f"of load_checkpoint) or another device here") from error
        raise CheckpointError(f"checkpoint {path} ({size} bytes) cannot be read: truncated or corrupted "
                              f"({type(error).__name__}: {reason[:300]})") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "model" not in payload:
        found = sorted(map(str, payload))[:8] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"checkpoint {path} was not written by save_checkpoint "
                              f"(expected format {FORMAT!r}; found {found})")
    return payload


def check_state_dict_matches(model: nn.Module, state_dict: Mapping[str, Any], *, source: str = "state_dict") -> None:
    """Raise CheckpointError listing missing keys, unexpected keys and shape mismatches, if any."""
    def listed(items: list[str], limit: int = 6) -> str:
        return ", ".join(items[:limit]) + (f", ... ({len(items)} in all)" if len(items) > limit else "")

    expected = unwrap_model(model).state_dict()
    problems = {
        "missing keys": [key for key in expected if key not in state_dict],
        "unexpected keys": [key for key in state_dict if key not in expected],
        "shape mismatches": [f"{key}: file {tuple(state_dict[key].shape)} vs model {tuple(value.shape)}"
                             for key, value in expected.items()
                             if isinstance(state_dict.get(key), torch.Tensor) and state_dict[key].shape != value.shape],
    }
    if any(problems.values()):
        raise CheckpointError(f"{source} does not fit the model {type(unwrap_model(model)).__name__} (is it a "
                              f"checkpoint of a different model?); "
                              + "; ".join(f"{kind}: {listed(items)}" for kind, items in problems.items() if items))


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler=None, scaler=None, *, generator: torch.Generator | None = None,
                    map_location: Any = "cpu", restore_rng: bool = True) -> dict:
    """Load a save_checkpoint file into the given objects (and RNG states); return epoch, step and the rest.

    Reads with torch.load(weights_only=True); `map_location` (default "cpu") lets a GPU checkpoint load on a
    machine without one. A wrong file fails naming missing / unexpected keys and shape mismatches, before
    anything is changed. `restore_rng=False` leaves the global random states alone (not the generator).
    """
    _check_objects(model, optimizer, scheduler, scaler, generator)
    payload = read_checkpoint(path, map_location=map_location)
    path = Path(path)
    model_state = _strip_wrapper_prefixes(payload["model"])
    check_state_dict_matches(model, model_state, source=f"checkpoint {path}")
    if generator is not None and (payload.get("rng") or {}).get("generator") is None:
        raise CheckpointError(f"checkpoint {path} holds no generator state (it was saved without "
                              f"generator=...), but a generator was passed to restore")
    # The optimizer first: it checks its parameter groups before changing anything (the model stays untouched).
    for name, target in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if target is None:
            continue
        if payload.get(name) is None:
            raise CheckpointError(f"checkpoint {path} holds no {name} state (it was saved without a {name}), "
                                  f"but a {name} was passed to load it into")
        try:
            target.load_state_dict(payload[name])
        except (ValueError, KeyError, RuntimeError, TypeError) as error:
            raise CheckpointError(f"checkpoint {path}: its {name} state does not fit the {name} passed "
                                  f"({type(error).__name__}: {str(error).strip().splitlines()[0]})") from error
    unwrap_model(model).load_state_dict(model_state)
    if restore_rng:
        restore_rng_state(payload["rng"], generator)
    elif generator is not None:
        generator.set_state(payload["rng"]["generator"].cpu())
    return {"path": path, "epoch": payload["epoch"], "step": payload["step"], "metric": payload["metric"],
            "extra": payload["extra"]}


class CheckpointManager:
    """Checkpoints in one folder as `step-<step>.pt`: keeps the last `keep_last`, and the best as `best.pt`.

    One process writes to a folder at a time; a manager opening it removes temporary files of killed saves.
    """

    def __init__(self, folder: str | Path, *, keep_last: int = 3, mode: str = "min") -> None:
        self.folder = _check_path(folder, "folder")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be a positive int, got {keep_last!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' (lower metric is better) or 'max', got {mode!r}")
        self.keep_last, self.mode = keep_last, mode
        self.best_path = self.folder / "best.pt"
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(f".*{_TEMP_MARK}*"):
            stale.unlink(missing_ok=True)
        self.best_metric: float | None = read_checkpoint(self.best_path)["metric"] if self.best_path.exists() else None

    def checkpoints(self) -> list[Path]:
        """The step checkpoints in the folder, oldest first."""
        found = [path for path in self.folder.iterdir() if re.fullmatch(r"step-\d{8,}\.pt", path.name)]
        return sorted(found, key=lambda path: int(path.stem[len("step-"):]))

    def latest(self) -> Path | None:
        """The newest step checkpoint, or None."""
        return (self.checkpoints() or [None])[-1]

    def best(self) -> Path | None:
        """The best checkpoint, or None when no metric was ever given."""
        return self.best_path if self.best_path.exists() else None

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler=None, scaler=None,
             *, step: int, epoch: int = 0, metric: float | None = None, generator: torch.Generator | None = None,
             extra: Mapping[str, Any] | None = None) -> Path:
        """Save step `step`; update best.pt when `metric` improves; delete step files beyond the last k."""
        _check_counts_and_metric(metric, step=step)
        improved = metric is not None and (self.best_metric is None or (
            metric < self.best_metric if self.mode == "min" else metric > self.best_metric))
        path = save_checkpoint(self.folder / f"step-{step:08d}.pt", model, optimizer, scheduler, scaler,
                               epoch=epoch, step=step, metric=metric, generator=generator, extra=extra)
        if improved:
            # best.pt: a second name for the same bytes (a copy where links are not supported), put in place
            # by an atomic rename, so it survives when the step file is deleted.
            temp = self.folder / f".{self.best_path.name}{_TEMP_MARK}{os.getpid()}"
            temp.unlink(missing_ok=True)
            try:
                os.link(path, temp)
            except OSError:
                shutil.copyfile(path, temp)
                with open(temp, "rb+") as handle:
                    os.fsync(handle.fileno())
            os.replace(temp, self.best_path)
            _fsync_folder(self.folder)
            self.best_metric = metric
        for old in self.checkpoints()[: -self.keep_last]:
            old.unlink(missing_ok=True)
        return path

