"""Gradients as vectors: flatten a model's gradients, compare two, and compute a batch's gradient.

    full = batch_gradient(model, loss_fn, inputs, targets)
    accumulated = batch_gradient(model, loss_fn, inputs, targets, micro_batch_size=16)
    max_abs_diff(full, accumulated)   # ~1e-8 in float32 when loss_fn returns a mean

`inputs` may be one tensor or a tuple of tensors (all split along dim 0 and passed as model(*inputs)),
so extra per-sample data, such as a fixed dropout mask, travels with its sample into every micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .checks import check_int


def _parameters(model_or_params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return list(model_or_params.parameters())
    if isinstance(model_or_params, torch.Tensor):
        raise TypeError(
            "model_or_params must be an nn.Module or an iterable of tensors, got a single tensor; wrap it in a list"
        )
    try:
        params = list(model_or_params)
    except TypeError:
        raise TypeError(
            f"model_or_params must be an nn.Module or an iterable of tensors, got {type(model_or_params).__name__}"
        ) from None
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError("model_or_params must be an nn.Module or an iterable of tensors")
    return params


def flat_grad(model_or_params: nn.Module | Iterable[torch.Tensor]) -> torch.Tensor:
    """Every parameter's .grad in one detached 1-D vector (zeros where .grad is None), in parameter order."""
    params = _parameters(model_or_params)
    if not params:
        raise ValueError("model_or_params holds no parameters")
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in params])


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| over all elements, as a float (compared in float64)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item()


def batch_gradient(
    model: nn.Module, loss_fn: Callable, inputs, targets: torch.Tensor, *, micro_batch_size: int | None = None
) -> torch.Tensor:
    """The gradient of loss_fn(model(*inputs), targets) over the whole batch, as a flat vector.

    With `micro_batch_size`, the batch is split into micro-batches (the last may be smaller) whose
    gradients add up in .grad, each micro-batch's loss weighted by its share of the samples, n_j / N;
    `loss_fn` must return the mean over its batch, and the result equals the one-pass gradient (up to
    rounding) for models that treat samples independently. The model's gradients are cleared (set to
    None) before and after, so calls do not add up.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    parts = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not parts or not all(isinstance(t, torch.Tensor) for t in parts):
        raise TypeError("inputs must be a tensor or a tuple of tensors")
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a tensor, got {type(targets).__name__}")
    sizes = {len(t) for t in parts} | {len(targets)}
    if len(sizes) != 1:
        raise ValueError(f"inputs and targets must have the same length along dim 0, got sizes {sorted(sizes)}")
    samples = sizes.pop()
    if samples == 0:
        raise ValueError("inputs must hold at least one sample, got an empty batch")
    check_int("micro_batch_size", micro_batch_size, allow_none=True)
    if micro_batch_size is None:
        micro_batch_size = samples
    model.zero_grad(set_to_none=True)
    pieces = zip(*(t.split(micro_batch_size) for t in parts), targets.split(micro_batch_size))
    for *micro_inputs, micro_targets in pieces:
        loss = loss_fn(model(*micro_inputs), micro_targets)
        if micro_batch_size < samples:
            loss = loss * (len(micro_targets) / samples)
        loss.backward()  # frees this micro-batch's graph: only one is alive at a time
    gradient = flat_grad(model).clone()
    model.zero_grad(set_to_none=True)
    return gradient


def gradient_of(model: nn.Module, run: Callable[[], object]) -> torch.Tensor:
    """The gradient `run()` leaves in the model's .grad (it calls backward), as one vector; .grad cleared before and after.

    For a gradient written out by hand, e.g. `gradient_of(model, lambda: accumulate(model, micro_batches))`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(run):
        raise TypeError(f"run must be a zero-argument call that runs backward(), got {type(run).__name__}")
    model.zero_grad(set_to_none=True)
    run()
    gradient = flat_grad(model).clone()
    model.zero_grad(set_to_none=True)
    return gradient


def gradient_error(grad: torch.Tensor, exact: torch.Tensor) -> float:
    """How far `grad` is from the `exact` gradient (two vectors such as `flat_grad` gives): the largest
    |grad - exact| as a fraction of the largest |exact|, compared in float64 on the CPU. 0 for the same gradient,
    about 1e-7 for float32 rounding; when `exact` is all zero, 0 if `grad` is too, else infinity."""
    difference = max_abs_diff(grad, exact)
    largest = exact.detach().cpu().double().abs().max().item() if exact.numel() else 0.0
    if largest == 0:
        return 0.0 if difference == 0 else math.inf
    return difference / largest


def graph_nodes(tensors: Iterable[object]) -> set:
    """The autograd nodes reachable from the given tensors: what keeping the tensors keeps alive.

    Anything without a `grad_fn` (a float from `.item()`, a tensor made under `no_grad`) adds none.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors must be an iterable of tensors (a list of losses, say), got a single tensor")
    seen: set = set()
    stack: list = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return seen
