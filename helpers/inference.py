"""Inference: autograd modes, one-sample prediction, and latency/throughput against batch size and threads."""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from .timing import median, synchronize, time_interleaved
from .tables import format_table  # noqa: F401  (re-exported: notebooks import it from here)

GRAD_MODES = ("plain", "no_grad", "inference_mode")


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_positive_ints(name: str, values) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of positive ints, got {values!r}")
    for value in values:
        _check_positive_int(f"each of {name}", value)
    if len(set(values)) != len(values):
        raise ValueError(f"{name} must not repeat a value, got {list(values)!r}")
    return list(values)


def _check_inputs(inputs) -> None:
    if not isinstance(inputs, torch.Tensor) or inputs.ndim < 1 or len(inputs) == 0:
        raise ValueError("inputs must be a tensor [N, ...] holding at least one sample, got "
                         f"{type(inputs).__name__}{tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else ''}")


def grad_mode(mode: str) -> contextlib.AbstractContextManager:
    """The autograd context for `mode`: 'plain' (graph recorded), 'no_grad' or 'inference_mode'."""
    if mode == "plain":
        return contextlib.nullcontext()
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference_mode":
        return torch.inference_mode()
    raise ValueError(f"mode must be one of {GRAD_MODES}, got {mode!r}")


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Put `model` in eval mode for the block, then back in the mode it was in."""
    _check_model(model)
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@contextlib.contextmanager
def num_threads(threads: int | None):
    """Run the block with torch.set_num_threads(threads) (None: leave as is); restore the old count after."""
    if threads is not None:
        _check_positive_int("threads", threads)
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(before)


def predict_one(model: nn.Module, sample: torch.Tensor) -> int:
    """Class predicted for ONE sample without a batch dimension (e.g. [C, H, W]), in eval mode."""
    _check_model(model)
    if not isinstance(sample, torch.Tensor) or sample.ndim < 1:
        raise ValueError("sample must be a tensor with at least one dimension and no batch dimension, got "
                         f"{type(sample).__name__}{tuple(sample.shape) if isinstance(sample, torch.Tensor) else ''}")
    param = next(model.parameters(), None)
    device = param.device if param is not None else sample.device
    with eval_mode(model), torch.inference_mode():
        logits = model(sample.unsqueeze(0).to(device))  # [1, *sample.shape]: a batch of one
    if logits.ndim != 2 or logits.shape[0] != 1:
        raise ValueError(f"model must return logits [1, classes] for a batch of one, got {tuple(logits.shape)}")
    return int(logits.argmax(dim=1).item())


def batch_from(inputs: torch.Tensor, batch_size: int) -> torch.Tensor:
    """A batch of `batch_size` samples taken from `inputs` [N, ...] in order, cycling when N is smaller."""
    _check_inputs(inputs)
    _check_positive_int("batch_size", batch_size)
    index = torch.arange(batch_size, device=inputs.device) % len(inputs)
    return inputs[index].contiguous()


def time_grad_modes(model: nn.Module, batch: torch.Tensor, *, modes: Sequence[str] = GRAD_MODES,
                    repeat: int = 5, warmup: int = 1, device: torch.device | str | None = None) -> dict[str, list[float]]:
    """Seconds per forward pass of `batch` under each autograd mode, timed in turns; the model's mode is kept."""
    _check_model(model)
    _check_inputs(batch)
    if not modes:
        raise ValueError("modes must name at least one of " + str(GRAD_MODES))
    for mode in modes:
        grad_mode(mode)  # validates the name

    def forward_in(mode: str) -> Callable[[], object]:
        def run() -> None:
            with grad_mode(mode):
                model(batch)  # in plain mode the graph is built here and freed when the output is dropped
        return run

    return time_interleaved({mode: forward_in(mode) for mode in modes}, repeat=repeat, warmup=warmup,
                            device=device)


def calls_per_timing(batch_size: int, min_samples: int) -> int:
    """How many forward calls one timed repetition makes so it covers at least `min_samples` samples."""
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("min_samples", min_samples)
    return max(1, math.ceil(min_samples / batch_size))


