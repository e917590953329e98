"""The weighted_f1 exercise gives each kind of mistake its own hint, and agrees with scikit-learn."""

import pytest
import torch
from sklearn.metrics import f1_score

from helpers.exercises.evaluation import _cases, check_weighted_f1, reference_weighted_f1


def _counts(y_true, y_pred, num_classes):
    classes = torch.arange(num_classes)
    tp = ((y_true[:, None] == classes) & (y_pred[:, None] == classes)).sum(0).double()
    return tp, (y_true[:, None] == classes).sum(0).double(), (y_pred[:, None] == classes).sum(0).double()


def macro(y_true, y_pred, num_classes):  # every class weighs the same
    tp, true, predicted = _counts(y_true, y_pred, num_classes)
    return float(torch.where(true + predicted > 0, 2 * tp / (true + predicted), 0.0).mean())


def weighted_by_predictions(y_true, y_pred, num_classes):  # the column sums as weights
    tp, true, predicted = _counts(y_true, y_pred, num_classes)
    f1 = torch.where(true + predicted > 0, 2 * tp / (true + predicted), 0.0)
    return float((f1 * predicted).sum() / predicted.sum())


def accuracy(y_true, y_pred, num_classes):  # the share of right answers
    return (y_true == y_pred).double().mean().item()


def weighted_precision(y_true, y_pred, num_classes):  # precision alone, recall forgotten
    tp, true, predicted = _counts(y_true, y_pred, num_classes)
    return float((torch.where(predicted > 0, tp / predicted, 0.0) * true).sum() / true.sum())


def divided_by_classes(y_true, y_pred, num_classes):  # sum of F1 x support over the number of classes
    tp, true, predicted = _counts(y_true, y_pred, num_classes)
    f1 = torch.where(true + predicted > 0, 2 * tp / (true + predicted), 0.0)
    return float((f1 * true).sum() / num_classes)


def nan_for_zero_division(y_true, y_pred, num_classes):  # P and R as divisions, 0/0 left as NaN
    tp, true, predicted = _counts(y_true, y_pred, num_classes)
    precision, recall = tp / predicted, tp / true
    return (
        float(((2 * precision * recall / (precision + recall)) * true).nansum() / true.sum())
        if (predicted > 0).all()
        else float("nan")
    )


def as_a_string(y_true, y_pred, num_classes):  # a formatted number, not a number
    return f"{reference_weighted_f1(y_true, y_pred, num_classes):.4f}"


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (macro, r"macro average"),
    (weighted_by_predictions, "weighted by how often they were predicted"),
    (accuracy, "that is the accuracy"),
    (weighted_precision, "that is the weighted precision"),
    (divided_by_classes, "divided by the number of classes"),
    (nan_for_zero_division, "NaN on a collapsed model"),
    (as_a_string, "return one number"),
]


def with_sklearn(y_true, y_pred, num_classes):
    return f1_score(
        y_true.numpy(), y_pred.numpy(), average="weighted", labels=list(range(num_classes)), zero_division=0
    )


def with_precision_and_recall(y_true, y_pred, num_classes):
    tp, true, predicted = _counts(y_true, y_pred, num_classes)
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), 0.0)
    recall = torch.where(true > 0, tp / true.clamp(min=1), 0.0)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
    return (f1 * true).sum() / true.sum()  # a one-element tensor is accepted


RIGHT = [with_sklearn, with_precision_and_recall]


@pytest.mark.parametrize("wrong, hint", WRONG, ids=lambda v: getattr(v, "__name__", "hint"))
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        check_weighted_f1.check(wrong)


@pytest.mark.parametrize("right", RIGHT, ids=lambda v: v.__name__)
def test_other_right_answers_pass(right):
    assert check_weighted_f1.check(right).startswith("✓ ")


@pytest.mark.parametrize("case", range(4))
def test_the_reference_is_scikit_learns_weighted_f1(case):
    _, y_true, y_pred, num_classes = _cases()[case]
    assert reference_weighted_f1(y_true, y_pred, num_classes) == pytest.approx(
        with_sklearn(y_true, y_pred, num_classes), rel=1e-12
    )


def test_a_changed_input_is_named():
    def sorts_in_place(y_true, y_pred, num_classes):
        y_true.copy_(y_true.sort().values)
        return reference_weighted_f1(y_true, y_pred, num_classes)

    with pytest.raises(AssertionError, match="changed y_true or y_pred in place"):
        check_weighted_f1.check(sorts_in_place)
