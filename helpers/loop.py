"""The training loop: one epoch, evaluation, and `fit` over epochs.

One optimizer step, in the standard order (as in nanoGPT's train.py):
forward and loss under autocast -> loss weighted for accumulation -> scaler.scale(loss).backward() ->
on a step boundary: unscale_ and clip -> scaler.step -> scaler.update -> zero_grad(set_to_none=True)
-> scheduler.step. Without fp16 the GradScaler is disabled and each of its calls is a no-op.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import compat
from .checks import check_choice, check_int, check_positive_number
from .progress import progress_bar

# The course's one table of precision names: 'fp32' trains without autocast; the others are autocast dtypes.
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AMP_DTYPES = {name: dtype for name, dtype in PRECISIONS.items() if name != "fp32"}


def _check_device(device) -> torch.device:
    if isinstance(device, str):
        device = torch.device(device)
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or a str such as 'cpu', got {type(device).__name__}")
    return device


def _check_amp(amp: str | None) -> None:
    check_choice("amp", amp, (None, *PRECISIONS))  # None and 'fp32' both mean: no autocast


def _check_parameter_device(param: torch.Tensor | None, device: torch.device) -> None:
    if param is not None and param.device.type != device.type:
        raise ValueError(
            f"device is {device} but the model's parameters are on {param.device}; "
            f"call model.to({str(device)!r}) first (and build the optimizer after it)"
        )


def _check_loader(loader: Iterable) -> None:
    try:
        length = len(loader)  # type: ignore[arg-type]
    except TypeError:
        return
    if length == 0:
        raise ValueError(
            "loader must yield at least one batch, got an empty loader "
            "(is the dataset empty, or drop_last=True with fewer samples than batch_size?)"
        )


@dataclass(frozen=True)
class EpochResult:
    """What one training epoch did: its mean loss over the samples, its counts and its time."""

    loss: float
    samples: int
    micro_batches: int
    optimizer_steps: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


@dataclass(frozen=True)
class Evaluation:
    """Loss, accuracy, weighted F1 and confusion matrix over an evaluation set."""

    loss: float
    accuracy: float
    f1_weighted: float
    confusion_matrix: np.ndarray
    samples: int


def _length(loader: Iterable) -> int | None:
    return len(loader) if isinstance(loader, Sized) else None


def _elapsed(start: float, device: torch.device) -> float:
    """Seconds since `start`, once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _check_epoch_arguments(loader: Iterable, optimizer, device, accumulation_steps, amp, max_grad_norm) -> torch.device:
    """train_epoch's arguments checked where a mistake would otherwise surface deep inside torch."""
    device = _check_device(device)
    check_int("accumulation_steps", accumulation_steps)
    _check_amp(amp)
    check_positive_number("max_grad_norm", max_grad_norm, allow_none=True)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _check_loader(loader)
    # The optimizer's first parameter is one of the model's (model.to moves parameters in place), found
    # without walking the module tree.
    first = next((group["params"][0] for group in optimizer.param_groups if group["params"]), None)
    _check_parameter_device(first, device)
    return device


def autocast_context(device: torch.device, amp: str | None):
    """torch.autocast for 'bf16'/'fp16', or a no-op context for 'fp32' (or None): no autocast."""
    _check_amp(amp)
    if amp is None or amp == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


def precisions_for(device: torch.device | str, *, tf32: bool = False) -> list[str]:
    """The precisions worth comparing on `device`: fp32 and bf16, and fp16 on CUDA (where it is fast).

    On a CUDA GPU without native bfloat16 (before compute capability 8.0: T4, V100) bf16 is left out, since
    `torch.cuda.is_bf16_supported()` would count its slow emulation. With `tf32`, 'tf32' (float32 without
    autocast, its products as TF32: `helpers.rig.precision_steps`) follows 'fp32' where `tf32_available`.
    """
    device = torch.device(device)
    floats = ["fp32", "tf32"] if tf32 and tf32_available(device)[0] else ["fp32"]
    if device.type != "cuda":
        return [*floats, "bf16"]
    native_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return [*floats, "bf16", "fp16"] if native_bf16 else [*floats, "fp16"]


