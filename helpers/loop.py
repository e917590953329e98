"""The training loop: one epoch, evaluation, and `fit` over epochs.

One optimizer step, in the standard order (as in nanoGPT's train.py):
forward and loss under autocast -> loss scaled for accumulation -> backward -> on a step boundary:
unscale (fp16) -> clip -> optimizer.step -> scaler.update -> zero_grad(set_to_none=True) -> scheduler.step.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _check_device(device) -> torch.device:
    if isinstance(device, str):
        device = torch.device(device)
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or a str such as 'cpu', got {type(device).__name__}")
    return device


def _check_amp(amp: str | None) -> None:
    if amp is not None and amp not in AMP_DTYPES:
        raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")


def _check_parameter_device(param: torch.Tensor | None, device: torch.device) -> None:
    if param is not None and param.device.type != device.type:
        raise ValueError(f"device is {device} but the model's parameters are on {param.device}; "
                         f"call model.to({str(device)!r}) first (and build the optimizer after it)")


def _check_model_device(model: nn.Module, device: torch.device) -> None:
    _check_parameter_device(next(model.parameters(), None), device)


def _first_optimized_parameter(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The optimizer's first parameter: one of the model's, found without walking the module tree.

    (`model.to(...)` moves parameters in place, so these are the very tensors the model uses.)
    """
    for group in optimizer.param_groups:
        if group["params"]:
            return group["params"][0]
    return None


def _check_loader(loader: Iterable) -> None:
    try:
        length = len(loader)  # type: ignore[arg-type]
    except TypeError:
        return
    if length == 0:
        raise ValueError("loader must yield at least one batch, got an empty loader "
                         "(is the dataset empty, or drop_last=True with fewer samples than batch_size?)")


def autocast_context(device: torch.device, amp: str | None):
    """torch.autocast for 'bf16'/'fp16', or a no-op context when amp is None."""
    _check_amp(amp)
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


def make_grad_scaler(device: torch.device, amp: str | None) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 (gradients would underflow without it); None for bf16 and fp32."""
    _check_amp(amp)
    return torch.amp.GradScaler(device.type) if amp == "fp16" else None


def has_pending_gradients(model: nn.Module) -> bool:
    """True when some parameter holds a gradient not yet consumed by an optimizer step (non-zero .grad)."""
    return any(p.grad is not None and bool(p.grad.ne(0).any()) for p in model.parameters())


def _micro_batch_groups(loader: Iterable, accumulation_steps: int) -> Iterator[Sequence]:
    """The loader's batches in groups of `accumulation_steps` (the last group may be shorter)."""
    if accumulation_steps == 1:
        return zip(loader)  # one-batch groups, built in C: no Python frame per step
    iterator = iter(loader)
    return iter(lambda: list(itertools.islice(iterator, accumulation_steps)), [])


def _batch_size(batch) -> int:
    return batch[1].shape[0]


def train_epoch(model: nn.Module, loader: Iterable, optimizer: torch.optim.Optimizer, loss_fn: Callable, *,
                device: torch.device | str, accumulation_steps: int = 1, amp: str | None = None,
                max_grad_norm: float | None = None, scheduler=None, scaler: torch.amp.GradScaler | None = None,
                progress: bool = True, description: str = "train") -> dict:
    """Train for one pass over `loader`; return loss, samples, micro-batches, optimizer steps, time.

    `loss_fn` must return the mean loss over its batch. With accumulation, each micro-batch's loss is
    weighted by its share of the samples in its group, so every update equals the one-big-batch update,
    also for a last group with fewer (or smaller) micro-batches. `scheduler`, if given, is stepped after
    every optimizer step that happened (not after one GradScaler skipped). Pass `scaler` to keep one GradScaler across epochs (fit does).
    """
    device = _check_device(device)
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}")
    _check_amp(amp)
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _check_loader(loader)
    _check_parameter_device(_first_optimized_parameter(optimizer), device)
    if scaler is None:
        scaler = make_grad_scaler(device, amp)
    non_blocking = device.type == "cuda"

    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = len(loader) if hasattr(loader, "__len__") else None  # type: ignore[arg-type]
        bar = tqdm(total=total, desc=description, unit="batch", leave=False)

    model.train()
    # Each micro-batch's loss, to report the epoch's mean. On the CPU `.item()` is a plain read; on an
    # accelerator it would wait for the queued kernels every step, so there the detached tensors are
    # kept and read once at the end (keeping `loss` itself would keep every graph alive).
    read_now = device.type == "cpu"
    losses: list = []
    sizes: list[int] = []
    optimizer_steps = 0
    start = time.perf_counter()
    for group in _micro_batch_groups(loader, accumulation_steps):
        group_samples = sum(_batch_size(batch) for batch in group) if len(group) > 1 else None
        for inputs, targets in group:
            inputs = inputs.to(device, non_blocking=non_blocking)
            targets = targets.to(device, non_blocking=non_blocking)
            with autocast_context(device, amp):
                loss = loss_fn(model(inputs), targets)
            losses.append(loss.item() if read_now else loss.detach())
            sizes.append(targets.shape[0])
            if group_samples is not None:
                loss = loss * (targets.shape[0] / group_samples)
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if bar is not None:
                bar.update(1)
        if max_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        stepped = True
        if scaler is not None:
            scale_before = scaler.get_scale() if scheduler is not None else None
            scaler.step(optimizer)  # skipped when the gradients hold inf/NaN
            scaler.update()         # ...and then the scale is lowered
            if scale_before is not None:
                stepped = scaler.get_scale() >= scale_before
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None and stepped:
            scheduler.step()
        optimizer_steps += 1
    if bar is not None:
        bar.close()  # leave=False: the bar goes once the epoch is done (fit's epoch bar shows the loss)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if not sizes:
        raise ValueError("loader must yield at least one batch, got none")
    samples = sum(sizes)
    if not read_now:
        losses = torch.stack(losses).float().tolist()  # the one sync of the epoch
    mean_loss = sum(loss * size for loss, size in zip(losses, sizes)) / samples
    return {"loss": mean_loss, "samples": samples, "micro_batches": len(sizes),
            "optimizer_steps": optimizer_steps, "seconds": seconds, "samples_per_s": samples / seconds}


