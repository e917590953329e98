"""Finding where training time goes: the seconds a torch.profiler run spent under each `record_function` label,
and whether torch.compile can build kernels here. (What a speed-up bought is charted by the rig:
`helpers.rig.Measurement.speedup_chart`.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd import DeviceType


def seconds_by_label(profile: torch.profiler.profile, labels: Sequence[str]) -> dict[str, float]:
    """Seconds of CPU wall time spent inside each `record_function(label)` range of a finished profile, summed
    over the recorded steps (a range's time includes everything nested in it).

    With CUDA activities each label appears twice in `profile.key_averages()`: the CPU range, and a copy of it on
    the GPU's timeline (a user annotation, `device_type` CUDA, whose CPU time is 0). Only the CPU side counts here.
    """
    if isinstance(labels, str) or not labels:
        raise ValueError(f"labels must be a non-empty list of record_function names, got {labels!r}")
    microseconds: dict[str, float] = {}
    for event in profile.key_averages():
        if event.device_type == DeviceType.CPU:  # the same range on a GPU stream reports no CPU time
            microseconds[event.key] = microseconds.get(event.key, 0.0) + event.cpu_time_total
    missing = [label for label in labels if label not in microseconds]
    if missing:
        named = sorted(key for key in microseconds if not key.startswith(("aten::", "ProfilerStep")))[:12]
        raise ValueError(f"no record_function range named {missing} in the profile; it holds ranges such as {named}")
    return {label: microseconds[label] / 1e6 for label in labels}  # the profiler counts microseconds


def compile_ready(device: torch.device | str, *, compile_fn: Callable = torch.compile) -> tuple[bool, str]:
    """Whether torch.compile's default backend builds and runs a kernel on `device` here (it needs a C++ compiler
    on the CPU, Triton on a GPU), with the reason when it does not. The first call imports the compiler stack."""

    def probe(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + 1

    x = torch.ones(3, device=device)
    try:
        result = compile_fn(probe)(x)
    except Exception as error:  # a missing compiler surfaces as many error types, deep inside inductor
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return False, f"{type(error).__name__}: {reason[:200]}"
    if not torch.allclose(result, probe(x)):
        return False, "the compiled function returned a wrong result"
    return True, f"torch.compile built and ran a kernel on {x.device.type}"
