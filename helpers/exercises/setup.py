"""Setup and devices: write RunningMean, a module whose tensors made in `forward` follow the input."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from helpers.devices import pick_device

from . import exercise


class reference_running_mean(nn.Module):  # a class: the learner writes a module
    """At each position t of x (batch, length, features), the mean of x over positions 0..t."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        weights = torch.ones(length, length, device=x.device, dtype=x.dtype).tril()
        return (weights / weights.sum(dim=1, keepdim=True)) @ x


def _running_mean(x: torch.Tensor) -> torch.Tensor:
    """The direct computation: the running sum over positions divided by the number of positions so far."""
    return x.cumsum(dim=1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


class _MixedDevices(TorchFunctionMode):
    """Notes every torch call given tensors on two devices (a 0-dim CPU tensor may join any device, as in torch).

    A CPU tensor meets a meta tensor without an error in some ops (matmul among them), so running on `meta` alone
    would not show a tensor that forward made on the CPU; on a GPU the same call raises.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = sorted({str(t.device) for t in tensors if t.dim() > 0 or t.device.type != "cpu"})
        if len(devices) > 1:
            self.mixed.append(f"{getattr(func, '__name__', func)} got tensors on {devices}")
        return func(*args, **kwargs)


HINT_DEVICE = "make the tensors forward builds where x lives: torch.ones(..., device=x.device, dtype=x.dtype)"


@exercise("RunningMean", reference=reference_running_mean)
def check_running_mean(RunningMean: Callable[..., Any]) -> str:
    """RunningMean()(x) must equal the running mean on the CPU (float32, float64), and run on meta and the best device."""
    generator = torch.Generator().manual_seed(0)
    module = RunningMean()
    assert isinstance(module, nn.Module), "hint: RunningMean must be an nn.Module: class RunningMean(nn.Module)"
    x = torch.randn(2, 6, 3, generator=generator)
    out = module(x)
    assert out.shape == x.shape, f"hint: the output keeps the input's shape {tuple(x.shape)}, got {tuple(out.shape)}"
    assert torch.allclose(out, _running_mean(x), atol=1e-5), (
        "hint: position t holds the mean of x[:, :t + 1]: a lower-triangular matrix of ones, each row divided by "
        "its sum, times x"
    )
    x64 = torch.randn(3, 5, 2, generator=generator, dtype=torch.float64)
    try:
        out64 = RunningMean()(x64)
    except RuntimeError as error:
        raise AssertionError(f"hint: on float64 input forward failed ({str(error)[:80]}); {HINT_DEVICE}") from None
    assert out64.dtype == torch.float64 and torch.allclose(out64, _running_mean(x64)), (
        f"hint: on float64 input the output should be the float64 running mean, got {out64.dtype}"
    )
    places = list(dict.fromkeys([torch.device("meta"), pick_device()]))
    for where in places:
        try:
            with _MixedDevices() as calls:
                moved = RunningMean().to(where)(x.to(where))
        except RuntimeError as error:
            raise AssertionError(f"hint: on {where} forward failed ({str(error)[:80]}); {HINT_DEVICE}") from None
        assert not calls.mixed, f"hint: with x on {where}, {calls.mixed[0]} (on a GPU: an error); {HINT_DEVICE}"
        assert moved.device == x.to(where).device, f"hint: the output should live on {where}, not {moved.device}"
        assert where.type == "meta" or torch.allclose(moved.cpu(), out, atol=1e-5), (
            f"hint: on {where} the values differ"
        )
    return f"✓ RunningMean gave the running mean in float32 and float64, and ran on {', '.join(map(str, places))}"