def evaluate(model: nn.Module, loader: Iterable, loss_fn: Callable, *, device: torch.device | str,
             amp: str | None = None) -> dict:
    """Loss, accuracy, weighted F1 and confusion matrix over `loader`, in eval mode under torch.no_grad()."""
    from sklearn.metrics import confusion_matrix, f1_score

    device = _check_device(device)
    _check_amp(amp)
    _check_loader(loader)
    _check_model_device(model, device)
    was_training = model.training
    model.eval()
    loss_sum, predictions, labels = 0.0, [], []
    try:
        with torch.no_grad():
            for inputs, targets in loader:
                inputs, targets = inputs.to(device), targets.to(device)
                with autocast_context(device, amp):
                    outputs = model(inputs)
                    loss = loss_fn(outputs, targets)
                loss_sum += float(loss) * len(targets)
                predictions.append(outputs.argmax(dim=1).cpu())
                labels.append(targets.cpu())
    finally:
        model.train(was_training)
    if not labels:
        raise ValueError("loader must yield at least one batch, got none")
    y_pred, y_true = torch.cat(predictions).numpy(), torch.cat(labels).numpy()
    return {
        "loss": loss_sum / len(y_true),
        "accuracy": float((y_pred == y_true).mean()),
        "f1_weighted": float(f1_score(y_true, y_pred, average="weighted", zero_division=0)),
        "confusion_matrix": confusion_matrix(y_true, y_pred),
        "samples": len(y_true),
    }


def fit(model: nn.Module, train_loader: Iterable, optimizer: torch.optim.Optimizer, loss_fn: Callable, *,
        device: torch.device | str, epochs: int, val_loader: Iterable | None = None,
        accumulation_steps: int = 1, amp: str | None = None, max_grad_norm: float | None = None,
        scheduler=None, scheduler_interval: str = "epoch", progress: bool = True, live_plot: bool = False,
        on_epoch_end: Callable[[dict], None] | None = None) -> list[dict]:
    """Train for `epochs`; return one dict per epoch (train loss, samples/s, steps, and val metrics).

    Evaluation runs only after an epoch's last optimizer step, so no gradients are pending.
    `scheduler_interval` is 'epoch' (step once per epoch) or 'step' (once per optimizer step).
    """
    device = _check_device(device)
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive int, got {epochs!r}")
    if scheduler_interval not in ("epoch", "step"):
        raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
    scaler = make_grad_scaler(device, amp)
    plot = None
    if live_plot:
        from .plots import LivePlot

        plot = LivePlot(["train_loss", "val_loss", "val_accuracy"])
    history: list[dict] = []
    epoch_bar = None
    if progress and epochs > 1:
        from tqdm.auto import tqdm

        epoch_bar = tqdm(total=epochs, desc="epochs", unit="epoch")
    for epoch in range(1, epochs + 1):
        train = train_epoch(model, train_loader, optimizer, loss_fn, device=device,
                            accumulation_steps=accumulation_steps, amp=amp, max_grad_norm=max_grad_norm,
                            scheduler=scheduler if scheduler_interval == "step" else None, scaler=scaler,
                            progress=progress, description=f"epoch {epoch}")
        if scheduler is not None and scheduler_interval == "epoch":
            scheduler.step()
        row = {"epoch": epoch, "train_loss": train["loss"], "samples_per_s": train["samples_per_s"],
               "optimizer_steps": train["optimizer_steps"], "lr": optimizer.param_groups[0]["lr"]}
        if val_loader is not None:
            val = evaluate(model, val_loader, loss_fn, device=device, amp=amp)
            row.update(val_loss=val["loss"], val_accuracy=val["accuracy"], val_f1_weighted=val["f1_weighted"])
        history.append(row)
        if plot is not None:
            plot.update(row)
        if epoch_bar is not None:
            epoch_bar.update(1)
            if "val_accuracy" in row:
                epoch_bar.set_postfix(loss=f"{row['train_loss']:.4f}", acc=f"{row['val_accuracy']:.3f}")
        if on_epoch_end is not None:
            on_epoch_end(row)
    if epoch_bar is not None:
        epoch_bar.close()
    if plot is not None:
        plot.close()
    return history

