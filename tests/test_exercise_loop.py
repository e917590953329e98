"""The early-stopping exercise gives each kind of mistake its own hint, and its rule is the lesson's."""

import pytest

from helpers.exercises.loop import _random_runs, check_early_stopping, lesson_rule, reference_early_stopping


def ties_count_as_better(val_losses, patience, min_delta=0.0):
    best_epoch, best = 1, val_losses[0]
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if loss <= best - min_delta:  # an equal loss resets the patience
            best_epoch, best = epoch, loss
        elif epoch - best_epoch >= patience:
            return best_epoch, epoch
    return best_epoch, len(val_losses)


def counts_from_zero(val_losses, patience, min_delta=0.0):
    best_epoch, best = 0, val_losses[0]
    for epoch, loss in enumerate(val_losses[1:], start=1):
        if loss < best - min_delta:
            best_epoch, best = epoch, loss
        elif epoch - best_epoch >= patience:
            return best_epoch, epoch
    return best_epoch, len(val_losses) - 1


def waits_one_epoch_too_long(val_losses, patience, min_delta=0.0):
    best_epoch, best = 1, val_losses[0]
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if loss < best - min_delta:
            best_epoch, best = epoch, loss
        elif epoch - best_epoch > patience:
            return best_epoch, epoch
    return best_epoch, len(val_losses)


def ignores_min_delta(val_losses, patience, min_delta=0.0):
    return reference_early_stopping(val_losses, patience, 0.0)


def compares_with_the_previous_epoch(val_losses, patience, min_delta=0.0):
    best_epoch, previous = 1, val_losses[0]
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if loss < previous - min_delta:
            best_epoch = epoch
        elif epoch - best_epoch >= patience:
            return best_epoch, epoch
        previous = loss
    return best_epoch, len(val_losses)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (ties_count_as_better, "an equal loss is no improvement"),
        (counts_from_zero, "Epochs count from 1"),
        (waits_one_epoch_too_long, "epoch - best_epoch >= patience"),
        (ignores_min_delta, "gains smaller than min_delta do not count"),
        (compares_with_the_previous_epoch, "not with the previous epoch's"),
    ],
)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_early_stopping(wrong)


def test_with_min_delta_zero_the_reference_is_the_lessons_rule():
    for losses, patience in _random_runs(200, seed=1):
        assert reference_early_stopping(losses, patience, 0.0) == lesson_rule(losses, patience)


def test_the_lessons_rule_stops_patience_epochs_after_the_first_lowest_loss():
    assert lesson_rule([0.5, 0.4, 0.4, 0.45, 0.3], 2) == (2, 4)  # the tie at epoch 3 is not better
    assert lesson_rule([0.5, 0.4, 0.4, 0.45, 0.3], 3) == (5, 5)
    assert lesson_rule([0.3], 1) == (1, 1)
