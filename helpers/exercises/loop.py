"""The training loop: write early stopping with a minimum improvement (`min_delta`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from . import exercise


def reference_early_stopping(val_losses, patience, min_delta=0.0):
    """The epoch whose weights to keep and the epoch training stops at, for per-epoch validation losses."""
    best_epoch, best = 1, val_losses[0]
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if loss < best - min_delta:
            best_epoch, best = epoch, loss
        elif epoch - best_epoch >= patience:
            return best_epoch, epoch
    return best_epoch, len(val_losses)


def lesson_rule(val_losses: Sequence[float], patience: int) -> tuple[int, int]:
    """Notebook 03's early-stopping loop (section 4) over given losses: (best epoch, stop epoch).

    An epoch is the best when its loss is below every earlier one; training stops `patience` epochs after
    the best, or at the last epoch.
    """
    best_epoch = 0
    for epoch in range(1, len(val_losses) + 1):
        if val_losses[epoch - 1] < min(val_losses[: epoch - 1], default=math.inf):
            best_epoch = epoch
        elif epoch - best_epoch >= patience:
            return best_epoch, epoch
    return best_epoch, len(val_losses)


def _random_runs(count: int, seed: int = 0) -> list[tuple[list[float], int]]:
    """Validation curves that fall, level off and wobble (rounded to 2 decimals, so some epochs tie), with a patience."""
    generator = torch.Generator().manual_seed(seed)
    runs = []
    for _ in range(count):
        epochs = int(torch.randint(6, 16, (), generator=generator))
        patience = int(torch.randint(1, 5, (), generator=generator))
        epoch = torch.arange(1, epochs + 1, dtype=torch.float64)
        curve = 0.2 + 1.0 / epoch + 0.03 * torch.randn(epochs, generator=generator, dtype=torch.float64)
        runs.append(([round(float(loss), 2) for loss in curve], patience))
    return runs


PATIENCE_HINT = (
    "training stops at the first epoch that is `patience` epochs past the best: epoch - best_epoch >= patience"
)
ABSOLUTE_HINT = (
    "min_delta is an amount of loss, not a fraction of the best: an epoch is better only when loss < best - min_delta "
    "(not best * (1 - min_delta)), whether the losses are near 0.05 or near 100"
)
CASES = [  # (losses, patience, min_delta), the expected (best epoch, stop epoch), and the hint when it differs
    (([0.5, 0.6, 0.7, 0.4], 2, 0.0), (1, 3), PATIENCE_HINT + " (here it stops before the late improvement)"),
    (([0.5, 0.6, 0.7, 0.4], 3, 0.0), (4, 4), PATIENCE_HINT),
    (
        ([1.0, 0.9, 0.8], 2, 0.0),
        (3, 3),
        "when training never stops early, the stop epoch is the last one: len(val_losses)",
    ),
    (
        ([1.0, 0.8, 0.8, 0.8, 0.7], 2, 0.0),
        (2, 4),
        "an equal loss is no improvement: an epoch is better only when loss < best - min_delta (strictly below)",
    ),
    (
        ([1.0, 0.9, 0.895, 0.894, 0.893, 0.5], 2, 0.01),
        (2, 4),
        "gains smaller than min_delta do not count: an epoch is better only when loss < best - min_delta",
    ),
    (([1.0, 0.9, 0.895, 0.894, 0.893, 0.5], 2, 0.0), (6, 6), "with min_delta=0 every gain counts, however small"),
    (
        ([1.0, 0.996, 0.992, 0.988, 0.984, 0.980], 3, 0.01),
        (4, 6),
        "compare each loss with the best loss so far, not with the previous epoch's: a slow, steady decline "
        "adds up to gains larger than min_delta",
    ),
    (
        ([1.0, 1.1, 0.9, 1.0, 1.0, 1.0], 2, 0.0),
        (3, 5),
        "the patience counts the epochs since the best one: after a better epoch, count again from there",
    ),
    (([0.05, 0.045, 0.0449, 0.0448, 0.03], 2, 0.01), (1, 3), ABSOLUTE_HINT),  # 1% of 0.05 would count 0.005
    (([100.0, 99.5, 99.2, 99.0, 98.9], 2, 0.01), (5, 5), ABSOLUTE_HINT),  # and 1% of 100 none of these gains
]


def _rule(
    val_losses: Sequence[float],
    patience: int,
    min_delta: float,
    *,
    better: Callable[[float, float, float], bool] = lambda loss, best, delta: loss < best - delta,
    against_previous: bool = False,
    stop_after: Callable[[int, int], bool] = lambda waited, patience: waited >= patience,
    reset: bool = True,
    last: int = 0,
) -> tuple[int, int]:
    """The reference rule, or one of its typical mistakes: the comparison, what a loss is compared with, when to stop,
    whether the wait restarts after a better epoch, and the stop epoch when training never stops early (len + last)."""
    best_epoch, best, waited = 1, val_losses[0], 0
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if better(loss, best, min_delta):
            best_epoch, best, waited = epoch, loss, 0 if reset else waited
        else:
            waited += 1
            if stop_after(waited, patience):
                return best_epoch, epoch
        if against_previous:
            best = loss
    return best_epoch, len(val_losses) + last


def _best_of_all(val_losses: Sequence[float], patience: int, min_delta: float) -> tuple[int, int]:
    """The right stop, but the best epoch chosen among all the losses, those after the stop too."""
    _, stop = reference_early_stopping(val_losses, patience, min_delta)
    return min(range(len(val_losses)), key=lambda i: val_losses[i]) + 1, stop


MISTAKES: dict[str, Callable[[Sequence[float], int, float], tuple[int, int]]] = {  # each known mistake by its hint
    "an equal loss is no improvement: an epoch is better only when loss < best - min_delta (strictly below)": (
        lambda *case: _rule(*case, better=lambda loss, best, delta: loss <= best - delta)
    ),
    PATIENCE_HINT + " (you stopped one epoch late)": lambda *case: _rule(*case, stop_after=lambda w, p: w > p),
    ABSOLUTE_HINT: lambda *case: _rule(*case, better=lambda loss, best, delta: loss < best * (1 - delta)),
    "gains smaller than min_delta do not count: an epoch is better only when loss < best - min_delta": (
        lambda losses, patience, _: _rule(losses, patience, 0.0)
    ),
    "compare each loss with the best loss so far, not with the previous epoch's": (
        lambda *case: _rule(*case, against_previous=True)
    ),
    "the patience counts the epochs since the best one: reset your count of epochs without improvement when an "
    "epoch is better": lambda *case: _rule(*case, reset=False),
    "when training never stops early, the stop epoch is the last one: len(val_losses)": (
        lambda *case: _rule(*case, last=-1)
    ),
    "the best epoch is the best of the epochs that ran: losses after the stop epoch were never measured": (
        _best_of_all
    ),
}


@exercise("early_stopping", reference=reference_early_stopping)
def check_early_stopping(early_stopping: Callable) -> str:
    """early_stopping must give the expected (best, stop) epochs on hand-made cases, and the lesson's rule with min_delta=0."""
    lesson_hint = (
        "with min_delta=0 the answer must be section 4's loop: the best epoch has a loss below every earlier "
        "one, and training stops `patience` epochs after it"
    )
    cases = list(CASES)
    cases += [
        ((losses, patience, 0.0), lesson_rule(losses, patience), lesson_hint) for losses, patience in _random_runs(12)
    ]
    for (losses, patience, min_delta), expected, hint in cases:
        given = list(losses)
        got = early_stopping(given, patience, min_delta)
        assert given == list(losses), (
            f"hint: early_stopping changed the list of losses it was given ({list(losses)} became {given}): the "
            "caller's history must stay as it was; read it (sorted(...) makes a copy, .sort() does not)"
        )
        assert isinstance(got, Sequence) and len(got) == 2, (
            f"hint: return two epoch numbers, (best_epoch, stop_epoch), got {got!r}"
        )
        floats = [value for value in got if isinstance(value, float)]
        assert not floats, (
            f"hint: losses {losses}: you returned {tuple(got)}, with {floats[0]!r}, a float: return epoch numbers "
            "(ints counting from 1), not a loss"
        )
        got = tuple(int(epoch) for epoch in got)
        where = f"losses {losses}, patience={patience}, min_delta={min_delta}: got {got}, expected {expected}"
        assert got != (expected[0] - 1, expected[1] - 1), (
            f"hint: {where}. Epochs count from 1: val_losses[0] is the loss of epoch 1"
        )
        if got != expected:
            for known, mistake in MISTAKES.items():
                assert got != mistake(list(losses), patience, min_delta), f"hint: {where}. {known}"
        assert got == expected, f"hint: {where}. {hint}"
    return f"✓ early_stopping gave the expected epochs in all {len(cases)} cases, {len(cases) - len(CASES)} of them section 4's rule"
