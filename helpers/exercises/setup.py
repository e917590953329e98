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


_MOVES = {"to", "copy_", "type_as"}  # calls made to bring a tensor from one device to another: no clash


class _MixedDevices(TorchFunctionMode):
    """Notes every torch call given tensors on two devices (a 0-dim CPU tensor may join any device, as in torch,
    and `w.to(x)`, `w.type_as(x)`, `out.copy_(w)` move a tensor rather than mix two).

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
        if len(devices) > 1 and getattr(func, "__name__", None) not in _MOVES:
            self.mixed.append(f"{getattr(func, '__name__', func)} got tensors on {devices}")
        return func(*args, **kwargs)


HINT_DEVICE = "make the tensors forward builds where x lives: torch.ones(..., device=x.device, dtype=x.dtype)"
HINT_LENGTH = (
    "the weights depend on the length: make them in forward for x.shape[1] (a buffer or parameter made in __init__ "
    "has one fixed size)"
)
HINT_SUPER = "nn.Module's own __init__ never ran: an __init__ of yours must call super().__init__() first"
LENGTHS = (1, 7, 1025)  # one position, another short length, and longer than nanoGPT's 1024-long mask buffer


def _mistakes(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What typical wrong answers give for x, each with its hint."""
    length = x.shape[1]
    lower, upper = torch.ones(length, length, dtype=x.dtype).tril(), torch.ones(length, length, dtype=x.dtype).triu()
    return {
        "position t averaged the positions from t to the end (triu): the lower triangle (tril) keeps 0..t": (
            (upper / upper.sum(dim=1, keepdim=True)) @ x
        ),
        f"every running sum was divided by the whole length ({length}): divide position t by t + 1, the positions "
        "so far (each row of the tril matrix by its own sum)": x.cumsum(dim=1) / length,
        "each column of the tril matrix was divided by its sum: divide each row by its sum, "
        "weights.sum(dim=1, keepdim=True)": (lower / lower.sum(dim=0, keepdim=True)) @ x,
    }


def _graph_leaves(output: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors whose gradients backward from `output` would accumulate (the AccumulateGrad nodes)."""
    leaves, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _check_gradient(module: nn.Module, x: torch.Tensor) -> None:
    """Gradients flow from the output back to x, and to nothing else."""
    inputs = x.detach().clone().requires_grad_()
    out = module(inputs)
    assert out.requires_grad, (
        "hint: the output carries no graph (forward ran under torch.no_grad(), or detached its result): the values "
        "are right, but no gradient would reach the layers before this module; compute it with ordinary operations"
    )
    strangers = [leaf for leaf in _graph_leaves(out) if leaf is not inputs]
    assert not strangers, (
        f"hint: forward made a tensor of shape {tuple(strangers[0].shape)} with requires_grad=True: every backward "
        "fills its .grad, which nothing reads, and it is no parameter an optimizer would train; make the weights "
        "as plain tensors (requires_grad stays False)"
    )
    (gradient,) = torch.autograd.grad(out.square().sum(), inputs)
    expected_inputs = x.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(_running_mean(expected_inputs).square().sum(), expected_inputs)
    assert torch.allclose(gradient, expected, atol=1e-5), (
        "hint: the values are right but their gradient with respect to x is not: does forward detach part of "
        "the computation?"
    )


def _build(RunningMean: Callable[..., Any]) -> nn.Module:
    """RunningMean(), refused with a hint when it is no module, never ran nn.Module.__init__ or holds parameters."""
    try:
        module = RunningMean()
    except AttributeError as error:  # register_buffer and friends before Module.__init__
        if "Module.__init__" in str(error):
            raise AssertionError(f"hint: {HINT_SUPER}") from None
        raise
    assert isinstance(module, nn.Module), "hint: RunningMean must be an nn.Module: class RunningMean(nn.Module)"
    assert "_parameters" in vars(module), f"hint: {HINT_SUPER}"
    names = [name for name, _ in module.named_parameters()]
    assert not names, (
        f"hint: RunningMean holds parameters {names}, which an optimizer would train: the weights follow from the "
        "length alone; make them in forward"
    )
    return module


def _fixed_sizes(module: nn.Module) -> list[int]:
    """The largest dimension of each buffer the module holds (a fixed length, if one is a mask)."""
    return [max(buffer.shape) for buffer in module.buffers() if buffer.dim() > 0]


@exercise("RunningMean", reference=reference_running_mean)
def check_running_mean(RunningMean: Callable[..., Any]) -> str:
    """RunningMean()(x) must equal the running mean on the CPU (float32 at several lengths, float64), pass gradients
    back to x and to nothing else, leave x as it was, and run on meta and the best device."""
    generator = torch.Generator().manual_seed(0)
    module = _build(RunningMean)
    x = torch.randn(2, 6, 3, generator=generator)
    given = x.clone()
    out = module(x)
    assert torch.equal(x, given), (
        "hint: forward changed x in place (cumsum_, div_, /=, +=): the caller's tensor must stay as it was; use "
        "the out-of-place operations (x.cumsum(...), weights @ x)"
    )
    assert out.shape == x.shape, f"hint: the output keeps the input's shape {tuple(x.shape)}, got {tuple(out.shape)}"
    if not torch.allclose(out, _running_mean(x), atol=1e-5):
        for hint, wrong in _mistakes(x).items():
            assert not torch.allclose(out, wrong, atol=1e-5), f"hint: {hint}"
        raise AssertionError(
            "hint: position t holds the mean of x[:, :t + 1]: a lower-triangular matrix of ones, each row divided "
            "by its sum, times x"
        )
    _check_gradient(module, x)
    lengths = sorted({*LENGTHS, *(size + 1 for size in _fixed_sizes(module) if size < 4096)})
    for length in lengths:
        x_long = torch.randn(1, length, 2, generator=generator)
        try:
            out_long = module(x_long)
        except RuntimeError as error:
            raise AssertionError(
                f"hint: right for length 6, but for length {length} forward failed ({str(error)[:80]}); {HINT_LENGTH}"
            ) from None
        assert out_long.shape == x_long.shape and torch.allclose(out_long, _running_mean(x_long), atol=1e-5), (
            f"hint: right for length 6, but wrong for length {length}: {HINT_LENGTH}"
        )
    x64 = torch.randn(3, 5, 2, generator=generator, dtype=torch.float64)
    try:
        out64 = _build(RunningMean)(x64)
    except RuntimeError as error:
        raise AssertionError(f"hint: on float64 input forward failed ({str(error)[:80]}); {HINT_DEVICE}") from None
    assert out64.dtype == torch.float64 and torch.allclose(out64, _running_mean(x64)), (
        f"hint: on float64 input the output should be the float64 running mean, got {out64.dtype}"
    )
    places = list(dict.fromkeys([torch.device("meta"), pick_device()]))
    for where in places:
        try:
            with _MixedDevices() as calls:
                moved = _build(RunningMean).to(where)(x.to(where))
        except RuntimeError as error:
            raise AssertionError(f"hint: on {where} forward failed ({str(error)[:80]}); {HINT_DEVICE}") from None
        assert not calls.mixed, f"hint: with x on {where}, {calls.mixed[0]} (on a GPU: an error); {HINT_DEVICE}"
        assert moved.device == x.to(where).device, f"hint: the output should live on {where}, not {moved.device}"
        assert where.type == "meta" or torch.allclose(moved.cpu(), out, atol=1e-5), (
            f"hint: on {where} the values differ"
        )
    return (
        f"✓ RunningMean gave the running mean in float32 (lengths 1 to {lengths[-1]}) and float64, and ran on "
        f"{', '.join(map(str, places))}"
    )
