"""Autograd (notebook 01): write `input_gradient(model, x, target)`, the gradient of the summed cross-entropy loss
with respect to the input, which leaves the model's gradients, the caller's tensor and the grad mode alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import exercise


def reference_input_gradient(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """d/dx of cross_entropy(model(x), target, reduction='sum'): one gradient per sample, shaped like x."""
    with torch.enable_grad():  # the caller may be inside no_grad
        inputs = x.detach().requires_grad_()  # a leaf of our own: the caller's x is left as it was
        loss = F.cross_entropy(model(inputs), target, reduction="sum")
        (gradient,) = torch.autograd.grad(loss, inputs)  # fills no .grad, the parameters' included
    return gradient


def _model() -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    return model


def _expected(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each sample's gradient from its own one-sample loss: what the batch's summed loss must give."""
    rows = []
    for sample, label in zip(x, target):
        inputs = sample.detach().clone().unsqueeze(0).requires_grad_()
        loss = F.cross_entropy(model(inputs), label.unsqueeze(0))
        rows.append(torch.autograd.grad(loss, inputs)[0][0])
    return torch.stack(rows)


def _call(input_gradient: Callable[..., Any], model: nn.Module, x: torch.Tensor, target: torch.Tensor, how: str):
    try:
        return input_gradient(model, x, target)
    except RuntimeError as error:
        if "does not require grad" in str(error) and "no_grad" in how:
            raise AssertionError(
                f"hint: called {how}, it raised {str(error).splitlines()[0]!r}: under no_grad nothing is "
                "recorded, so there is no graph to differentiate; wrap your forward and autograd.grad in "
                "`with torch.enable_grad():`"
            ) from None
        raise


def _check_one(input_gradient: Callable[..., Any], batch: int, under_no_grad: bool) -> None:
    generator = torch.Generator().manual_seed(batch)
    model = _model()
    x = torch.randn(batch, 5, generator=generator, dtype=torch.float64)
    target = torch.randint(0, 3, (batch,), generator=generator)
    marks = [torch.full_like(p, 7.0) for p in model.parameters()]  # gradients the caller had already
    for parameter, mark in zip(model.parameters(), marks):
        parameter.grad = mark.clone()
    x_before = x.clone()
    model.train(batch % 2 == 1)  # the caller's mode, which the call must leave as it was: train, then eval
    mode = "train" if model.training else "eval"
    how = f"on a batch of {batch}" + (" inside torch.no_grad()" if under_no_grad else "")
    if under_no_grad:
        with torch.no_grad():
            got = _call(input_gradient, model, x, target, how)
            assert not torch.is_grad_enabled(), (
                f"hint: {how}, grad mode was still on after the call, inside the caller's no_grad: "
                "torch.set_grad_enabled(True) called as a function switches it on for good; use it (or "
                "torch.enable_grad()) as a `with` block, which puts the caller's mode back"
            )
    else:
        got = _call(input_gradient, model, x, target, how)
    frozen = [name for name, parameter in model.named_parameters() if not parameter.requires_grad]
    assert not frozen, (
        f"hint: {how}, the caller's model came back frozen ({frozen[0]}.requires_grad is False): "
        "requires_grad_(False) on the model is never undone by itself; leave the parameters alone and ask "
        "torch.autograd.grad for the input's gradient only"
    )
    assert model.training == (mode == "train"), (
        f"hint: {how}, the caller's model was in {mode} mode and came back in "
        f"{'train' if model.training else 'eval'} mode: put back the mode you found (was_training = "
        "model.training ... model.train(was_training)), or do not switch it"
    )
    assert isinstance(got, torch.Tensor), f"hint: {how}, it returned {type(got).__name__}, not a tensor"
    assert not x.requires_grad, (
        f"hint: {how}, the caller's x now has requires_grad=True: you switched it on the caller's tensor; "
        "differentiate with respect to your own leaf, inputs = x.detach().requires_grad_()"
    )
    assert torch.equal(x, x_before), f"hint: {how}, the values of the caller's x changed: leave x as it is"
    for (name, parameter), mark in zip(model.named_parameters(), marks):
        assert parameter.grad is not None and torch.equal(parameter.grad, mark), (
            f"hint: {how}, the model's {name}.grad changed (it was all 7s before the call, now "
            f"{'None' if parameter.grad is None else 'other values'}): loss.backward() adds into every "
            "parameter's .grad (and zero_grad() throws away what the caller had); torch.autograd.grad(loss, "
            "inputs) returns the gradient and touches no .grad"
        )
    assert got.shape == x.shape, (
        f"hint: {how}, the result has shape {tuple(got.shape)}, not x's {tuple(x.shape)}: the gradient is "
        "with respect to the input x (not the model's output or its parameters)"
    )
    assert not got.requires_grad, (
        f"hint: {how}, the result still requires grad (it carries a graph): leave create_graph off, or "
        "return gradient.detach()"
    )
    expected = _expected(model, x, target)
    if torch.allclose(got * batch, expected) and batch > 1:
        raise AssertionError(
            f"hint: {how}, the result is 1/{batch} of each sample's gradient: that is the gradient of the mean "
            "loss; use reduction='sum', so a sample's gradient does not depend on the batch size"
        )
    error = (got - expected).abs().max().item()
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-9), (
        f"hint: {how}, the result differs from each sample's gradient by up to {error:.2e}: differentiate "
        "F.cross_entropy(model(inputs), target, reduction='sum') with respect to inputs, with autograd"
    )


@exercise("input_gradient", reference=reference_input_gradient)
def check_input_gradient(input_gradient: Callable[..., Any]) -> str:
    """Batches of 1, 4 and 9, called normally and inside no_grad: each sample's own gradient, with the model's
    .grad, the caller's x and the result's graph as they must be."""
    for batch in (1, 4, 9):
        _check_one(input_gradient, batch, under_no_grad=False)
    for batch in (4,):
        _check_one(input_gradient, batch, under_no_grad=True)
    return "✓ input_gradient gave each sample's gradient, left .grad and x alone, and worked inside no_grad"
