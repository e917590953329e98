"""Mixed precision, looked at: dtypes each layer outputs under autocast, CPU 16-bit support, bytes per sample.

`record_output_dtypes` hooks every layer to see what autocast did; `cpu_low_precision_flags` says whether
this CPU has bf16/fp16 matrix instructions; `per_sample_and_fixed_bytes` splits saved-activation bytes
measured at several batch sizes into a part that grows with the batch and a fixed part.
"""
from __future__ import annotations

import contextlib
import platform
from pathlib import Path
from typing import Iterator, Mapping

import torch
from torch import nn

LOW_PRECISION_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


@contextlib.contextmanager
def record_output_dtypes(model: nn.Module, *, leaves_only: bool = True) -> Iterator[list[dict]]:
    """Record, for every forward call of a submodule inside the block, its name, type and output dtype.

    Yields a list that fills with {'name', 'type', 'dtype'} dicts in call order; hooks are removed on exit.
    `leaves_only` records only modules without children (Linear, ReLU, ...), not containers.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    records: list[dict] = []
    handles = []

    def hook_for(name: str):
        def hook(module: nn.Module, args, output) -> None:
            first = output[0] if isinstance(output, (tuple, list)) and output else output
            dtype = first.dtype if isinstance(first, torch.Tensor) else None
            records.append({"name": name or "(model)", "type": type(module).__name__, "dtype": dtype})
        return hook

    for name, module in model.named_modules():
        if leaves_only and next(module.children(), None) is not None:
            continue
        handles.append(module.register_forward_hook(hook_for(name)))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def cpu_low_precision_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str] | None:
    """The CPU's 16-bit matrix instructions (AVX512-BF16, AMX, AVX512-FP16) listed in /proc/cpuinfo.

    An empty list means the CPU has none (bf16/fp16 math is emulated, slower than fp32); None means
    unknown (not Linux/x86, or no cpuinfo to read).
    """
    path = Path(cpuinfo)
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return [flag for flag in LOW_PRECISION_CPU_FLAGS if flag in flags]
    return None if platform.machine().lower() not in ("x86_64", "amd64") else []


def per_sample_and_fixed_bytes(bytes_by_batch: Mapping[int, int]) -> tuple[float, float]:
    """Split byte counts measured at several batch sizes into (bytes per sample, fixed bytes).

    The counts must lie on one straight line bytes = per_sample * batch + fixed (saved activations do):
    the line goes through the smallest and largest batch, and every other point must sit on it.
    """
    if not isinstance(bytes_by_batch, Mapping) or len(bytes_by_batch) < 2:
        raise ValueError(f"bytes_by_batch must map at least two batch sizes to byte counts, got {bytes_by_batch!r}")
    for batch, count in bytes_by_batch.items():
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"every batch size must be a positive int, got {batch!r}")
        if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
            raise ValueError(f"every byte count must be a number >= 0, got {count!r} for batch {batch}")
    small, large = min(bytes_by_batch), max(bytes_by_batch)
    per_sample = (bytes_by_batch[large] - bytes_by_batch[small]) / (large - small)
    fixed = bytes_by_batch[small] - per_sample * small
    for batch, count in bytes_by_batch.items():
        predicted = per_sample * batch + fixed
        if abs(predicted - count) > 1e-6 * max(1.0, abs(count)):
            raise ValueError(f"the byte counts are not linear in the batch size: batch {batch} has {count}, "
                             f"the line through batches {small} and {large} predicts {predicted:.1f}")
    return per_sample, fixed
