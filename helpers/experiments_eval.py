"""The experiment of the evaluation & inference lesson: train a small CNN on the digits, evaluate it, time CPU inference."""
from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .data import DigitsDataset, make_loader
from .devices import pick_device, seed_everything
from .inference import compare_compiled, format_table, measure_inference, series_by
from .loop import evaluate, fit
from .models import SmallCNN
from .knobs import check_values, checkbox, choice, float_range, int_range

CPU_CORES = os.cpu_count() or 1

SPEC = {
    "seed": int_range(0, 10_000, description="seed"),
    "epochs": int_range(1, 20, description="epochs"),
    "channels": int_range(4, 64, step=4, description="conv channels"),
    "dropout": float_range(0.05, 0.8, 0.05, description="dropout"),
    "max_batch_size": choice([16, 64, 256, 1024], description="largest batch"),
    "max_threads": int_range(1, max(2, 2 * CPU_CORES), description="most threads"),
    "repeat": int_range(3, 30, description="timing repeats"),
    "compile": checkbox(description="torch.compile"),
}


def sweep_batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes timed: 1, 4, 16, ... (powers of 4) up to `max_batch_size`, which is always included."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 4
    return sizes + [max_batch_size]


def sweep_threads(max_threads: int) -> list[int]:
    """The thread counts timed: 1, 2, 4, ... (powers of 2) up to `max_threads`, which is always included."""
    if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
        raise ValueError(f"max_threads must be a positive int, got {max_threads!r}")
    counts, count = [], 1
    while count < max_threads:
        counts.append(count)
        count *= 2
    return counts + [max_threads]


@dataclass
class EvalRun:
    """What `run_experiment` produced: the trained model, its test metrics and the inference timings."""

    model: nn.Module
    device: torch.device
    history: list[dict]
    metrics: dict
    sweep: list[dict]
    gpu_sweep: list[dict] = field(default_factory=list)
    compiled: dict | None = None
    seconds: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return (f"EvalRun(accuracy={self.metrics['accuracy']:.4f}, f1_weighted={self.metrics['f1_weighted']:.4f}, "
                f"loss={self.metrics['loss']:.4f}, {len(self.sweep)} CPU timings"
                f"{', compiled' if self.compiled else ''}, on {self.device})")


def train_digits_cnn(*, seed: int, epochs: int, channels: int, dropout: float, device: torch.device,
                     batch_size: int = 64, lr: float = 3e-3, progress: bool = True) -> tuple[nn.Module, list[dict]]:
    """A SmallCNN trained with Adam on the 8x8 digits; returns it (on `device`) and its per-epoch history."""
    seed_everything(seed)
    train_loader = make_loader(DigitsDataset("train"), batch_size=batch_size, shuffle=True, seed=seed)
    test_loader = make_loader(DigitsDataset("test"), batch_size=256)
    model = SmallCNN(channels=channels, dropout=dropout).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)  # built after model.to(device)
    history = fit(model, train_loader, optimizer, F.cross_entropy, device=device, epochs=epochs,
                  val_loader=test_loader, progress=progress)
    return model, history


