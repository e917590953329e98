"""Shaping the update: write gradient clipping by the global norm, `clip_by_global_norm_(parameters, max_norm)`,
and check it against `torch.nn.utils.clip_grad_norm_`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from . import exercise


def reference_clip_by_global_norm_(parameters, max_norm):
    """Scale every .grad in place by one factor so that their joint L2 norm is at most max_norm; return the norm before."""
    grads = [p.grad for p in parameters if p.grad is not None]  # one pass: `parameters` may be a generator
    total_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # never above 1: a small norm is left alone
    for grad in grads:
        grad.mul_(scale)
    return total_norm


Grads = Sequence[torch.Tensor | None]  # one .grad per parameter; None: a frozen parameter


def _parameters(grads: Grads) -> list[nn.Parameter]:
    """Parameters holding copies of `grads` (None: a frozen parameter, without a gradient)."""
    parameters = []
    for grad in grads:
        parameter = nn.Parameter(torch.ones(3 if grad is None else grad.shape), requires_grad=grad is not None)
        parameter.grad = None if grad is None else grad.clone()
        parameters.append(parameter)
    return parameters


def _grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor | None]:
    return [p.grad for p in parameters]


def _by_torch(grads: Grads, max_norm: float) -> list[torch.Tensor | None]:
    """What clip_grad_norm_ leaves in each .grad."""
    parameters = _parameters(grads)
    torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return _grads(parameters)


def _norm(grads: Grads) -> float:
    return float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads if g is not None])))


def _same(mine: Grads, theirs: Grads, *, exact: bool = False) -> bool:
    """Equal gradients (None where None), bit for bit when `exact`, else within float32 rounding."""
    return all(
        (a is None and b is None)
        or (
            a is not None
            and b is not None
            and (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=0))
        )
        for a, b in zip(mine, theirs)
    )


def _cases() -> dict[str, tuple[list[torch.Tensor | None], float]]:
    """Gradients (None: frozen) and a max_norm: over it, under it, tiny, with frozen parameters."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=generator)

    uneven: list[torch.Tensor | None] = [randn(8, 5, scale=2.0), randn(5, scale=0.1), randn(3, 4, scale=0.5)]
    tiny: list[torch.Tensor | None] = [randn(16, 8, scale=1e-5), randn(8, scale=1e-5)]  # a norm near 1e-4
    frozen: list[torch.Tensor | None] = [None, randn(6, 4, scale=1.0), None, randn(4, scale=1.0)]
    return {"over": (uneven, 4.0), "under": (uneven, 100.0), "tiny": (tiny, 2e-5), "frozen": (frozen, 1.0)}


def _each_on_its_own(grads: Grads, max_norm: float) -> list[torch.Tensor | None]:
    """The gradients if every tensor were clipped to max_norm by its own norm (a mistake)."""
    return [None if g is None else g * min(1.0, max_norm / (float(g.norm()) + 1e-6)) for g in grads]