TF32_CAPABILITY = (8, 0)  # NVIDIA Ampere (A100, RTX 30xx): the first tensor cores that multiply float32 as TF32


def tf32_available(device: torch.device | str) -> tuple[bool, str]:
    """Whether float32 products on `device` can run as TF32 (a CUDA GPU of compute capability 8.0 or newer), and
    why, in one line. TF32 keeps float32's range with a 10-bit mantissa, about 3 significant digits."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"no TF32 on {device.type}: it is a mode of NVIDIA tensor cores (compute capability 8.0+)"
    if torch.version.hip is not None:
        return False, "no TF32 measured on ROCm builds: the course checks TF32 on NVIDIA GPUs only"
    major, minor = torch.cuda.get_device_capability(device)
    name = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    if (major, minor) < TF32_CAPABILITY:
        return False, f"no TF32 on {name}: it needs compute capability 8.0 or newer (Ampere)"
    return True, f"TF32 on {name}: float32 products on tensor cores, 10-bit mantissas"


def make_grad_scaler(device: torch.device, amp: str | None) -> torch.amp.GradScaler:
    """The run's GradScaler: scaling for fp16 (gradients would underflow without it); for bf16 and fp32 a disabled
    one, the course's one "no scaling", whose scale, step and update pass straight through."""
    _check_amp(amp)
    return torch.amp.GradScaler(torch.device(device).type, enabled=amp == "fp16")


def has_pending_gradients(model: nn.Module) -> bool:
    """True when some parameter holds a gradient not yet consumed by an optimizer step (non-zero .grad)."""
    return any(p.grad is not None and bool(p.grad.ne(0).any()) for p in model.parameters())


def _micro_batch_groups(loader: Iterable, accumulation_steps: int) -> Iterator[Sequence]:
    """The loader's batches in groups of `accumulation_steps` (the last group may be shorter)."""
    if accumulation_steps == 1:
        return zip(loader)  # one-batch groups, built in C: no Python frame per step
    iterator = iter(loader)
    return iter(lambda: list(itertools.islice(iterator, accumulation_steps)), [])


def train_epoch(
    model: nn.Module,
    loader: Iterable,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable,
    *,
    device: torch.device | str,
    accumulation_steps: int = 1,
    amp: str | None = None,
    max_grad_norm: float | None = None,
    scheduler=None,
    scaler: torch.amp.GradScaler | None = None,
    progress: bool = True,
    description: str = "train",
) -> EpochResult:
    """Train for one pass over `loader`: forward under autocast, weighted loss, backward, clip, step.

    `loss_fn` returns the mean loss over its batch; each micro-batch's loss is weighted by its share of
    its group's samples, so every update equals the one-big-batch update, a shorter last group included.
    `scheduler` steps after each step the GradScaler did not skip; `scaler` (one per run) defaults to fp16 only.
    """
    device = _check_epoch_arguments(loader, optimizer, device, accumulation_steps, amp, max_grad_norm)
    scaler = scaler if scaler is not None else make_grad_scaler(device, amp)
    autocast = autocast_context(device, amp)  # made once; without amp a nullcontext, the cheapest to enter
    # Counted by hand: tqdm(loader) would open (and drop) an extra DataLoader iterator, shifting the shuffle.
    bar = progress_bar(total=_length(loader), desc=description, unit="batch", leave=False, enabled=progress)
    read_now, non_blocking = device.type == "cpu", device.type == "cuda"  # .item() on a GPU waits: read at the end
    losses, sizes, optimizer_steps = [], [], 0
    model.train()
    start = time.perf_counter()
    for group in _micro_batch_groups(loader, accumulation_steps):
        group_samples = sum(batch[1].shape[0] for batch in group) if len(group) > 1 else 0  # 0: no weighting
        for inputs, targets in group:
            inputs = inputs.to(device, non_blocking=non_blocking)
            targets = targets.to(device, non_blocking=non_blocking)
            with autocast:
                loss = loss_fn(model(inputs), targets)
            losses.append(loss.item() if read_now else loss.detach())
            sizes.append(targets.shape[0])
            if group_samples:  # weighted by its share of the group's samples (no extra op without accumulation)
                loss = loss * (targets.shape[0] / group_samples)
            scaler.scale(loss).backward()
            bar.update(1)
        if max_grad_norm is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scale = scaler.get_scale() if scheduler is not None else 0.0  # read only when needed: a GPU sync
        scaler.step(optimizer)  # skipped when the fp16 gradients hold inf/NaN...
        scaler.update()  # ...and then the scale is lowered
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None and scaler.get_scale() >= scale:  # a skipped step is not scheduled
            scheduler.step()
        optimizer_steps += 1
    bar.close()
    seconds = _elapsed(start, device)
    if not sizes:
        raise ValueError("loader must yield at least one batch, got none")
    losses = losses if read_now else torch.stack(losses).float().tolist()  # the one sync of the epoch
    mean_loss = sum(loss * size for loss, size in zip(losses, sizes)) / sum(sizes)
    return EpochResult(mean_loss, sum(sizes), len(sizes), optimizer_steps, seconds)


