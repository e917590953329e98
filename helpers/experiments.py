"""Experiments behind the Run buttons of the Dataset & DataLoader notebook and the basic training-loop notebook.

Each `run_*` function is what a Run button calls: it prints what it did, with the values it used, and
returns nothing. The function it wraps returns the numbers, for notebooks and tests to check.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from .data import DigitsDataset, PngFolderDataset, export_digits_png, make_loader
from .devices import pick_device, seed_everything
from .loop import fit
from .models import MLP
from .optim import make_optimizer
from .tables import format_table

DIGITS_DEFAULTS = {"lr": 0.05, "epochs": 5, "batch_size": 32, "optimizer": "sgd"}
DIGITS_OPTIMIZER_OPTIONS: dict[str, dict[str, Any]] = {
    "sgd": {"momentum": 0.9}, "adam": {}, "adamw": {}, "rmsprop": {}, "adagrad": {}}


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def text_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Rows given as sequences (not dicts) as an aligned plain-text table; see helpers.tables.format_table."""
    headers = [str(h) for h in headers]
    records = []
    for row in rows:
        row = list(row)
        if len(row) != len(headers):
            raise ValueError(f"each row must have {len(headers)} cells like the headers, got {len(row)}: {row}")
        records.append({h: str(cell) for h, cell in zip(headers, row)})
    return format_table(records, headers)


# ---------------------------------------------------------------- the training-loop notebook

def init_weights(module: nn.Module) -> None:
    """For `net.apply(init_weights)`: Kaiming-normal weights (made for ReLU) and zero biases in Linear/Conv2d layers."""
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def digits_model() -> nn.Module:
    """The training-loop notebook's model: an MLP 64 -> 128 -> 64 -> 10 with BatchNorm and dropout 0.2."""
    return MLP(64, (128, 64), 10, dropout=0.2, batch_norm=True)


@dataclass
class DigitsRun:
    """What `train_digits` did: the knobs it used, the per-epoch history, and the trained model."""

    lr: float
    epochs: int
    batch_size: int
    optimizer: str
    seed: int
    test_accuracy: float
    seconds: float
    history: list = field(repr=False)
    model: nn.Module = field(repr=False)

    def summary(self) -> str:
        """One line stating the knobs used and the result."""
        return (f"trained {self.epochs} epochs at lr={self.lr:.3g} ({self.optimizer}, batch size {self.batch_size}, "
                f"seed {self.seed}) in {self.seconds:.1f} s: test accuracy {self.test_accuracy:.3f}")


def train_digits(lr: float = 0.05, epochs: int = 5, batch_size: int = 32, optimizer: str = "sgd", seed: int = 0, *,
                 device: torch.device | str | None = None, progress: bool = True, live_plot: bool = True) -> DigitsRun:
    """Train `digits_model` on the 8x8 digits with helpers.loop.fit; print the knobs used and the test accuracy.

    The recipe is the notebook's definition phase: seed_everything(seed), model, apply(init_weights),
    .to(device), optimizer by name (SGD with momentum 0.9), a shuffled loader seeded with `seed`.
    """
    _check_int("epochs", epochs, 1)
    _check_int("batch_size", batch_size, 1)
    _check_int("seed", seed, 0)
    if not isinstance(optimizer, str) or optimizer not in DIGITS_OPTIMIZER_OPTIONS:
        raise ValueError(f"optimizer must be one of {sorted(DIGITS_OPTIMIZER_OPTIONS)}, got {optimizer!r}")
    device = pick_device() if device is None else torch.device(device)
    seed_everything(seed)
    model = digits_model()
    model.apply(init_weights)
    model.to(device)
    opt = make_optimizer(optimizer, model.parameters(), lr, **DIGITS_OPTIMIZER_OPTIONS[optimizer])
    train_loader = make_loader(DigitsDataset("train"), batch_size=batch_size, shuffle=True, seed=seed)
    test_loader = make_loader(DigitsDataset("test"), batch_size=256)
    start = time.perf_counter()
    history = fit(model, train_loader, opt, nn.CrossEntropyLoss(), device=device, epochs=epochs,
                  val_loader=test_loader, progress=progress, live_plot=live_plot)
    seconds = time.perf_counter() - start
    run = DigitsRun(lr=float(lr), epochs=epochs, batch_size=batch_size, optimizer=optimizer, seed=seed,
                    test_accuracy=history[-1]["val_accuracy"], seconds=seconds, history=history, model=model)
    print(run.summary())
    return run


