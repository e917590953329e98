"""Finding where training time goes: the seconds a torch.profiler run spent under each `record_function` label,
and whether torch.compile can build kernels here. (What a speed-up bought is charted by the rig:
`helpers.rig.Measurement.speedup_chart`.)"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

import torch
from torch.autograd import DeviceType

from .checks import check_int
from .timing import format_table


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


def parts_table(
    seconds: Mapping[Hashable, Mapping[str, float]], *, steps: int, share_of: str, key: str = "run", title: str = ""
) -> str:
    """Milliseconds per step under each label, one row per profiled run (`seconds_by_label` of each, summed over
    `steps` steps), and the share of the labels' total that `share_of` took."""
    check_int("steps", steps)
    if not seconds:
        raise ValueError("seconds must map at least one run to its seconds by label")
    labels = list(next(iter(seconds.values())))
    if share_of not in labels:
        raise ValueError(f"share_of must be one of the labels {labels}, got {share_of!r}")
    rows = []
    for run, parts in seconds.items():
        if list(parts) != labels:
            raise ValueError(f"every run must have the labels {labels}; run {run!r} has {list(parts)}")
        total = sum(parts.values())
        share = f"{parts[share_of] / total:.0%}" if total > 0 else "-"
        rows.append([run, *(1e3 * parts[label] / steps for label in labels), share])
    return format_table(rows, [key, *(f"{label} ms" for label in labels), f"{share_of} share"], title=title)


def graphs_compiled(
    fn: Callable, inputs: Sequence[torch.Tensor], *, dynamic: bool | None = None, mark_dynamic: bool = False
) -> int:
    """How many graphs torch.compile(fn, dynamic=dynamic) captures while it runs on each of `inputs` in turn: one,
    plus one per recompile. Its backend only counts the graphs it is given (a backend is a function of the captured
    graph) and runs them as traced. Every graph compiled before is forgotten first (`torch._dynamo.reset()`), and
    with `mark_dynamic` each input's dimension 0 is marked dynamic (`torch._dynamo.mark_dynamic`) before its call."""
    if isinstance(inputs, torch.Tensor) or not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise TypeError("inputs must be a non-empty sequence of tensors, one per call")
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counting_backend, dynamic=dynamic)
    for x in inputs:
        if mark_dynamic:
            torch._dynamo.mark_dynamic(x, 0)
        compiled(x)
    return len(graphs)


def forward_calls(model: torch.nn.Module, run: Callable[[], object]) -> int:
    """How many forward calls the model's direct children make while `run()` runs (forward and backward): a child
    run again during backward, as activation checkpointing recomputes it, counts again."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(run):
        raise TypeError(f"run must be a zero-argument call, got {type(run).__name__}")
    children = list(model.children())
    if not children:
        raise ValueError(f"model must have child modules to count, got a {type(model).__name__} without any")
    calls: list[torch.nn.Module] = []
    hooks = [child.register_forward_pre_hook(lambda module, _: calls.append(module)) for child in children]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return len(calls)
