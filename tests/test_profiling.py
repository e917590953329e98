"""The profiling helpers: seconds per record_function label, the torch.compile readiness check, the speed-up chart."""

import time

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEventAvg
from torch.profiler import ProfilerActivity, profile, record_function

from helpers.profiling import compile_ready, graphs_compiled, parts_table, seconds_by_label


@pytest.fixture(scope="module")
def nested_profile():
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("outer"):
                y = x @ x
                with record_function("inner"):
                    y = (y @ x).relu()
    return prof


def test_seconds_by_label_sums_each_labelled_range_and_its_children(nested_profile):
    seconds = seconds_by_label(nested_profile, ["outer", "inner"])
    assert list(seconds) == ["outer", "inner"]
    assert all(isinstance(value, float) and value > 0 for value in seconds.values())
    assert seconds["outer"] >= seconds["inner"]  # inner runs inside outer: its time is part of outer's


SLEEP_S = 0.02  # each of the 3 recorded steps sleeps this long inside "inner", which runs inside "outer"


@pytest.fixture(scope="module")
def sleeping_profile():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("outer"):
                torch.ones(8).sum()
                with record_function("inner"):
                    time.sleep(SLEEP_S)
    return prof


def test_seconds_by_label_counts_seconds_and_includes_what_is_nested(sleeping_profile):
    seconds = seconds_by_label(sleeping_profile, ["outer", "inner"])
    slept = 3 * SLEEP_S
    assert slept <= seconds["inner"] < slept + 1.0  # seconds: not milliseconds (x1000) nor microseconds
    assert seconds["outer"] >= seconds["inner"]  # the inner range's time is part of the outer one's


class _Profile:
    """What seconds_by_label reads from a finished torch.profiler.profile: key_averages()."""

    def __init__(self, events):
        self.events = events

    def key_averages(self):
        return self.events


def _average(key: str, device_type: DeviceType, cpu_us: int, device_us: int = 0) -> FunctionEventAvg:
    """A key_averages() row as the profiler builds it: one per label and device side (times in microseconds)."""
    event = FunctionEventAvg()
    event.key, event.count, event.device_type = key, 5, device_type
    event.cpu_time_total, event.device_time_total = cpu_us, device_us
    return event