def _speed_figures(rows: list[dict], gpu_rows: list[dict]):
    import matplotlib.pyplot as plt

    xs, latency = series_by(rows, x="batch_size", y="latency_s", group="threads", label="CPU, {} thread(s)")
    _, throughput = series_by(rows, x="batch_size", y="throughput", group="threads", label="CPU, {} thread(s)")
    if gpu_rows:
        gpu = {row["batch_size"]: row for row in gpu_rows}
        latency["GPU"] = [gpu[x]["latency_s"] for x in xs]
        throughput["GPU"] = [gpu[x]["throughput"] for x in xs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name in latency:
        left.plot(xs, [1e3 * v for v in latency[name]], marker="o", label=name)
        right.plot(xs, throughput[name], marker="o", label=name)
    left.set(xlabel="batch size", ylabel="latency per batch (ms)", title="latency: lower is better")
    right.set(xlabel="batch size", ylabel="samples / s", title="throughput: higher is better")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    return figure


def run_experiment(seed: int = 0, epochs: int = 3, channels: int = 16, dropout: float = 0.3,
                   max_batch_size: int = 256, max_threads: int = 2, repeat: int = 5, compile: bool = False,
                   *, device: torch.device | str | None = None, show: bool = True,
                   progress: bool = True) -> EvalRun:
    """Train, evaluate (loss, accuracy, weighted F1, confusion matrix) and time CPU inference by batch size and threads."""
    import matplotlib.pyplot as plt

    from .plots import confusion_matrix_plot

    values = check_values(SPEC, {"seed": seed, "epochs": epochs, "channels": channels, "dropout": dropout,
                                 "max_batch_size": max_batch_size, "max_threads": max_threads,
                                 "repeat": repeat, "compile": compile})
    device = pick_device() if device is None else torch.device(device)
    seconds: dict[str, float] = {}

    start = time.perf_counter()
    model, history = train_digits_cnn(seed=values["seed"], epochs=values["epochs"], channels=values["channels"],
                                      dropout=values["dropout"], device=device, progress=progress)
    seconds["train"] = time.perf_counter() - start

    test_set = DigitsDataset("test")
    metrics = evaluate(model, make_loader(test_set, batch_size=256), F.cross_entropy, device=device)
    if show:
        print(f"trained {values['epochs']} epoch(s) on {device} in {seconds['train']:.1f} s; test set "
              f"({metrics['samples']} images): loss {metrics['loss']:.4f}, accuracy {metrics['accuracy']:.4f}, "
              f"weighted F1 {metrics['f1_weighted']:.4f}")
        confusion_matrix_plot(metrics["confusion_matrix"], DigitsDataset.classes,
                              title=f"test set, {values['epochs']} epoch(s)")
        plt.show()

    start = time.perf_counter()
    cpu_model = copy.deepcopy(model).cpu()
    sweep = measure_inference(cpu_model, test_set.images, batch_sizes=sweep_batch_sizes(values["max_batch_size"]),
                              threads=sweep_threads(values["max_threads"]), repeat=values["repeat"],
                              min_samples=128, progress=progress)
    gpu_sweep: list[dict] = []
    if device.type == "cuda":
        gpu_sweep = measure_inference(model, test_set.images, batch_sizes=sweep_batch_sizes(values["max_batch_size"]),
                                      threads=None, repeat=values["repeat"], min_samples=128, device=device)
        for row in gpu_sweep:
            row["threads"] = "GPU"
    seconds["sweep"] = time.perf_counter() - start
    if show:
        print(f"inference timings ({values['repeat']} repeats each, median) took {seconds['sweep']:.1f} s:")
        shown = [{**row, "latency_ms": 1e3 * row["latency_s"]} for row in sweep + gpu_sweep]
        print(format_table(shown, ["batch_size", "threads", "latency_ms", "throughput"],
                           formats={"latency_ms": "{:.3f}", "throughput": "{:,.0f}"}))
        _speed_figures(sweep, gpu_sweep)
        plt.show()

    compiled = None
    if values["compile"]:
        start = time.perf_counter()
        compiled = compare_compiled(cpu_model, test_set.images[:64], repeat=values["repeat"])
        seconds["compile"] = time.perf_counter() - start
        if show:
            from .timing import median

            print(f"torch.compile: first call (compiling) {compiled['compile_s']:.1f} s; batch of 64: eager "
                  f"{1e3 * median(compiled['eager']):.2f} ms, compiled {1e3 * median(compiled['compiled']):.2f} ms; "
                  f"outputs differ by at most {compiled['max_abs_diff']:.1e}")
    elif show:
        print("torch.compile not timed (compile=False): its first call compiles, about 15 s on a cold 2-core CPU")
    return EvalRun(model=model, device=device, history=history, metrics=metrics, sweep=sweep,
                   gpu_sweep=gpu_sweep, compiled=compiled, seconds=seconds)
