"""zero_grad and gradient accumulation: write one optimizer step from a list of micro-batches that equals one step
on all their samples at once (an uneven last micro-batch included), with one micro-batch's graph alive at a time
and no gradients left behind."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from helpers.data import DigitsDataset
from helpers.grads import flat_grad, max_abs_diff
from helpers.loop import has_pending_gradients
from helpers.memory import format_bytes, saved_tensors_meter
from helpers.models import MLP

from . import exercise

SIZES = (16, 16, 16, 7)  # the micro-batches of every case: the last one shorter


def reference_accumulation_step(model, optimizer, micro_batches):
    """One optimizer step from the micro-batches, equal to one step on their concatenation."""
    samples = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        loss = F.cross_entropy(model(inputs), targets) * (len(targets) / samples)  # its share of the samples
        loss.backward()  # adds to .grad and frees this micro-batch's graph
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@functools.cache
def _digits() -> DigitsDataset:
    return DigitsDataset("train")  # read once: the check builds micro-batches from it several times


def _micro_batches(start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Digits cut into SIZES from `start`, each micro-batch in its own tensors, as a DataLoader delivers them."""
    digits, bounds = _digits(), [start]
    for size in SIZES:
        bounds.append(bounds[-1] + size)
    return [(digits.images[a:b].clone(), digits.targets[a:b].clone()) for a, b in itertools.pairwise(bounds)]


def _two_steps(step: Callable) -> tuple[list[torch.Tensor], list[bool], int]:
    """Two calls of `step` (two batches) on a seeded MLP with SGD: the gradient each optimizer.step() used, whether
    gradients were pending after each call, and the first call's peak of bytes saved for backward."""
    torch.manual_seed(0)
    model = MLP(64, (32,), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    used: list[torch.Tensor] = []
    optimizer.register_step_pre_hook(lambda *_: used.append(flat_grad(model).clone()))  # .grad as step() starts
    pending, peak = [], 0
    for call, start in enumerate((0, sum(SIZES))):
        with saved_tensors_meter() as meter:
            step(model, optimizer, _micro_batches(start))
        peak = meter.peak_bytes if call == 0 else peak
        pending.append(has_pending_gradients(model))
    return used, pending, peak


def _one_batch_step(model, optimizer, micro_batches):
    """The step to match: one batch of all the micro-batches' samples, one plain mean loss."""
    inputs, targets = (torch.cat(parts) for parts in zip(*micro_batches))
    F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _divided_by_k_step(model, optimizer, micro_batches):
    """The same step with every micro-batch's loss divided by k: the mistake the first hint names."""
    for inputs, targets in micro_batches:
        (F.cross_entropy(model(inputs), targets) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _unweighted_step(model, optimizer, micro_batches):
    """The micro-batches' mean losses added up as they are: a mistake."""
    for inputs, targets in micro_batches:
        F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _last_only_step(model, optimizer, micro_batches):
    """The gradients zeroed before each micro-batch: only the last one's reaches the step (a mistake)."""
    for inputs, targets in micro_batches:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _parallel(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same direction (whatever the lengths)."""
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 1 - 1e-6


def _first_gradient_hint(mine: torch.Tensor, batch: torch.Tensor) -> str:
    """The hint for a first step whose gradient is not the one-batch gradient: which known mistake it matches."""
    if _parallel(mine, _two_steps(_last_only_step)[0][0]):
        return (
            "only the last micro-batch's gradient reached optimizer.step(): a zero_grad() between micro-batches "
            "wipes what the earlier backward() calls added; zero the gradients once, after optimizer.step()"
        )
    if torch.allclose(mine, _two_steps(_unweighted_step)[0][0], rtol=1e-4, atol=1e-6):
        return (
            "the micro-batches' mean losses were added up as they are, so the gradient is several times the "
            "batch's: weight each by len(targets) / (samples in all micro-batches)"
        )
    if _parallel(mine, batch):
        return (
            f"the gradient points the right way but is {float(mine.norm() / batch.norm()):.2f}x as long: weight "
            f"each micro-batch's mean loss by len(targets) / {sum(SIZES)}, all the samples the micro-batches hold"
        )
    return (
        "the first step's gradient is not the one-batch gradient: each micro-batch's mean loss times "
        "len(targets) / (samples in all micro-batches), then backward()"
    )


@exercise("accumulation_step", reference=reference_accumulation_step)
def check_accumulation_step(accumulation_step: Callable) -> str:
    """Two calls on micro-batches of SIZES must use the one-batch gradient at one step each, leave no gradients
    pending, and keep one micro-batch's graph alive at a time."""
    mine, pending, peak = _two_steps(accumulation_step)
    batch, _, _ = _two_steps(_one_batch_step)
    divided, _, _ = _two_steps(_divided_by_k_step)
    _, _, one_graph = _two_steps(reference_accumulation_step)
    assert len(mine) == 2, (
        f"hint: optimizer.step() ran {len(mine)} times in two calls: step once per call, after the last micro-batch's "
        "backward(), not once per micro-batch"
    )
    same = [torch.allclose(m, b, rtol=1e-4, atol=1e-6) for m, b in zip(mine, batch)]
    assert same[0] or not torch.allclose(mine[0], divided[0], rtol=1e-4, atol=1e-6), (
        f"hint: dividing each loss by k is right only when all micro-batches are equally large; these are {list(SIZES)}: "
        "weight each micro-batch's mean loss by its share of the samples, len(targets) / (samples in all micro-batches)"
    )
    assert same[0], f"hint: {_first_gradient_hint(mine[0], batch[0])}"
    assert same[1], (
        "hint: the first step was right, the second is off: the first call's gradients added to the second's; "
        "call optimizer.zero_grad(set_to_none=True) after optimizer.step()"
    )
    assert not any(pending), (
        "hint: gradients were pending after a call: clear them after optimizer.step() (not only before), so that "
        "evaluation or the next step never sees them"
    )
    assert peak <= 1.1 * one_graph, (
        f"hint: the saved-tensor peak was {format_bytes(peak)}, one micro-batch's graph is {format_bytes(one_graph)}: "
        "call backward() on each micro-batch's loss in turn; summing the losses first (or one forward pass over all "
        "the samples) keeps every micro-batch's activations alive until the end"
    )
    diff = max(max_abs_diff(m, b) for m, b in zip(mine, batch))
    return (
        f"✓ accumulation_step, micro-batches {list(SIZES)}: the batch's gradient in both steps "
        f"(diff {diff:.0e}), one graph alive"
    )
