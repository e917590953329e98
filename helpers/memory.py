"""Memory meters: bytes saved for backward, model/optimizer state bytes, and peak memory."""

from __future__ import annotations

import contextlib
import re
import resource
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, (int, float)):
        raise TypeError(f"num_bytes must be a number, got {type(num_bytes).__name__}")
    value, unit = float(num_bytes), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.2f} {_UNITS[unit]}"


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (tensor.device.type, tensor.untyped_storage().data_ptr())


@dataclass
class SavedTensorsMeter:
    """What autograd saved for backward inside a `saved_tensors_meter` block."""

    excluded: set = field(default_factory=set)
    include_parameters: bool = False
    bytes: int = 0  # every storage saved during the block, each counted once while it is alive
    peak_bytes: int = 0  # the most that was alive (not yet freed by backward) at one time
    live_bytes: int = 0
    tensors: int = 0  # how many tensors autograd saved (views of one storage count separately)
    _live: dict = field(default_factory=dict)

    def _pack(self, tensor: torch.Tensor):
        self.tensors += 1
        key = _storage_key(tensor)
        if key in self.excluded or (not self.include_parameters and _is_leaf_storage(tensor)):
            return tensor
        return _Saved(self, key, tensor)

    def _add(self, key, nbytes: int) -> None:
        count, size = self._live.get(key, (0, nbytes))
        if count == 0:
            self.bytes += size
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._live[key] = (count + 1, size)

    def _release(self, key) -> None:
        count, size = self._live[key]
        if count == 1:
            del self._live[key]
            self.live_bytes -= size
        else:
            self._live[key] = (count - 1, size)


def _is_leaf_storage(tensor: torch.Tensor) -> bool:
    """True for a leaf that requires grad (a parameter) or a view of one (Linear saves `weight.t()`)."""
    base = tensor if tensor._base is None else tensor._base
    return base.is_leaf and base.requires_grad