def run_digits(lr: float, epochs: int, batch_size: int, optimizer: str, seed: int) -> None:
    """The Run button of the training-loop notebook: `train_digits` with these knobs (curves and a result line)."""
    train_digits(lr=lr, epochs=epochs, batch_size=batch_size, optimizer=optimizer, seed=seed)


# ---------------------------------------------------------------- the Dataset & DataLoader notebook

def batch_length(batch) -> int:
    """Number of samples in a batch: the first dimension of its first tensor (tuples, lists and dicts searched)."""
    if isinstance(batch, torch.Tensor):
        if batch.ndim == 0:
            raise ValueError("a batch tensor needs a batch dimension, got a 0-d tensor")
        return batch.shape[0]
    if isinstance(batch, Mapping) and batch:
        return batch_length(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)) and batch:
        return batch_length(batch[0])
    raise TypeError(f"batch must be a tensor or a tuple/list/dict holding tensors, got {type(batch).__name__}")


def time_loader(loader: Iterable, *, epochs: int = 1) -> list[dict]:
    """Iterate `loader` for `epochs` (no model): per epoch, seconds to the first batch, epoch seconds, samples/s."""
    _check_int("epochs", epochs, 1)
    rows = []
    for epoch in range(1, epochs + 1):
        samples, batches, first_batch_s = 0, 0, None
        start = time.perf_counter()
        for batch in loader:
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - start
            samples += batch_length(batch)
            batches += 1
        seconds = time.perf_counter() - start
        if batches == 0:
            raise ValueError("loader must yield at least one batch, got none")
        rows.append({"epoch": epoch, "first_batch_s": first_batch_s, "epoch_s": seconds, "samples": samples,
                     "batches": batches, "samples_per_s": samples / seconds})
    return rows


def loader_benchmark(num_workers: int = 2, batch_size: int = 64, prefetch_factor: int = 2,
                     persistent_workers: bool = False, epochs: int = 2, seed: int = 0, *,
                     root: str | Path | None = None) -> list[dict]:
    """Time a shuffled DataLoader over the digit PNGs (decoded on every access); print a table and a summary line.

    `prefetch_factor` and `persistent_workers` only exist for worker processes; with num_workers=0 they
    are reported as not used. `root` is a folder of class sub-folders (default: the exported train split).
    """
    _check_int("num_workers", num_workers, 0)
    _check_int("prefetch_factor", prefetch_factor, 1)
    if not isinstance(persistent_workers, bool):
        raise TypeError(f"persistent_workers must be True or False, got {persistent_workers!r}")
    root = Path(root) if root is not None else export_digits_png() / "train"
    dataset = PngFolderDataset(root)
    worker_options = ({"prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers}
                      if num_workers > 0 else {})
    loader = make_loader(dataset, batch_size=batch_size, shuffle=True, seed=seed, num_workers=num_workers,
                         **worker_options)
    rows = time_loader(loader, epochs=epochs)
    del loader  # ends persistent workers now rather than at garbage collection
    print(text_table(["epoch", "first batch (s)", "epoch (s)", "samples", "samples/s"],
                     [[r["epoch"], f"{r['first_batch_s']:.3f}", f"{r['epoch_s']:.3f}", r["samples"],
                       f"{r['samples_per_s']:,.0f}"] for r in rows]))
    options = (f"prefetch_factor={prefetch_factor}, persistent_workers={persistent_workers}" if num_workers > 0
               else "prefetch_factor and persistent_workers not used without workers")
    mean_rate = sum(r["samples"] for r in rows) / sum(r["epoch_s"] for r in rows)
    print(f"num_workers={num_workers}, batch_size={batch_size}, {options}, seed={seed}: {epochs} epoch(s) of "
          f"{len(dataset)} PNGs at {mean_rate:,.0f} samples/s, first batch after {rows[0]['first_batch_s']:.3f} s")
    return rows


def run_loader_benchmark(num_workers: int, batch_size: int, prefetch_factor: int, persistent_workers: bool,
                         epochs: int, seed: int) -> None:
    """The Run button of the Dataset & DataLoader notebook: `loader_benchmark` with these knobs."""
    loader_benchmark(num_workers=num_workers, batch_size=batch_size, prefetch_factor=prefetch_factor,
                     persistent_workers=persistent_workers, epochs=epochs, seed=seed)