def measure_inference(model: nn.Module, inputs: torch.Tensor, *, batch_sizes: Sequence[int],
                      threads: Sequence[int] | None = (1, 2), repeat: int = 5, warmup: int = 1,
                      min_samples: int = 256, device: torch.device | str = "cpu",
                      progress: bool = False) -> list[dict]:
    """Median latency (seconds per batch) and throughput (samples/s) for every batch size and thread count.

    Runs in eval mode under torch.inference_mode(). Thread counts are timed in turns for each batch size,
    so a change in machine load hits them alike; `threads=None` keeps the current count. The model's
    mode and torch's thread count are restored afterwards.
    """
    _check_model(model)
    _check_inputs(inputs)
    sizes = _check_positive_ints("batch_sizes", batch_sizes)
    thread_counts = [None] if threads is None else _check_positive_ints("threads", threads)
    _check_positive_int("min_samples", min_samples)
    device = torch.device(device)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(sizes), desc="batch sizes", unit="size", leave=False)
    rows: list[dict] = []
    with eval_mode(model), num_threads(None):
        for batch_size in sizes:
            batch = batch_from(inputs, batch_size).to(device)
            calls = calls_per_timing(batch_size, min_samples)

            def run_with(count: int | None) -> Callable[[], object]:
                def run() -> None:
                    if count is not None:
                        torch.set_num_threads(count)
                    with torch.inference_mode():
                        for _ in range(calls):
                            model(batch)
                return run

            seconds = time_interleaved({count: run_with(count) for count in thread_counts},
                                       repeat=repeat, warmup=warmup, device=device)
            for count in thread_counts:
                latency = median(seconds[count]) / calls
                rows.append({"batch_size": batch_size, "threads": count if count is not None else torch.get_num_threads(),
                             "latency_s": latency, "throughput": batch_size / latency, "calls": calls})
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return rows


def thread_speedup(rows: Sequence[Mapping], *, baseline_threads: int = 1) -> dict[int, dict[int, float]]:
    """For each batch size: throughput with each thread count divided by throughput with `baseline_threads`."""
    _check_positive_int("baseline_threads", baseline_threads)
    if not rows:
        raise ValueError("rows must hold at least one measurement (as returned by measure_inference)")
    table: dict[int, dict[int, float]] = {}
    for row in rows:
        missing = {"batch_size", "threads", "throughput"} - set(row)
        if missing:
            raise ValueError(f"each row needs batch_size, threads and throughput; a row lacks {sorted(missing)}")
        table.setdefault(row["batch_size"], {})[row["threads"]] = row["throughput"]
    speedup: dict[int, dict[int, float]] = {}
    for batch_size, by_threads in table.items():
        if baseline_threads not in by_threads:
            raise ValueError(f"no row with threads={baseline_threads} for batch_size={batch_size}; "
                             f"measured thread counts: {sorted(by_threads)}")
        base = by_threads[baseline_threads]
        speedup[batch_size] = {count: value / base for count, value in sorted(by_threads.items())}
    return speedup


def series_by(rows: Sequence[Mapping], *, x: str, y: str, group: str, label: str = "{}") -> tuple[list, dict[str, list]]:
    """Rows regrouped for a line chart: shared x values and one y series per value of `group`."""
    if not rows:
        raise ValueError("rows must hold at least one row")
    for key in (x, y, group):
        if any(key not in row for row in rows):
            raise ValueError(f"every row must have the key {key!r}")
    xs = sorted({row[x] for row in rows})
    groups = sorted({row[group] for row in rows})
    series: dict[str, list] = {}
    for value in groups:
        points = {row[x]: row[y] for row in rows if row[group] == value}
        if set(points) != set(xs):
            raise ValueError(f"{group}={value!r} lacks rows for {x} in {sorted(set(xs) - set(points))}")
        series[label.format(value)] = [points[v] for v in xs]
    return xs, series


def compare_compiled(model: nn.Module, batch: torch.Tensor, *, repeat: int = 5, warmup: int = 1,
                     device: torch.device | str = "cpu") -> dict:
    """Eager vs torch.compile'd forward in eval mode: seconds of the first (compiling) call, then timed in turns.

    Returns compile_s, eager and compiled (lists of seconds per call) and max_abs_diff between their outputs.
    """
    _check_model(model)
    _check_inputs(batch)
    device = torch.device(device)
    batch = batch.to(device)
    with eval_mode(model):
        compiled = torch.compile(model)
        start = time.perf_counter()
        with torch.inference_mode():
            compiled_out = compiled(batch)
        synchronize(device)
        compile_s = time.perf_counter() - start

        def eager_call() -> None:
            with torch.inference_mode():
                model(batch)

        def compiled_call() -> None:
            with torch.inference_mode():
                compiled(batch)

        seconds = time_interleaved({"eager": eager_call, "compiled": compiled_call}, repeat=repeat,
                                   warmup=warmup, device=device)
        with torch.inference_mode():
            max_abs_diff = float((model(batch) - compiled_out).abs().max())
    return {"compile_s": compile_s, "eager": seconds["eager"], "compiled": seconds["compiled"],
            "max_abs_diff": max_abs_diff}

