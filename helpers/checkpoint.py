"""Training-state checkpoints: atomic save, safe and checked load, RNG states, keep-last-k-and-best.

    path = save_checkpoint("checkpoints/run.pt", model, optimizer, scheduler, scaler,
                           epoch=epoch, step=step, best_metric=best, generator=loader_generator)
    state = load_checkpoint(path, model, optimizer, scheduler, scaler, generator=loader_generator)
    epoch, step = state["epoch"], state["step"]

Files are written to a temporary file in the same folder, flushed and fsync'ed, then renamed over the
target, so a crash during a save leaves the previous checkpoint intact. Loading always uses
`torch.load(weights_only=True)`: a file can hold tensors, numbers, strings and plain containers, never
code that runs when it is opened.

The other meaning of the word, activation checkpointing (`torch.utils.checkpoint`), has one function here:
`checkpoint_segments_sweep` measures what `checkpoint_sequential` saves and costs per segment count.
"""
from __future__ import annotations

import math
import os
import pickle
import random
import re
import secrets
import shutil
import zipfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

FORMAT = "helpers.checkpoint/1"
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SAFE_LEAVES = (str, int, float, bool, type(None), torch.Tensor, torch.Size, torch.dtype, torch.device)
_TEMP_MARK = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: unreadable, not a checkpoint, or made for another model."""


# ---------------------------------------------------------------------------------------------- models


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
    """Drop `module.` / `_orig_mod.` prefixes when every key carries them (a file saved from a wrapper)."""
    state = dict(state_dict)
    changed = True
    while changed and state:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if all(key.startswith(prefix) for key in state):
                state = {key[len(prefix):]: value for key, value in state.items()}
                changed = True
    return state


# ------------------------------------------------------------------------------------------ RNG states


def capture_rng_state(generator: torch.Generator | None = None) -> dict:
    """The states of python's `random`, numpy, torch (CPU, CUDA, MPS) and an optional DataLoader generator.

    Everything is stored as tensors, ints and floats, so it loads under `weights_only=True`.
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    version, internal, gauss_next = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
        # Only once CUDA is in use: asking earlier would start a CUDA context just to save default states.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "mps": None,
        "generator": generator.get_state() if generator is not None else None,
    }
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng_state(state: Mapping[str, Any], generator: torch.Generator | None = None) -> None:
    """Put back the states from `capture_rng_state` (the generator's too, when one is passed)."""
    if not isinstance(state, Mapping) or not {"python", "numpy", "torch"} <= set(state):
        raise ValueError("state must be a dict from capture_rng_state with keys 'python', 'numpy' and 'torch'")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    python = state["python"]
    random.setstate((python["version"], tuple(int(v) for v in python["internal"].tolist()), python["gauss_next"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].cpu().numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = state.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        # A checkpoint from a machine with more GPUs restores as many devices as are visible here.
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)
    mps = getattr(torch.backends, "mps", None)
    if state.get("mps") is not None and mps is not None and mps.is_available():
        torch.mps.set_rng_state(state["mps"].cpu())
    if generator is not None:
        if state.get("generator") is None:
            raise ValueError("a generator was passed, but the saved RNG state holds none "
                             "(it was saved without generator=...)")
        generator.set_state(state["generator"].cpu())


# ---------------------------------------------------------------------------------------------- saving


def _check_plain(value: Any, where: str) -> None:
    if isinstance(value, _SAFE_LEAVES):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} keys must be str or int, got {type(key).__name__} {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(f"{where} must hold only tensors, numbers, strings, None and dicts/lists/tuples of them "
                    f"(what weights_only=True loads), got {type(value).__name__}")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def _check_metric(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number (not NaN) or None, got {value!r}")


def _check_stateful(name: str, value: Any) -> None:
    if value is not None and not (callable(getattr(value, "state_dict", None))
                                  and callable(getattr(value, "load_state_dict", None))):
        raise TypeError(f"{name} must have state_dict() and load_state_dict() or be None, got {type(value).__name__}")


def _check_objects(model, optimizer, scheduler, scaler) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    _check_stateful("scheduler", scheduler)
    _check_stateful("scaler", scaler)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """torch.save to a temporary file next to `path`, flush + fsync, rename over `path`, fsync the folder."""
    path = Path(path)
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
                    scheduler=None, scaler=None, *, epoch: int = 0, step: int = 0,
                    best_metric: float | None = None, generator: torch.Generator | None = None,
                    extra: Mapping[str, Any] | None = None, metric: float | None = None,
                    rng: bool = True) -> Path:
    """Atomically write model, optimizer, scheduler, scaler, counters, best metric and RNG states to `path`.

    The model is unwrapped first (no `module.` / `_orig_mod.` prefixes). `extra` must be a dict of plain
    values (tensors, numbers, strings, lists, dicts) so the file still loads with weights_only=True.
    `metric` is this checkpoint's own score (CheckpointManager uses it); `rng=False` leaves RNG states out.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a Path, got {type(path).__name__}")
    _check_objects(model, optimizer, scheduler, scaler)
    _check_count("epoch", epoch)
    _check_count("step", step)
    _check_metric("best_metric", best_metric)
    _check_metric("metric", metric)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
        _check_plain(extra, "extra")
    payload = {
        "format": FORMAT,
        "torch_version": str(torch.__version__),
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "epoch": epoch,
        "step": step,
        "best_metric": best_metric,
        "metric": metric,
        "rng": capture_rng_state(generator) if rng else None,
        "extra": dict(extra) if extra is not None else {},
    }
    return atomic_torch_save(payload, path)


# --------------------------------------------------------------------------------------------- loading


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _unpickler_reason(error: BaseException) -> str:
    """What the weights-only unpickler objected to: torch wraps it in a long message and keeps it as context."""
    inner = error.__context__
    if isinstance(inner, Exception) and str(inner).strip():
        text = " ".join(str(inner).split())
    else:
        text = str(error)
        text = text.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation", 1)[0]
        text = " ".join(text.split()) or _first_line(error)
    return text.split(" Please use", 1)[0].strip()


def read_checkpoint(path: str | Path, *, map_location: Any = "cpu") -> dict:
    """The raw contents of a checkpoint file, read with weights_only=True; clear errors naming the file."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a Path, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} is not a file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): an interrupted copy or a non-atomic write?")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        reason = _unpickler_reason(error)
        if "global" not in reason.lower():  # not a forbidden object: bytes that are no valid pickle at all
            raise CheckpointError(f"checkpoint {path} ({path.stat().st_size} bytes) cannot be read: truncated or "
                                  f"corrupted ({reason})") from error
        raise CheckpointError(
            f"checkpoint {path} was refused by torch.load(weights_only=True): it holds objects other than "
            f"tensors and plain values, which could run code when unpickled ({reason}). "
            f"Only if you trust where the file came from, allow the named classes with "
            f"torch.serialization.add_safe_globals([...])."
        ) from error
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError, KeyError) as error:
        if "Attempting to deserialize object on" in str(error):
            raise CheckpointError(f"checkpoint {path} holds tensors saved on a device this machine does not have "
                                  f"({_first_line(error)}); load it with map_location='cpu' (the default "
                                  f"of load_checkpoint) or another device here") from error
        raise CheckpointError(
            f"checkpoint {path} ({path.stat().st_size} bytes) cannot be read: truncated or corrupted "
            f"({type(error).__name__}: {_first_line(error)})"
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "model" not in payload:
        found = sorted(map(str, payload))[:8] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"checkpoint {path} was not written by save_checkpoint "
                              f"(expected format {FORMAT!r}; found {found})")
    return payload


