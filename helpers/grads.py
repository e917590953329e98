"""Gradients as vectors: flatten a model's gradients, compare two, and build a batch's gradient from micro-batches.

    full = batch_gradient(model, loss_fn, inputs, targets)
    accumulated = accumulated_gradient(model, loss_fn, inputs, targets, micro_batch_size=16)
    max_abs_diff(full, accumulated)   # ~1e-8 in float32 when loss_fn returns a mean

`inputs` may be one tensor or a tuple of tensors (all split along dim 0 and passed as model(*inputs)),
so extra per-sample data, such as a fixed dropout mask, travels with its sample into every micro-batch.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn

WEIGHTINGS = ("samples", "naive", "none")


def _parameters(model_or_params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return list(model_or_params.parameters())
    if isinstance(model_or_params, torch.Tensor):
        raise TypeError("model_or_params must be an nn.Module or an iterable of tensors, got a single tensor; "
                        "wrap it in a list")
    try:
        params = list(model_or_params)
    except TypeError:
        raise TypeError(f"model_or_params must be an nn.Module or an iterable of tensors, "
                        f"got {type(model_or_params).__name__}") from None
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError("model_or_params must be an nn.Module or an iterable of tensors")
    return params


def flat_grad(model_or_params: nn.Module | Iterable[torch.Tensor]) -> torch.Tensor:
    """Every parameter's .grad in one detached 1-D vector (zeros where .grad is None), in parameter order."""
    params = _parameters(model_or_params)
    if not params:
        raise ValueError("model_or_params holds no parameters")
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                      for p in params])


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| over all elements, as a float (compared in float64)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()


def micro_batch_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    """The sizes torch.split gives: full micro-batches, then the remainder (60, 16 -> [16, 16, 16, 12])."""
    for name, value in (("batch_size", batch_size), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    full, rest = divmod(batch_size, micro_batch_size)
    return [micro_batch_size] * full + ([rest] if rest else [])


def _as_tuple(inputs) -> tuple[torch.Tensor, ...]:
    parts = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not parts or not all(isinstance(t, torch.Tensor) for t in parts):
        raise TypeError("inputs must be a tensor or a tuple of tensors")
    return parts


def _check_batch(parts: Sequence[torch.Tensor], targets: torch.Tensor) -> int:
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a tensor, got {type(targets).__name__}")
    sizes = {len(t) for t in parts} | {len(targets)}
    if len(sizes) != 1:
        raise ValueError(f"inputs and targets must have the same length along dim 0, got sizes {sorted(sizes)}")
    batch = sizes.pop()
    if batch == 0:
        raise ValueError("inputs must hold at least one sample, got an empty batch")
    return batch


def batch_gradient(model: nn.Module, loss_fn: Callable, inputs, targets: torch.Tensor) -> torch.Tensor:
    """The gradient of loss_fn(model(*inputs), targets) from one forward and backward pass, as a flat vector.

    The model's gradients are cleared before (set to None) and again after, so calls do not add up.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    parts = _as_tuple(inputs)
    _check_batch(parts, targets)
    model.zero_grad(set_to_none=True)
    loss_fn(model(*parts), targets).backward()
    gradient = flat_grad(model).clone()
    model.zero_grad(set_to_none=True)
    return gradient


def accumulated_gradient(model: nn.Module, loss_fn: Callable, inputs, targets: torch.Tensor, *,
                         micro_batch_size: int, weighting: str = "samples") -> torch.Tensor:
    """The batch's gradient built from micro-batches whose gradients add up in .grad, as a flat vector.

    `loss_fn` must return the mean over its micro-batch. Each micro-batch's loss is multiplied by
    'samples': its share of the batch's samples, n_j / N (equals the big-batch gradient, also when the last
    micro-batch is smaller); 'naive': 1 / k for k micro-batches (the usual `loss / accumulation_steps`, exact
    only when all micro-batches are equally large); 'none': 1 (no division: k times too large).
    Gradients are cleared before and after.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    parts = _as_tuple(inputs)
    batch = _check_batch(parts, targets)
    sizes = micro_batch_sizes(batch, micro_batch_size)
    model.zero_grad(set_to_none=True)
    pieces = zip(*(t.split(micro_batch_size) for t in parts), targets.split(micro_batch_size))
    for *micro_inputs, micro_targets in pieces:
        loss = loss_fn(model(*micro_inputs), micro_targets)
        if weighting == "samples":
            loss = loss * (len(micro_targets) / batch)
        elif weighting == "naive":
            loss = loss / len(sizes)
        loss.backward()  # frees this micro-batch's graph: only one is alive at a time
    gradient = flat_grad(model).clone()
    model.zero_grad(set_to_none=True)
    return gradient