class _Saved:
    """A saved tensor wrapped so the meter notices when autograd frees it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorsMeter, key, tensor: torch.Tensor) -> None:
        # Keep a detached alias (same storage, no grad_fn): holding a saved *output* itself would make a
        # cycle output -> grad_fn -> this object -> output that Python's collector cannot see through,
        # so a graph dropped without backward() would never be freed.
        self.meter, self.key, self.tensor = meter, key, tensor.detach()
        meter._add(key, tensor.untyped_storage().nbytes())

    def __del__(self) -> None:
        self.meter._release(self.key)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved


@contextlib.contextmanager
def saved_tensors_meter(
    exclude: nn.Module | Iterable[torch.Tensor] | None = None, *, include_parameters: bool = False
) -> Iterator[SavedTensorsMeter]:
    """Count the bytes autograd saves for backward in the block; `meter.bytes` afterwards.

    Autograd also saves weights (a Linear saves `weight.t()`, a view of the parameter; a convolution saves
    the weight itself), which cost no memory beyond the parameter. They are left out by default: any
    saved tensor that is, or is a view of, a leaf tensor requiring grad. `include_parameters=True` counts
    them too. `exclude` leaves out more tensors (a module's parameters and buffers, or a list of tensors),
    matched by storage. Saved values are kept as detached aliases, so it is for first-order backward
    (not create_graph=True).
    """
    if not isinstance(include_parameters, bool):
        raise TypeError(f"include_parameters must be True or False, got {include_parameters!r}")
    if exclude is None:
        tensors: list[torch.Tensor] = []
    elif isinstance(exclude, nn.Module):
        tensors = list(exclude.parameters()) + list(exclude.buffers())
    else:
        tensors = list(exclude)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("exclude must be an nn.Module, an iterable of tensors, or None")
    meter = SavedTensorsMeter(excluded={_storage_key(t) for t in tensors}, include_parameters=include_parameters)
    with torch.autograd.graph.saved_tensors_hooks(meter._pack, _unpack):
        yield meter


def saved_peak_bytes(
    run: Callable[[], object],
    *,
    exclude: nn.Module | Iterable[torch.Tensor] | None = None,
    include_parameters: bool = False,
) -> int:
    """The most bytes autograd held saved for backward at one time while `run()` ran (`saved_tensors_meter`'s peak)."""
    if not callable(run):
        raise TypeError(f"run must be a zero-argument call, got {type(run).__name__}")
    with saved_tensors_meter(exclude, include_parameters=include_parameters) as meter:
        run()
    return meter.peak_bytes


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes held by parameters, gradients, optimizer state and buffers (and their total)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    sizes = {
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer_state": 0,
        "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
    }
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    sizes["optimizer_state"] += value.numel() * value.element_size()
    sizes["total"] = sum(sizes.values())
    return sizes


@dataclass
class PeakMemory:
    """The peak memory seen in a `peak_memory` block; `kind` says what was measured."""

    device: torch.device
    kind: str
    bytes: int = 0
    start_bytes: int = 0  # CUDA: allocated when the block began, so `bytes - start_bytes` is the block's own peak


def _rss_high_water() -> int:
    status = Path("/proc/self/status")
    if status.exists():
        match = re.search(r"VmHWM:\s+(\d+) kB", status.read_text())
        if match:
            return int(match.group(1)) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_rss_high_water() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


@contextlib.contextmanager
def peak_memory(device: torch.device | str) -> Iterator[PeakMemory]:
    """Peak memory during the block: CUDA allocator peak on a GPU, process RSS high-water mark on CPU (coarse)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'cuda', 'mps' or 'cpu' (or a torch.device), got {device!r}") from error
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = PeakMemory(device, "CUDA allocator peak (torch.cuda.max_memory_allocated)")
        result.start_bytes = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result.bytes = torch.cuda.max_memory_allocated(device)
    elif device.type == "mps":
        result = PeakMemory(device, "MPS driver-allocated memory after the block (coarse)")
        yield result
        result.bytes = torch.mps.driver_allocated_memory()
    elif device.type == "cpu":
        reset = _reset_rss_high_water()
        label = "process resident-memory high-water mark (coarse: whole process" + (
            ", reset at block start)" if reset else ", since process start)"
        )
        result = PeakMemory(device, label)
        yield result
        result.bytes = _rss_high_water()
    else:
        raise ValueError(f"device must be cuda, mps or cpu, got {device}")


def process_gpu_bytes(device: torch.device | str) -> tuple[int, str]:
    """GPU memory this process holds as the driver counts it (the CUDA context included), and where it was read:
    nvidia-smi's line for this process, or, where it lists none (often inside a container), the GPU's total
    minus its free memory, which counts every process on it."""
    import os
    import subprocess

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device (the driver's count is read there), got {device}")
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=60).stdout.splitlines()
        rows = (line.split(",") for line in lines if "," in line)
        mib = next(int(used) for pid, used in rows if int(pid) == os.getpid())
        return mib * 2**20, "nvidia-smi, this process"
    except (OSError, subprocess.SubprocessError, StopIteration, ValueError):
        free, total = torch.cuda.mem_get_info(device)
        return total - free, "mem_get_info: total - free, all processes"


def cuda_allocator_bytes(nbytes: int) -> float:
    """What one tensor of `nbytes` occupies in PyTorch's CUDA caching allocator at its default settings.

    Every request is rounded up to 512 bytes. One between 1 and 10 MiB is cut from a 20 MiB segment that it
    shares with as many such blocks as fit whole (the allocator splits off no remainder under 1 MiB), so it
    costs 20 MiB / that many: a 4,000,000-byte tensor, five to a segment, costs 4 MiB.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    size = -(-nbytes // 512) * 512
    if 2**20 < size < 10 * 2**20:
        return 20 * 2**20 / (20 * 2**20 // size)
    return float(size)