@pytest.mark.parametrize("gpu_copy_first", [False, True])
def test_seconds_by_label_takes_the_cpu_range_when_cuda_adds_a_gpu_copy_of_each_label(gpu_copy_first):
    """With CUDA activities each label is listed twice: the CPU range and its GPU-side annotation (CPU time 0)."""
    rows = []
    for label, cpu_us in [("load", 2_500_000), ("forward", 40_000)]:
        cpu, gpu = _average(label, DeviceType.CPU, cpu_us), _average(label, DeviceType.CUDA, 0, cpu_us * 9 // 10)
        rows += [gpu, cpu] if gpu_copy_first else [cpu, gpu]
    seconds = seconds_by_label(_Profile(rows), ["load", "forward"])
    assert seconds == {"load": pytest.approx(2.5), "forward": pytest.approx(0.04)}  # microseconds / 1e6


def test_seconds_by_label_refuses_a_label_found_only_on_the_gpu_side():
    rows = [_average("load", DeviceType.CPU, 10), _average("forward", DeviceType.CUDA, 0, 5)]
    with pytest.raises(ValueError, match=r"no record_function range named \['forward'\].*'load'"):
        seconds_by_label(_Profile(rows), ["load", "forward"])


def test_seconds_by_label_names_a_missing_label_and_what_the_profile_holds(nested_profile):
    with pytest.raises(ValueError, match=r"no record_function range named \['load'\].*'inner'"):
        seconds_by_label(nested_profile, ["outer", "load"])
    with pytest.raises(ValueError, match="non-empty list"):
        seconds_by_label(nested_profile, "outer")


def test_compile_ready_reports_why_compilation_failed():
    def broken_compile(fn):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    ok, why = compile_ready("cpu", compile_fn=broken_compile)
    assert not ok and why == "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    assert compile_ready("cpu", compile_fn=lambda fn: fn)[0]  # a "compiler" that returns the function as it is
    ok, why = compile_ready("cpu", compile_fn=lambda fn: lambda x: fn(x) + 1)
    assert not ok and "wrong result" in why


def test_parts_table_gives_ms_per_step_and_the_share_of_one_label():
    seconds = {0: {"load": 0.3, "compute": 0.1}, 2: {"load": 0.05, "compute": 0.1}}  # over 10 steps
    table = parts_table(seconds, steps=10, share_of="load", key="workers", title="per step")
    lines = table.splitlines()
    assert lines[0] == "per step"
    assert lines[1].split() == ["workers", "load", "ms", "compute", "ms", "load", "share"]
    assert lines[3].split() == ["0", "30.000", "10.000", "75%"]  # 0.3 s over 10 steps; 0.3 of 0.4
    assert lines[4].split() == ["2", "5.000", "10.000", "33%"]


def test_parts_table_refuses_an_unknown_share_and_runs_with_other_labels():
    with pytest.raises(ValueError, match="share_of must be one of the labels"):
        parts_table({0: {"load": 1.0}}, steps=1, share_of="loader")
    with pytest.raises(ValueError, match="run 2 has"):
        parts_table({0: {"load": 1.0}, 2: {"forward": 1.0}}, steps=1, share_of="load")
    with pytest.raises(ValueError, match="steps must be a positive int"):
        parts_table({0: {"load": 1.0}}, steps=0, share_of="load")


def test_graphs_compiled_counts_a_recompile_per_new_batch_size_unless_dimension_0_is_dynamic():
    """Batches of 8, 6 and 4 rows: dynamic=False compiles each, the default recompiles once with the size as a
    symbol, mark_dynamic compiles one graph for every size."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    batches = [torch.randn(rows, 3) for rows in (8, 6, 4)]
    assert graphs_compiled(layer, batches, dynamic=False) == 3
    assert graphs_compiled(layer, batches) == 2
    assert graphs_compiled(layer, [b.clone() for b in batches], mark_dynamic=True) == 1
    assert graphs_compiled(layer, batches[:1]) == 1


def test_graphs_compiled_refuses_a_single_tensor():
    with pytest.raises(TypeError, match="inputs must be a non-empty sequence of tensors"):
        graphs_compiled(torch.nn.Linear(3, 2), torch.randn(4, 3))


def test_forward_calls_counts_each_child_module_again_when_checkpointing_recomputes_it():
    from torch.utils.checkpoint import checkpoint_sequential

    from helpers.models import deep_linear_stack
    from helpers.profiling import forward_calls

    stack, x = deep_linear_stack(4, 3), torch.randn(2, 4)  # 6 modules
    plain = forward_calls(stack, lambda: stack(x).sum().backward())
    checkpointed = forward_calls(
        stack, lambda: checkpoint_sequential(stack, 2, x, use_reentrant=False).sum().backward()
    )
    assert plain == len(stack) == 6
    assert checkpointed == 6 + 3  # the first of two segments (3 modules) runs again in backward
    assert all(not module._forward_pre_hooks for module in stack)  # the counting hooks are gone


def test_forward_calls_removes_its_hooks_when_the_run_fails_and_checks_its_arguments():
    from helpers.models import deep_linear_stack
    from helpers.profiling import forward_calls

    stack = deep_linear_stack(4, 2)

    def failing():
        stack(torch.randn(2, 4))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        forward_calls(stack, failing)
    assert all(not module._forward_pre_hooks for module in stack)
    with pytest.raises(ValueError, match="child modules"):
        forward_calls(torch.nn.Linear(2, 2), lambda: None)
    with pytest.raises(TypeError, match="run"):
        forward_calls(stack, None)
    with pytest.raises(TypeError, match="model"):
        forward_calls("stack", lambda: None)
