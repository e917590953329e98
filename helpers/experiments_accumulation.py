"""The experiments of the accumulation lesson (03) and the mixed-precision lesson (04), called by their Run buttons.

03: `run_accumulation_experiment` trains the same MLP three ways on the digits: one batch of B = b x k,
    k accumulated micro-batches of b, and plain batches of b with a learning rate set by a scaling rule.
04: `run_precision_experiment` trains the MLP in fp32 and bf16 (and fp16 on CUDA) and times a training
    step in each precision.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from .data import DigitsDataset, make_loader
from .devices import pick_device, seed_everything
from .loop import autocast_context, fit, make_grad_scaler
from .models import MLP
from .timing import median, median_ratio, time_interleaved
from .knobs import check_values, choice, int_range, log_float

LR_RULES = ("none", "linear", "sqrt")
HIDDEN = (128, 64)  # the lesson-03 MLP: 64 -> 128 -> 64 -> 10

ACCUMULATION_SPEC = {
    "seed": int_range(0, 10_000, description="seed"),
    "micro_batch": int_range(2, 64, description="micro-batch b"),
    "accumulation_steps": int_range(2, 16, description="accumulation steps k"),
    "epochs": int_range(1, 30, description="epochs"),
    "lr": log_float(1e-3, 0.3, description="lr for batch b x k"),
    "lr_rule": choice(LR_RULES, description="lr rule for batch b"),
}

PRECISIONS = ("fp32", "bf16", "fp16")
AMP_OF = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}

PRECISION_SPEC = {
    "seed": int_range(0, 10_000, description="seed"),
    "epochs": int_range(1, 20, description="epochs"),
    "lr": log_float(1e-3, 0.1, description="learning rate"),
    "batch_size": int_range(16, 512, step=16, description="batch size"),
    "width": choice([64, 128, 256, 512, 1024, 2048], description="hidden width"),
    "repeat": int_range(3, 50, description="timing repeats"),
}


def scaled_lr(lr: float, batch_size: int, reference_batch_size: int, rule: str) -> float:
    """The learning rate for `batch_size` when `lr` suits `reference_batch_size`.

    'none' keeps lr; 'linear' multiplies it by batch_size / reference_batch_size (double the batch, double
    the rate); 'sqrt' by the square root of that ratio.
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    for name, value in (("batch_size", batch_size), ("reference_batch_size", reference_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if rule not in LR_RULES:
        raise ValueError(f"rule must be one of {LR_RULES}, got {rule!r}")
    ratio = batch_size / reference_batch_size
    return float(lr) * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def digits_tensors(split: str, dtype: torch.dtype = torch.float32) -> TensorDataset:
    """The 8x8 digits of `split` as a TensorDataset of (image[1, 8, 8] in `dtype`, label)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    digits = DigitsDataset(split)
    return TensorDataset(digits.images.to(dtype), digits.targets)


def train_digits_mlp(*, seed: int, batch_size: int, lr: float, epochs: int, device: torch.device,
                     accumulation_steps: int = 1, amp: str | None = None, dtype: torch.dtype = torch.float32,
                     hidden: tuple[int, ...] = HIDDEN, datasets: tuple[TensorDataset, TensorDataset] | None = None,
                     cosine: bool = False, progress: bool = False) -> tuple[nn.Module, list[dict]]:
    """An MLP trained with SGD (momentum 0.9) by `helpers.loop.fit` on the digits; returns it and its history.

    The same seed gives the same initial weights and the same order of training samples for every
    batch size, so runs that differ only in batching can be compared sample for sample. Pass
    `datasets` (train, test from `digits_tensors`) to skip loading them again. With `cosine`, the learning
    rate decays to zero along a cosine over all optimizer steps, so the end of training is calm.
    """
    train_set, test_set = datasets if datasets is not None else (digits_tensors("train", dtype),
                                                                 digits_tensors("test", dtype))
    seed_everything(seed)
    model = MLP(64, hidden, 10).to(device=device, dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # built after model.to(device)
    train_loader = make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed)
    test_loader = make_loader(test_set, batch_size=256)
    scheduler = None
    if cosine:
        total_steps = math.ceil(len(train_loader) / accumulation_steps) * epochs
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    history = fit(model, train_loader, optimizer, F.cross_entropy, device=device, epochs=epochs,
                  val_loader=test_loader, accumulation_steps=accumulation_steps, amp=amp, scheduler=scheduler,
                  scheduler_interval="step", progress=progress)
    return model, history


@dataclass
class AccumulationRun:
    """Three trainings of one MLP: 'big' (batch b*k), 'accumulated' (k micro-batches of b), 'small' (batch b)."""

    runs: dict[str, dict]   # key -> label, batch_size, accumulation_steps, lr, history
    device: torch.device
    dtype: torch.dtype
    settings: dict = field(default_factory=dict)

    def curve(self, key: str, metric: str) -> list[float]:
        """One metric ('train_loss', 'val_loss', 'val_accuracy', ...) per epoch for one run."""
        return [row[metric] for row in self.runs[key]["history"]]

    def __repr__(self) -> str:
        finals = ", ".join(f"{run['label']} {run['history'][-1]['val_accuracy']:.3f}" for run in self.runs.values())
        return f"AccumulationRun(final test accuracy: {finals}; {self.dtype} on {self.device})"


def _accumulation_table(result: AccumulationRun) -> str:
    from .inference import format_table

    rows = [{"run": run["label"], "batch per step": run["batch_size"] * run["accumulation_steps"],
             "lr": run["lr"], "steps/epoch": run["history"][-1]["optimizer_steps"],
             "train loss": run["history"][-1]["train_loss"], "test loss": run["history"][-1]["val_loss"],
             "test accuracy": run["history"][-1]["val_accuracy"]} for run in result.runs.values()]
    return format_table(rows, list(rows[0]), formats={"lr": "{:.4g}", "train loss": "{:.4f}",
                                                      "test loss": "{:.4f}", "test accuracy": "{:.3f}"})


def plot_accumulation_curves(result: AccumulationRun):
    """Train loss and test accuracy per epoch for the three runs (the accumulated run dashed over the big batch)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    styles = {"big": {"marker": "o", "linewidth": 3, "alpha": 0.5},
              "accumulated": {"marker": "x", "linestyle": "--"},
              "small": {"marker": "s"}}
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for key, run in result.runs.items():
        epochs = [row["epoch"] for row in run["history"]]
        for ax, metric in zip(axes, ("train_loss", "val_loss", "val_accuracy")):
            ax.plot(epochs, result.curve(key, metric), label=f"{run['label']} (lr {run['lr']:.3g})", **styles[key])
    for ax, title in zip(axes, ("train loss", "test loss", "test accuracy")):
        ax.set(xlabel="epoch", title=title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    return figure


def run_accumulation_experiment(seed: int = 0, micro_batch: int = 16, accumulation_steps: int = 4,
                                epochs: int = 5, lr: float = 0.05, lr_rule: str = "linear", *,
                                device: torch.device | str | None = None, show: bool = True,
                                progress: bool = True) -> AccumulationRun:
    """Train batch b*k, b x k accumulated, and batch b (lr scaled by `lr_rule`); print a table, plot the curves.

    The runs use float64 (float32 on MPS, which has no float64) so that rounding, which chaotic training
    at a high learning rate can blow up, does not blur the comparison of the first two runs.
    """
    values = check_values(ACCUMULATION_SPEC, {"seed": seed, "micro_batch": micro_batch,
                                              "accumulation_steps": accumulation_steps, "epochs": epochs,
                                              "lr": lr, "lr_rule": lr_rule})
    device = pick_device() if device is None else torch.device(device)
    dtype = torch.float32 if device.type == "mps" else torch.float64
    b, k = values["micro_batch"], values["accumulation_steps"]
    big = b * k
    plan = {
        "big": (f"batch {big}", big, 1, values["lr"]),
        "accumulated": (f"{b} x {k} accumulated", b, k, values["lr"]),
        "small": (f"batch {b}", b, 1, scaled_lr(values["lr"], b, big, values["lr_rule"])),
    }
    datasets = (digits_tensors("train", dtype), digits_tensors("test", dtype))
    runs: dict[str, dict] = {}
    for key, (label, batch_size, steps, run_lr) in plan.items():
        _, history = train_digits_mlp(seed=values["seed"], batch_size=batch_size, accumulation_steps=steps,
                                      lr=run_lr, epochs=values["epochs"], device=device, dtype=dtype,
                                      datasets=datasets, progress=progress)
        runs[key] = {"label": label, "batch_size": batch_size, "accumulation_steps": steps, "lr": run_lr,
                     "history": history}
    result = AccumulationRun(runs=runs, device=device, dtype=dtype, settings=values)
    if show:
        import matplotlib.pyplot as plt

        print(f"{values['epochs']} epoch(s) on {device} in {dtype}, SGD with momentum 0.9, "
              f"lr rule for batch {b}: {values['lr_rule']!r}")
        print(_accumulation_table(result))
        plot_accumulation_curves(result)
        plt.show()
    return result


def precisions_for(device: torch.device | str) -> list[str]:
    """The precisions worth comparing on `device`: fp32 and bf16, and fp16 on CUDA (where it is fast)."""
    device = torch.device(device)
    return ["fp32", "bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"]


def time_training_steps(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                        precisions: list[str] | tuple[str, ...], device: torch.device | str,
                        repeat: int = 10, warmup: int = 3, lr: float = 0.01) -> dict[str, list[float]]:
    """Seconds per training step (autocast forward, backward, optimizer step) for each precision.

    Each precision trains its own copy of `model` (with its own SGD and, for fp16, GradScaler); the
    steps are timed in turns after `warmup` untimed rounds, so load changes hit all precisions alike.
    """
    device = torch.device(device)
    unknown = [p for p in precisions if p not in PRECISIONS]
    if not precisions or unknown:
        raise ValueError(f"precisions must be a non-empty list drawn from {PRECISIONS}, got {list(precisions)!r}")
    inputs, targets = inputs.to(device), targets.to(device)
    steps = {}
    for name in precisions:
        amp = AMP_OF[name]
        copy_ = copy.deepcopy(model).to(device).train()
        optimizer = torch.optim.SGD(copy_.parameters(), lr=lr)
        scaler = make_grad_scaler(device, amp)

        def step(model=copy_, optimizer=optimizer, scaler=scaler, amp=amp) -> None:
            with autocast_context(device, amp):
                loss = F.cross_entropy(model(inputs), targets)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[name] = step
    return time_interleaved(steps, repeat=repeat, warmup=warmup, device=device)


@dataclass
class PrecisionRun:
    """Trainings of one MLP in several precisions, and the seconds per training step in each."""

    histories: dict[str, list[dict]]
    step_seconds: dict[str, list[float]]
    device: torch.device
    settings: dict = field(default_factory=dict)

    def step_ratio(self, precision: str) -> float:
        """Median over the interleaved repetitions of time(precision) / time(fp32); below 1 means faster."""
        return median_ratio(self.step_seconds[precision], self.step_seconds["fp32"])

    def __repr__(self) -> str:
        accuracy = ", ".join(f"{p} {h[-1]['val_accuracy']:.3f}" for p, h in self.histories.items())
        ratios = ", ".join(f"{p} x{self.step_ratio(p):.2f}" for p in self.step_seconds if p != "fp32")
        return f"PrecisionRun(test accuracy: {accuracy}; step time vs fp32: {ratios}; on {self.device})"


def plot_precision_run(result: PrecisionRun):
    """Test accuracy per epoch for each precision, and the median time of one training step."""
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    for name, history in result.histories.items():
        left.plot([r["epoch"] for r in history], [r["val_accuracy"] for r in history], marker="o", label=name)
    left.set(xlabel="epoch", ylabel="test accuracy", title="accuracy by precision")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.grid(alpha=0.3)
    left.legend()
    names = list(result.step_seconds)
    times = [1e3 * median(result.step_seconds[n]) for n in names]
    bars = right.bar(names, times, color=["tab:blue", "tab:orange", "tab:green"][:len(names)])
    for bar, name, ms in zip(bars, names, times):
        text = f"{ms:.2f} ms" if name == "fp32" else f"{ms:.2f} ms\nx{result.step_ratio(name):.2f}"
        right.annotate(text, (bar.get_x() + bar.get_width() / 2, ms), ha="center", va="bottom", fontsize=8)
    right.set(ylabel="ms per training step (median)", title=f"one step on {result.device.type}")
    right.margins(y=0.15)
    right.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def run_precision_experiment(seed: int = 0, epochs: int = 3, lr: float = 0.05, batch_size: int = 64,
                             width: int = 256, repeat: int = 10, *, device: torch.device | str | None = None,
                             show: bool = True, progress: bool = True) -> PrecisionRun:
    """Train the MLP (hidden width x 2) in each precision, time one training step in each; print and plot.

    The learning rate decays along a cosine to zero, so the final accuracies are not snapshots of a noisy moment.
    """
    values = check_values(PRECISION_SPEC, {"seed": seed, "epochs": epochs, "lr": lr, "batch_size": batch_size,
                                           "width": width, "repeat": repeat})
    device = pick_device() if device is None else torch.device(device)
    precisions = precisions_for(device)
    hidden = (values["width"], values["width"])
    datasets = (digits_tensors("train"), digits_tensors("test"))
    histories = {}
    for name in precisions:
        _, histories[name] = train_digits_mlp(seed=values["seed"], batch_size=values["batch_size"],
                                              lr=values["lr"], epochs=values["epochs"], device=device,
                                              amp=AMP_OF[name], hidden=hidden, datasets=datasets,
                                              cosine=True, progress=progress)
    seed_everything(values["seed"])
    model = MLP(64, hidden, 10)
    train = datasets[0]
    inputs, targets = train.tensors[0][:values["batch_size"]], train.tensors[1][:values["batch_size"]]
    step_seconds = time_training_steps(model, inputs, targets, precisions=precisions, device=device,
                                       repeat=values["repeat"])
    result = PrecisionRun(histories=histories, step_seconds=step_seconds, device=device, settings=values)
    if show:
        import matplotlib.pyplot as plt

        from .inference import format_table

        rows = [{"precision": name, "train loss": histories[name][-1]["train_loss"],
                 "test accuracy": histories[name][-1]["val_accuracy"],
                 "ms / step": 1e3 * median(step_seconds[name]),
                 "time vs fp32": result.step_ratio(name)} for name in precisions]
        print(f"MLP 64-{values['width']}-{values['width']}-10, {values['epochs']} epoch(s), batch "
              f"{values['batch_size']}, SGD lr {values['lr']:g} with cosine decay, on {device}; "
              f"step times: median of {values['repeat']} interleaved repeats")
        print(format_table(rows, list(rows[0]), formats={"train loss": "{:.4f}", "test accuracy": "{:.3f}",
                                                         "ms / step": "{:.2f}", "time vs fp32": "x{:.2f}"}))
        plot_precision_run(result)
        plt.show()
    return result