def _list(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def check_state_dict_matches(model: nn.Module, state_dict: Mapping[str, Any], *, source: str = "state_dict") -> None:
    """Raise CheckpointError listing missing keys, unexpected keys and shape mismatches, if any."""
    expected = unwrap_model(model).state_dict()
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    shapes = [f"{key}: file {tuple(state_dict[key].shape)} vs model {tuple(value.shape)}"
              for key, value in expected.items()
              if key in state_dict and isinstance(state_dict[key], torch.Tensor)
              and tuple(state_dict[key].shape) != tuple(value.shape)]
    if missing or unexpected or shapes:
        problems = []
        if missing:
            problems.append(f"missing keys: {_list(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {_list(unexpected)}")
        if shapes:
            problems.append(f"shape mismatches: {_list(shapes, 4)}")
        raise CheckpointError(f"{source} does not fit the model {type(unwrap_model(model)).__name__} "
                              f"(is it a checkpoint of a different model?); " + "; ".join(problems))


def _load_part(path: Path, name: str, target, state) -> None:
    if target is None:
        return
    if state is None:
        raise CheckpointError(f"checkpoint {path} holds no {name} state (it was saved without a {name}), "
                              f"but a {name} was passed to load it into")
    try:
        target.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path}: its {name} state does not fit the {name} passed "
                              f"({type(error).__name__}: {_first_line(error)})") from error


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler=None, scaler=None, *, generator: torch.Generator | None = None,
                    map_location: Any = "cpu", restore_rng: bool = True) -> dict:
    """Load a save_checkpoint file into the given objects (and RNG states); return epoch, step and the rest.

    Always reads with torch.load(weights_only=True); `map_location` (default "cpu") lets a checkpoint saved
    on a GPU load on a machine without one. The model is checked first, so a wrong file fails with its
    missing / unexpected keys and shape mismatches, before anything is changed.
    """
    _check_objects(model, optimizer, scheduler, scaler)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    payload = read_checkpoint(path, map_location=map_location)
    path = Path(path)
    model_state = _strip_wrapper_prefixes(payload["model"])
    check_state_dict_matches(model, model_state, source=f"checkpoint {path}")
    if restore_rng and payload.get("rng") is None:
        raise CheckpointError(f"checkpoint {path} holds no RNG states (saved with rng=False); "
                              f"pass restore_rng=False to load it anyway")
    if generator is not None and (payload.get("rng") or {}).get("generator") is None:
        raise CheckpointError(f"checkpoint {path} holds no generator state (it was saved without "
                              f"generator=...), but a generator was passed to restore")
    # The optimizer first: it checks its parameter groups before changing anything, so a mismatch
    # fails with the model still untouched.
    _load_part(path, "optimizer", optimizer, payload.get("optimizer"))
    _load_part(path, "scheduler", scheduler, payload.get("scheduler"))
    _load_part(path, "scaler", scaler, payload.get("scaler"))
    unwrap_model(model).load_state_dict(model_state)
    if restore_rng:
        restore_rng_state(payload["rng"], generator)
    elif generator is not None:
        generator.set_state(payload["rng"]["generator"].cpu())
    return {"path": path, "epoch": payload["epoch"], "step": payload["step"],
            "best_metric": payload.get("best_metric"), "metric": payload.get("metric"),
            "extra": payload.get("extra", {}), "torch_version": payload.get("torch_version")}


