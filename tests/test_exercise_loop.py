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


def relative_min_delta(val_losses, patience, min_delta=0.0):
    best_epoch, best = 1, val_losses[0]
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if loss < best * (1 - min_delta):  # min_delta read as a fraction of the best loss
            best_epoch, best = epoch, loss
        elif epoch - best_epoch >= patience:
            return best_epoch, epoch
    return best_epoch, len(val_losses)


def counter_never_reset(val_losses, patience, min_delta=0.0):
    best_epoch, best, bad_epochs = 1, val_losses[0], 0
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if loss < best - min_delta:
            best_epoch, best = epoch, loss  # bad_epochs = 0 forgotten
        else:
            bad_epochs += 1
            if bad_epochs >= patience:
                return best_epoch, epoch
    return best_epoch, len(val_losses)


def best_of_all_the_losses(val_losses, patience, min_delta=0.0):
    stop = reference_early_stopping(val_losses, patience, min_delta)[1]
    return val_losses.index(min(val_losses)) + 1, stop  # an epoch after the stop may be chosen


def last_epoch_off_by_one(val_losses, patience, min_delta=0.0):
    best_epoch, best = 1, val_losses[0]
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if loss < best - min_delta:
            best_epoch, best = epoch, loss
        elif epoch - best_epoch >= patience:
            return best_epoch, epoch
    return best_epoch, len(val_losses) - 1  # the index of the last loss, not its epoch


def returns_the_best_loss(val_losses, patience, min_delta=0.0):  # the best loss where its epoch belongs
    best_epoch, best = 1, val_losses[0]
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if loss < best - min_delta:
            best_epoch, best = epoch, loss
        elif epoch - best_epoch >= patience:
            return best, epoch
    return best, len(val_losses)


def sorts_the_losses(val_losses, patience, min_delta=0.0):  # the right epochs, and the caller's history sorted
    epochs = reference_early_stopping(val_losses, patience, min_delta)
    val_losses.sort()  # "the lowest loss first", for a printout
    return epochs


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (ties_count_as_better, "an equal loss is no improvement"),
    (counts_from_zero, "Epochs count from 1"),
    (waits_one_epoch_too_long, "epoch - best_epoch >= patience .you stopped one epoch late"),
    (ignores_min_delta, "gains smaller than min_delta do not count"),
    (compares_with_the_previous_epoch, "not with the previous epoch's"),
    (relative_min_delta, r"losses \[0.05, .*min_delta is an amount of loss, not a fraction of the best"),
    (counter_never_reset, "reset your count of epochs without improvement"),
    (best_of_all_the_losses, "the best epoch is the best of the epochs that ran"),
    (last_epoch_off_by_one, "the stop epoch is the last one: len.val_losses."),
    (returns_the_best_loss, r"you returned \(0.5, 3\), with 0.5, a float: return epoch numbers"),
    (sorts_the_losses, "early_stopping changed the list of losses it was given"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_early_stopping(wrong)


def with_a_counter(val_losses, patience, min_delta=0.0):
    best_epoch, best, bad_epochs = 1, val_losses[0], 0
    for epoch, loss in enumerate(val_losses[1:], start=2):
        if loss < best - min_delta:
            best_epoch, best, bad_epochs = epoch, loss, 0
        else:
            bad_epochs += 1
            if bad_epochs == patience:
                return best_epoch, epoch
    return best_epoch, len(val_losses)


def from_infinity(val_losses, patience, min_delta=0.0):
    best_epoch, best = 0, float("inf")
    for epoch, loss in enumerate(val_losses, start=1):
        if best - loss > min_delta:
            best_epoch, best = epoch, loss
        elif epoch - best_epoch >= patience:
            return best_epoch, epoch
    return best_epoch, len(val_losses)


RIGHT = [with_a_counter, from_infinity]


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_early_stopping.check(right).startswith("✓ early_stopping gave the expected epochs")


def test_the_far_from_one_cases_tell_an_absolute_min_delta_from_a_relative_one():
    """Near 1 a gain of min_delta and a gain of min_delta * best are alike; near 0.05 and near 100 they are not."""
    from helpers.exercises.loop import ABSOLUTE_HINT, CASES

    far = [case for case, _, hint in CASES if hint == ABSOLUTE_HINT]
    assert {round(case[0][0]) for case in far} == {0, 100}
    for case in far:
        assert relative_min_delta(*case) != reference_early_stopping(*case)
        assert ignores_min_delta(*case) != relative_min_delta(*case)  # and the hint names which mistake it was


def test_with_min_delta_zero_the_reference_is_the_lessons_rule():
    for losses, patience in _random_runs(200, seed=1):
        assert reference_early_stopping(losses, patience, 0.0) == lesson_rule(losses, patience)


def test_the_lessons_rule_stops_patience_epochs_after_the_first_lowest_loss():
    assert lesson_rule([0.5, 0.4, 0.4, 0.45, 0.3], 2) == (2, 4)  # the tie at epoch 3 is not better
    assert lesson_rule([0.5, 0.4, 0.4, 0.45, 0.3], 3) == (5, 5)
    assert lesson_rule([0.3], 1) == (1, 1)