def _model_gradients() -> tuple[nn.Module, list[torch.Tensor | None]]:
    """A small model whose parameters hold one batch's gradients, and copies of those gradients."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        first, second = nn.Linear(4, 6), nn.Linear(6, 1)
        for layer in (first, second):
            nn.init.normal_(layer.weight)
        model = nn.Sequential(first, nn.Tanh(), second)
        model(torch.randn(32, 4)).pow(2).mean().backward()
    return model, [None if g is None else g.clone() for g in _grads(model.parameters())]


@exercise("clip_by_global_norm_", reference=reference_clip_by_global_norm_)
def check_clip_by_global_norm_(clip_by_global_norm_: Callable) -> str:
    """clip_by_global_norm_ must leave clip_grad_norm_'s gradients (in place) and return its norm, on 5 cases."""
    cases = _cases()
    grads, max_norm = cases["over"]
    parameters, norm = _parameters(grads), _norm(grads)
    originals = _grads(parameters)
    returned = clip_by_global_norm_(parameters, max_norm)
    assert returned is not None, f"hint: return the total norm of all gradients measured before clipping ({norm:.4f})"
    got = float(returned)
    summed = sum(float(torch.linalg.vector_norm(g)) for g in grads if g is not None)
    assert not abs(got - summed) <= 1e-5 * summed, (
        f"hint: you returned {got:.4f}, the sum of the tensors' norms: the norm of all gradients together is "
        f"sqrt(sum of every squared element), {norm:.4f} (the L2 norm of the per-tensor norms)"
    )
    assert not abs(got - norm**2) <= 1e-5 * norm**2, (
        f"hint: you returned {got:.4f}, the squared norm: take its square root, {norm:.4f}"
    )
    assert not abs(got - max_norm) <= 1e-4 * max_norm, (
        f"hint: you returned {got:.4f}, the norm after clipping: measure the total norm before scaling, and "
        f"return that ({norm:.4f}), as clip_grad_norm_ does"
    )
    assert abs(got - norm) <= 1e-5 * norm, (
        f"hint: return the total norm of all gradients measured before clipping ({norm:.4f}), got {returned!r}"
    )
    assert all(torch.equal(p.detach(), torch.ones_like(p)) for p in parameters), (
        "hint: the parameters themselves changed: scale their gradients, p.grad.mul_(scale), not p or p.data"
    )
    assert not _same(_grads(parameters), grads, exact=True), (
        f"hint: the norm {norm:.2f} is over max_norm={max_norm} but the gradients did not change: scale each p.grad "
        "in place, p.grad.mul_(scale); multiplying a local copy changes nothing"
    )
    assert all(p.grad is g for p, g in zip(parameters, originals)), (
        "hint: p.grad was replaced by a new tensor: scale it in place with p.grad.mul_(scale), as the trailing _ "
        "promises (other code may hold the gradient tensors)"
    )
    mine = _grads(parameters)
    clamped = [None if g is None else g.clamp(-max_norm, max_norm) for g in grads]
    assert _same(mine, _by_torch(grads, max_norm)) or not _same(mine, clamped), (
        f"hint: each value was clamped to ±{max_norm}: that is clip_grad_value_; clipping by norm scales every "
        "gradient by one factor, min(1, max_norm / (total_norm + 1e-6)), keeping the update's direction"
    )
    assert _same(mine, _by_torch(grads, max_norm)) or not _same(mine, _each_on_its_own(grads, max_norm)), (
        "hint: each tensor was clipped to max_norm on its own; clip_grad_norm_ takes ONE norm over all gradients "
        "together and scales every gradient by the same factor, keeping the update's direction"
    )
    assert _same(mine, _by_torch(grads, max_norm)), (
        "hint: the gradients differ from clip_grad_norm_'s: total_norm = the L2 norm of all gradients together; "
        "scale = min(1, max_norm / (total_norm + 1e-6)); every p.grad.mul_(scale)"
    )

    grads, max_norm = cases["under"]
    parameters = _parameters(grads)
    clip_by_global_norm_(parameters, max_norm)
    assert _same(_grads(parameters), grads, exact=True), (
        f"hint: the norm {norm:.2f} is already under max_norm={max_norm}, so the gradients must stay as they are: "
        "the scale is min(1, max_norm / (total_norm + 1e-6)), never above 1"
    )

    grads, max_norm = cases["tiny"]
    parameters = _parameters(grads)
    clip_by_global_norm_(parameters, max_norm)
    assert _same(_grads(parameters), _by_torch(grads, max_norm)), (
        "hint: with tiny gradients (norm near 1e-4) the result differs from clip_grad_norm_'s: divide by "
        "total_norm + 1e-6, as it does (the 1e-6 also keeps an all-zero gradient from dividing by zero)"
    )

    grads, max_norm = cases["frozen"]
    parameters = _parameters(grads)
    try:
        clip_by_global_norm_(parameters, max_norm)
    except (TypeError, AttributeError) as error:
        raise AssertionError(
            f"hint: a frozen parameter has p.grad None ({type(error).__name__}: {error}); skip it, as "
            "clip_grad_norm_ does: [p.grad for p in parameters if p.grad is not None]"
        ) from None
    assert _same(_grads(parameters), _by_torch(grads, max_norm)), (
        "hint: with frozen parameters (p.grad None) among them, the gradients differ from clip_grad_norm_'s: "
        "leave the frozen ones out of the norm and leave their .grad None"
    )

    model, grads = _model_gradients()
    max_norm = 0.1 * _norm(grads)
    clip_by_global_norm_(model.parameters(), max_norm)  # a generator, as a training loop passes it
    assert _same(_grads(model.parameters()), _by_torch(grads, max_norm)), (
        "hint: given model.parameters(), a generator that runs out after one pass, the gradients were not "
        "clipped: make one list first (grads = [p.grad for p in parameters if p.grad is not None]) and use it twice"
    )
    return (
        "✓ clip_by_global_norm_ agreed with clip_grad_norm_ over and under max_norm, tiny, frozen and from a generator"
    )
