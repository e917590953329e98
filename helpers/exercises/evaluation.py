"""Evaluation: write `weighted_f1(y_true, y_pred, num_classes)`, the weighted F1 of a whole evaluation set."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import exercise


def reference_weighted_f1(y_true: torch.Tensor, y_pred: torch.Tensor, num_classes: int) -> float:
    """Per class F1 = 2 TP / (2 TP + FP + FN) (0 where a class is neither true nor predicted), averaged with each
    class weighted by its true samples."""
    matrix = torch.bincount(y_true * num_classes + y_pred, minlength=num_classes**2).view(num_classes, num_classes)
    true, predicted = matrix.sum(dim=1).double(), matrix.sum(dim=0).double()
    f1 = torch.where(true + predicted > 0, 2 * matrix.diag() / (true + predicted), 0.0)
    return float((f1 * true).sum() / true.sum())


def _per_class(y_true: torch.Tensor, y_pred: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, ...]:
    """Per class: true positives, true samples, predicted samples (float64)."""
    classes = torch.arange(num_classes)
    tp = ((y_true[:, None] == classes) & (y_pred[:, None] == classes)).sum(0).double()
    true = (y_true[:, None] == classes).sum(0).double()
    predicted = (y_pred[:, None] == classes).sum(0).double()
    return tp, true, predicted


def _mistakes(y_true: torch.Tensor, y_pred: torch.Tensor, num_classes: int) -> dict[str, float]:
    """What typical wrong answers give on one case, each with its hint."""
    tp, true, predicted = _per_class(y_true, y_pred, num_classes)
    f1 = torch.where(true + predicted > 0, 2 * tp / (true + predicted), 0.0)
    precision = torch.where(predicted > 0, tp / predicted, 0.0)
    return {
        "every class counted equally (the macro average): weight each class's F1 by its true samples, the row "
        "sums of the confusion matrix": float(f1.mean()),
        "the classes were weighted by how often they were predicted: weight by the true samples of each class "
        "(support), as scikit-learn's average='weighted' does": float((f1 * predicted).sum() / predicted.sum()),
        "that is the accuracy (the share of right answers), not F1: per class 2 TP / (2 TP + FP + FN)": float(
            (y_true == y_pred).double().mean()
        ),
        "that is the weighted precision: F1 combines precision and recall, 2 TP / (2 TP + FP + FN)": float(
            (precision * true).sum() / true.sum()
        ),
        "the weighted sum was divided by the number of classes: divide by the total of the weights (the number "
        "of samples)": float((f1 * true).sum() / num_classes),
    }


def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(what the case is, y_true, y_pred, num_classes): imbalanced, collapsed, a class nowhere, perfect."""
    generator = torch.Generator().manual_seed(0)
    y_true = torch.cat([torch.full((60,), 0), torch.randint(1, 10, (140,), generator=generator)])
    noise = torch.randint(0, 10, (200,), generator=generator)
    noisy = torch.where(torch.rand(200, generator=generator) < 0.7, y_true, noise)
    few = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 3, 3])
    return [
        ("200 labels of 10 classes, a third of them 0, 70% right", y_true, noisy, 10),
        ("a collapsed model answering 2 for everything", y_true, torch.full_like(y_true, 2), 10),
        ("classes 0-3 of num_classes=5 (class 4 neither true nor predicted)", few, few.roll(1), 5),
        ("every answer right", few, few.clone(), 5),
    ]


@exercise("weighted_f1", reference=reference_weighted_f1)
def check_weighted_f1(weighted_f1: Callable[[torch.Tensor, torch.Tensor, int], float]) -> str:
    """weighted_f1 must equal scikit-learn's f1_score(average='weighted', zero_division=0) on four cases that tell
    the usual mistakes apart, return a plain number, and leave its inputs as they were."""
    for what, y_true, y_pred, num_classes in _cases():
        given = (y_true.clone(), y_pred.clone())
        value = weighted_f1(y_true, y_pred, num_classes)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (
            f"hint: return one number (a float), got {type(value).__name__}"
        )
        assert torch.equal(y_true, given[0]) and torch.equal(y_pred, given[1]), (
            "hint: weighted_f1 changed y_true or y_pred in place: leave the caller's labels as they were"
        )
        assert not math.isnan(value), (
            f"hint: NaN on {what}: a class never predicted (or never present) makes a 0/0; count its F1 as 0, as "
            "zero_division=0 does"
        )
        right = reference_weighted_f1(y_true, y_pred, num_classes)
        if not math.isclose(value, right, rel_tol=1e-6, abs_tol=1e-9):
            for hint, wrong in _mistakes(y_true, y_pred, num_classes).items():
                assert not math.isclose(value, wrong, rel_tol=1e-6, abs_tol=1e-9), f"hint: on {what}, {hint}"
            raise AssertionError(
                f"hint: on {what} you gave {value:.6f}, the weighted F1 is {right:.6f}: per class "
                "2 TP / (2 TP + FP + FN), weighted by the class's true samples"
            )
    return "✓ weighted_f1 matches scikit-learn's weighted F1 (zero_division=0) on all 4 cases, 0/0 included"
