"""Evaluation: write `balanced_accuracy(y_true, y_pred, num_classes)`, the mean recall over the classes of a whole
evaluation set, which an imbalanced set cannot flatter the way it flatters accuracy."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import exercise


def reference_balanced_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor, num_classes: int) -> float:
    """The mean over classes with true samples of each class's recall, TP / (its true samples)."""
    matrix = torch.bincount(y_true * num_classes + y_pred, minlength=num_classes**2).view(num_classes, num_classes)
    true = matrix.sum(dim=1).double()
    present = true > 0  # a class with no true samples has no recall: scikit-learn leaves it out too
    return float((matrix.diag()[present] / true[present]).mean())


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
    present = true > 0
    recall = torch.where(present, tp / true.clamp(min=1), 0.0)
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), 0.0)
    f1 = torch.where(true + predicted > 0, 2 * tp / (true + predicted), 0.0)
    return {
        "that is the accuracy, where a large class outweighs the small ones: average the recall of each class, "
        "so that every class counts the same": float((y_true == y_pred).double().mean()),
        "the classes without true samples were counted as recall 0 (or the sum divided by num_classes): average "
        "over the classes that have true samples only": float(recall.sum() / num_classes),
        "that is the mean precision (TP / predicted samples): recall is TP / the class's true samples, a row of "
        "the confusion matrix": float(precision[present].mean()),
        "that is the macro F1: balanced accuracy is the mean recall, TP / true samples per class": float(
            f1[present].mean()
        ),
    }


def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(what the case is, y_true, y_pred, num_classes): imbalanced, collapsed, a class predicted but never true,
    one neither true nor predicted, and all right."""
    generator = torch.Generator().manual_seed(0)
    y_true = torch.cat([torch.full((60,), 0), torch.randint(1, 10, (140,), generator=generator)])
    noise = torch.randint(0, 10, (200,), generator=generator)
    noisy = torch.where(torch.rand(200, generator=generator) < 0.7, y_true, noise)
    few = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 2, 2])
    return [
        ("200 labels of 10 classes, a third of them 0, 70% right", y_true, noisy, 10),
        ("a collapsed model answering 0 for everything", y_true, torch.zeros_like(y_true), 10),
        (
            "classes 0-2 true, 3 only predicted, 4 nowhere (num_classes=5)",
            few,
            torch.tensor([0] * 5 + [3, 1, 3, 2, 2]),
            5,
        ),
        ("every answer right", few, few.clone(), 5),
    ]


@exercise("balanced_accuracy", reference=reference_balanced_accuracy)
def check_balanced_accuracy(balanced_accuracy: Callable[[torch.Tensor, torch.Tensor, int], float]) -> str:
    """balanced_accuracy must equal scikit-learn's balanced_accuracy_score on four cases that tell the usual
    mistakes apart, return a plain number, and leave its inputs as they were."""
    for what, y_true, y_pred, num_classes in _cases():
        given = (y_true.clone(), y_pred.clone())
        value = balanced_accuracy(y_true, y_pred, num_classes)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (
            f"hint: return one number (a float), got {type(value).__name__}"
        )
        assert torch.equal(y_true, given[0]) and torch.equal(y_pred, given[1]), (
            "hint: balanced_accuracy changed y_true or y_pred in place: leave the caller's labels as they were"
        )
        assert not math.isnan(value), (
            f"hint: NaN on {what}: a class with no true samples makes a 0/0 recall; leave such classes out of the mean"
        )
        right = reference_balanced_accuracy(y_true, y_pred, num_classes)
        if not math.isclose(value, right, rel_tol=1e-6, abs_tol=1e-9):
            for hint, wrong in _mistakes(y_true, y_pred, num_classes).items():
                assert not math.isclose(value, wrong, rel_tol=1e-6, abs_tol=1e-9), f"hint: on {what}, {hint}"
            raise AssertionError(
                f"hint: on {what} you gave {value:.6f}, the balanced accuracy is {right:.6f}: per class with true "
                "samples TP / true samples, then the plain mean over those classes"
            )
    return "✓ balanced_accuracy matches scikit-learn's balanced_accuracy_score on all 4 cases, absent classes included"
