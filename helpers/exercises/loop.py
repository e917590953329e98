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
    """Notebook 02's early-stopping loop (section 4) over given losses: (best epoch, stop epoch).

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
]


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
        got = early_stopping(list(losses), patience, min_delta)
        assert isinstance(got, Sequence) and len(got) == 2, (
            f"hint: return two epoch numbers, (best_epoch, stop_epoch), got {got!r}"
        )
        got = tuple(int(epoch) for epoch in got)
        where = f"losses {losses}, patience={patience}, min_delta={min_delta}: got {got}, expected {expected}"
        assert got != (expected[0] - 1, expected[1] - 1), (
            f"hint: {where}. Epochs count from 1: val_losses[0] is the loss of epoch 1"
        )
        assert got == expected, f"hint: {where}. {hint}"
    return f"✓ early_stopping gave the expected epochs in all {len(cases)} cases, {len(cases) - len(CASES)} of them section 4's rule"
