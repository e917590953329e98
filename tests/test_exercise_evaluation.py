"""The balanced_accuracy exercise gives each kind of mistake its own hint, and agrees with scikit-learn."""

import warnings

import pytest
import torch
from sklearn.metrics import balanced_accuracy_score

from helpers.exercises.evaluation import _cases, check_balanced_accuracy, reference_balanced_accuracy


def _counts(y_true, y_pred, num_classes):
    classes = torch.arange(num_classes)
    tp = ((y_true[:, None] == classes) & (y_pred[:, None] == classes)).sum(0).double()
    return tp, (y_true[:, None] == classes).sum(0).double(), (y_pred[:, None] == classes).sum(0).double()


def accuracy(y_true, y_pred, num_classes):  # the share of right answers: the big class dominates
    return (y_true == y_pred).double().mean().item()


def absent_classes_as_zero(y_true, y_pred, num_classes):  # every class in the mean, absent ones as recall 0
    tp, true, _ = _counts(y_true, y_pred, num_classes)
    return float((tp / true.clamp(min=1)).sum() / num_classes)


def mean_precision(y_true, y_pred, num_classes):  # TP / predicted: the columns, not the rows
    tp, true, predicted = _counts(y_true, y_pred, num_classes)
    return float((tp / predicted.clamp(min=1))[true > 0].mean())


def macro_f1(y_true, y_pred, num_classes):  # the F1 of each class, averaged
    tp, true, predicted = _counts(y_true, y_pred, num_classes)
    return float((2 * tp / (true + predicted).clamp(min=1))[true > 0].mean())


def nan_for_absent_classes(y_true, y_pred, num_classes):  # 0/0 left in the mean
    tp, true, _ = _counts(y_true, y_pred, num_classes)
    return float((tp / true).mean())


def as_a_string(y_true, y_pred, num_classes):  # a formatted number, not a number
    return f"{reference_balanced_accuracy(y_true, y_pred, num_classes):.4f}"


def sorts_in_place(y_true, y_pred, num_classes):  # the caller's labels reordered
    y_true.copy_(y_true.sort().values)
    return reference_balanced_accuracy(y_true, y_pred, num_classes)


def zeroes_the_predictions(y_true, y_pred, num_classes):  # right, then clears the caller's predictions
    value = reference_balanced_accuracy(y_true, y_pred, num_classes)
    y_pred.zero_()
    return value


def per_class_recalls(y_true, y_pred, num_classes):  # each class's recall, never averaged
    tp, true, _ = _counts(y_true, y_pred, num_classes)
    return (tp / true.clamp(min=1))[true > 0]


def over_the_predicted_classes(y_true, y_pred, num_classes):  # the mean over classes predicted, not true
    tp, true, predicted = _counts(y_true, y_pred, num_classes)
    return float((tp / true.clamp(min=1))[predicted > 0].mean())


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (accuracy, "that is the accuracy"),
    (absent_classes_as_zero, "counted as recall 0"),
    (mean_precision, "that is the mean precision"),
    (macro_f1, "that is the macro F1"),
    (nan_for_absent_classes, "NaN on"),
    (as_a_string, "return one number"),
    (sorts_in_place, "changed y_true or y_pred in place"),
    (zeroes_the_predictions, "changed y_true or y_pred in place"),
    (per_class_recalls, "return one number .a float., got Tensor"),
    (over_the_predicted_classes, "per class with true samples TP / true samples, then the plain mean"),
]


def with_sklearn(y_true, y_pred, num_classes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "y_pred contains classes not in y_true"
        return balanced_accuracy_score(y_true.numpy(), y_pred.numpy())


def with_nanmean(y_true, y_pred, num_classes):  # 0/0 as NaN, then a mean that skips NaN
    tp, true, _ = _counts(y_true, y_pred, num_classes)
    return (tp / true).nanmean()  # a one-element tensor is accepted


RIGHT = [with_sklearn, with_nanmean]


@pytest.mark.parametrize("wrong, hint", WRONG, ids=lambda v: getattr(v, "__name__", "hint"))
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        check_balanced_accuracy.check(wrong)


@pytest.mark.parametrize("right", RIGHT, ids=lambda v: v.__name__)
def test_other_right_answers_pass(right):
    assert check_balanced_accuracy.check(right).startswith("✓ ")


@pytest.mark.parametrize("case", range(4))
def test_the_reference_is_scikit_learns_balanced_accuracy(case):
    _, y_true, y_pred, num_classes = _cases()[case]
    assert reference_balanced_accuracy(y_true, y_pred, num_classes) == pytest.approx(
        with_sklearn(y_true, y_pred, num_classes), rel=1e-12
    )