# --------------------------------------------------------------------------------------------- manager


class CheckpointManager:
    """Checkpoints in one folder as `<prefix>-<step>.pt`: keeps the last `keep_last`, and the best as `best.pt`.

    One process writes to a folder at a time. Temporary files left by a process killed during a save are
    removed when a manager opens the folder.
    """

    def __init__(self, folder: str | Path, *, keep_last: int = 3, mode: str = "min", prefix: str = "step") -> None:
        if not isinstance(folder, (str, os.PathLike)):
            raise TypeError(f"folder must be a str or a Path, got {type(folder).__name__}")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be a positive int, got {keep_last!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' (lower metric is better) or 'max', got {mode!r}")
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_]+", prefix):
            raise ValueError(f"prefix must be letters, digits or _, got {prefix!r}")
        self.folder = Path(folder)
        self.keep_last, self.mode, self.prefix = keep_last, mode, prefix
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.pt")
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(f".*{_TEMP_MARK}*"):
            stale.unlink(missing_ok=True)
        self.best_metric: float | None = None
        if self.best_path.exists():
            self.best_metric = read_checkpoint(self.best_path).get("metric")

    @property
    def best_path(self) -> Path:
        """Where the best checkpoint lives."""
        return self.folder / "best.pt"

    def path_for(self, step: int) -> Path:
        """The file name for a step."""
        _check_count("step", step)
        return self.folder / f"{self.prefix}-{step:08d}.pt"

    def checkpoints(self) -> list[Path]:
        """The step checkpoints in the folder, oldest first."""
        found = [(int(match.group(1)), path) for path in self.folder.iterdir()
                 if (match := self._pattern.fullmatch(path.name))]
        return [path for _, path in sorted(found)]

    def latest(self) -> Path | None:
        """The newest step checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def best(self) -> Path | None:
        """The best checkpoint, or None when no metric was ever given."""
        return self.best_path if self.best_path.exists() else None

    def is_better(self, metric: float) -> bool:
        """Whether `metric` beats the best so far."""
        if self.best_metric is None:
            return True
        return metric < self.best_metric if self.mode == "min" else metric > self.best_metric

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler=None, scaler=None,
             *, step: int, epoch: int = 0, metric: float | None = None, generator: torch.Generator | None = None,
             extra: Mapping[str, Any] | None = None) -> Path:
        """Save step `step`; update best.pt when `metric` improves; delete step files beyond the last k."""
        _check_metric("metric", metric)
        improved = metric is not None and self.is_better(metric)
        best = metric if improved else self.best_metric
        path = save_checkpoint(self.path_for(step), model, optimizer, scheduler, scaler, epoch=epoch, step=step,
                               best_metric=best, generator=generator, extra=extra, metric=metric)
        if improved:
            self._publish_best(path)
            self.best_metric = metric
        for old in self.checkpoints()[: -self.keep_last]:
            old.unlink(missing_ok=True)
        return path

    def _publish_best(self, path: Path) -> None:
        temp = self.folder / f".{self.best_path.name}{_TEMP_MARK}{os.getpid()}"
        temp.unlink(missing_ok=True)
        try:
            os.link(path, temp)  # a second name for the same bytes: no copy, survives deleting `path`
        except OSError:
            shutil.copyfile(path, temp)
            with open(temp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(temp, self.best_path)
        _fsync_folder(self.folder)

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler=None,
                    scaler=None, *, generator: torch.Generator | None = None, map_location: Any = "cpu") -> dict | None:
        """Load the newest step checkpoint into the objects; None when the folder holds none."""
        latest = self.latest()
        if latest is None:
            return None
        return load_checkpoint(latest, model, optimizer, scheduler, scaler, generator=generator,
                               map_location=map_location)


# ------------------------------------------------------------- activation checkpointing (recomputation)


def checkpoint_segments_sweep(model: nn.Sequential, inputs: torch.Tensor, segments: Sequence[int], *,
                              repeat: int = 5, warmup: int = 1) -> list[dict]:
    """Per segment count (0 = plain forward): bytes kept for backward, modules recomputed, step time, CUDA peak.

    Runs `torch.utils.checkpoint.checkpoint_sequential(model, s, inputs, use_reentrant=False)` then
    `.sum().backward()`. `saved_bytes` is what autograd keeps from the forward pass until backward
    (helpers.memory.saved_tensors_meter, weights excluded); recomputed activations live only briefly
    during backward and are not in it. `cuda_peak_bytes` (GPU only, else None) is the allocator's peak
    above what was allocated before the step, recomputation included. Times are interleaved medians.
    """
    from torch.utils.checkpoint import checkpoint_sequential

    from .memory import peak_memory, saved_tensors_meter
    from .timing import median, time_interleaved

    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential (what checkpoint_sequential splits), got {type(model).__name__}")
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(f"inputs must be a tensor, got {type(inputs).__name__}")
    segments = list(segments)
    if not segments or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= len(model)
                           for s in segments):
        raise ValueError(f"segments must be a non-empty list of ints in [0, {len(model)}] "
                         f"(0 = no checkpointing), got {segments!r}")
    device = inputs.device
    calls = [0]
    hooks = [module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for module in model]

    def step(count: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        if count == 0:
            return model(inputs)
        return checkpoint_sequential(model, count, inputs, use_reentrant=False)

    rows = []
    try:
        for count in segments:
            calls[0] = 0
            with saved_tensors_meter(exclude=model) as meter:
                output = step(count)
                forward_calls = calls[0]
                kept = meter.bytes
                output.sum().backward()
            row = {"segments": count, "saved_bytes": kept, "saved_peak_bytes": meter.peak_bytes,
                   "recomputed_modules": calls[0] - forward_calls, "cuda_peak_bytes": None}
            if device.type == "cuda":
                del output
                model.zero_grad(set_to_none=True)
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                with peak_memory(device) as peak:
                    step(count).sum().backward()
                row["cuda_peak_bytes"] = peak.bytes - before
            rows.append(row)
    finally:
        for hook in hooks:
            hook.remove()
    times = time_interleaved({str(count): (lambda c=count: step(c).sum().backward()) for count in segments},
                             repeat=repeat, warmup=warmup, device=device)
    baseline = times.get("0")
    for row in rows:
        row["seconds"] = median(times[str(row["segments"])])
        row["time_ratio"] = (median(a / b for a, b in zip(times[str(row["segments"])], baseline))
                             if baseline is not None else None)
    return rows