def evaluate(
    model: nn.Module, loader: Iterable, loss_fn: Callable, *, device: torch.device | str, amp: str | None = None
) -> Evaluation:
    """Loss, accuracy, weighted F1 and confusion matrix over `loader`, in eval mode under torch.no_grad()."""
    from sklearn.metrics import confusion_matrix, f1_score

    device = _check_device(device)
    autocast = autocast_context(device, amp)
    _check_loader(loader)
    _check_parameter_device(next(model.parameters(), None), device)
    was_training = model.training
    model.eval()
    loss_sum, predictions, labels = 0.0, [], []
    try:
        with torch.no_grad():
            for inputs, targets in loader:
                inputs, targets = inputs.to(device), targets.to(device)
                with autocast:
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
    return Evaluation(
        loss=loss_sum / len(y_true),
        accuracy=float((y_pred == y_true).mean()),
        f1_weighted=float(f1_score(y_true, y_pred, average="weighted", zero_division=0)),
        confusion_matrix=confusion_matrix(y_true, y_pred),
        samples=len(y_true),
    )


def fit(
    model: nn.Module,
    train_loader: Iterable,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable,
    *,
    device: torch.device | str,
    epochs: int,
    val_loader: Iterable | None = None,
    accumulation_steps: int = 1,
    amp: str | None = None,
    max_grad_norm: float | None = None,
    scheduler=None,
    scheduler_interval: str = "epoch",
    progress: bool = True,
    on_epoch_end: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train for `epochs`; return one dict per epoch (train loss, samples/s, steps, and val metrics).

    Evaluation runs only after an epoch's last optimizer step, so no gradients are pending.
    `scheduler_interval` is 'epoch' (step once per epoch) or 'step' (once per optimizer step).
    `on_epoch_end(row)` is called after every epoch with that epoch's row: `LivePlot(...).update` draws it.
    With `progress` a last line of text gives the final epoch's metrics, which a saved notebook keeps when
    its progress bars (widgets) are gone.
    """
    device = _check_device(device)
    check_int("epochs", epochs)
    if scheduler_interval not in ("epoch", "step"):
        raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
    scaler = make_grad_scaler(device, amp)  # one for every epoch: its scale carries over
    history: list[dict] = []
    epoch_bar = progress_bar(total=epochs, desc="epochs", unit="epoch", enabled=progress and epochs > 1)
    for epoch in range(1, epochs + 1):
        train = train_epoch(
            model,
            train_loader,
            optimizer,
            loss_fn,
            device=device,
            accumulation_steps=accumulation_steps,
            amp=amp,
            max_grad_norm=max_grad_norm,
            scheduler=scheduler if scheduler_interval == "step" else None,
            scaler=scaler,
            progress=progress,
            description=f"epoch {epoch}",
        )
        if scheduler is not None and scheduler_interval == "epoch":
            scheduler.step()
        row = {
            "epoch": epoch,
            "train_loss": train.loss,
            "samples_per_s": train.samples_per_s,
            "optimizer_steps": train.optimizer_steps,
            "lr": optimizer.param_groups[0]["lr"],
        }
        if val_loader is not None:
            val = evaluate(model, val_loader, loss_fn, device=device, amp=amp)
            row.update(val_loss=val.loss, val_accuracy=val.accuracy, val_f1_weighted=val.f1_weighted)
            epoch_bar.set_postfix(loss=f"{row['train_loss']:.4f}", acc=f"{row['val_accuracy']:.3f}", refresh=False)
        history.append(row)
        epoch_bar.update(1)
        if on_epoch_end is not None:
            on_epoch_end(row)
    epoch_bar.close()
    if progress:  # a progress bar saves as an empty widget: leave the result in text that outlives the kernel
        last = history[-1]
        shown = [k for k in ("train_loss", "val_loss", "val_accuracy") if k in last]
        print(f"fit: {epochs} epoch(s); last epoch " + ", ".join(f"{k} {last[k]:.4g}" for k in shown))
    return history


def precision_steps(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    precisions: Sequence[str],
    device: torch.device | str,
    lr: float = 0.01,
    accumulation_steps: int = 1,
) -> dict[str, Callable[[], object]]:
    """One training step of `model` on one batch per precision ('fp32', 'tf32', 'bf16', 'fp16'), ready for `measure`.

    A step is `train_epoch` over the one batch: forward and loss under autocast (none for fp32 and
    tf32), backward, SGD step (through a GradScaler for fp16). 'fp32' follows the float32 setting in force (true
    float32 matmuls under torch's default, `set_float32_matmul_precision("highest")`); 'tf32' is the same step run
    under `compat.fp32_precision_as("tf32")`: CUDA only, where `tf32_available` says so. With
    `accumulation_steps` the batch is cut into that many micro-batches (`torch.chunk`: fewer when the batch is
    smaller), whose gradients make the one step. Each precision trains its own copy of `model`, so `model` itself
    is left alone.
    """
    import torch.nn.functional as F

    known = (*PRECISIONS, "tf32")
    if isinstance(precisions, str) or not precisions or any(p not in known for p in precisions):
        raise ValueError(f"precisions must be a non-empty list drawn from {known}, got {precisions!r}")
    check_int("accumulation_steps", accumulation_steps)
    device = torch.device(device)
    if "tf32" in precisions:
        available, why = tf32_available(device)
        if not available:
            raise ValueError(f"precisions names 'tf32', but {why}; leave it out (precisions_for(device, tf32=True))")
    batch = list(zip(inputs.to(device).chunk(accumulation_steps), targets.to(device).chunk(accumulation_steps)))
    steps: dict[str, Callable[[], object]] = {}
    for name in precisions:
        amp = "fp32" if name == "tf32" else name  # tf32: float32 without autocast, its products in TF32
        replica = copy.deepcopy(model).to(device)
        optimizer = torch.optim.SGD(replica.parameters(), lr=lr)
        scaler = make_grad_scaler(device, amp)  # one scaler across steps, as in training
        step = functools.partial(
            train_epoch,
            replica,
            batch,
            optimizer,
            F.cross_entropy,
            device=device,
            accumulation_steps=accumulation_steps,
            amp=amp,
            scaler=scaler,
            progress=False,
        )
        steps[name] = in_fp32_precision(step, "tf32") if name == "tf32" else step
    return steps


def in_fp32_precision(step: Callable[[], object], mode: str) -> Callable[[], object]:
    """`step` as a call that runs with CUDA float32 products in `mode`, 'ieee' or 'tf32' (restored after each call)."""
    check_choice("mode", mode, compat.FP32_MODES)

    def call() -> object:
        with compat.fp32_precision_as(mode):
            return step()

    return call


def step_saved_bytes(
    model: torch.nn.Module, batch_size: int, precision: str, *, device: torch.device | str, seed: int = 0
) -> int:
    """The most bytes autograd holds for backward during one training step of `model` in `precision`
    (`precision_steps`' step) on a random batch of `batch_size` samples; `model` takes `model[1].in_features`
    inputs (helpers.models.MLP) and is left alone."""
    from .memory import saved_peak_bytes

    check_int("batch_size", batch_size)
    features = next(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
    classes = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)][-1]
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, features, generator=generator)
    targets = torch.randint(0, classes, (batch_size,), generator=generator)
    step = precision_steps(model, inputs, targets, precisions=[precision], device=device)[precision]
    return saved_peak_bytes(step)
