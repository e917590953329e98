"""The fit_in_micro_batches exercise (notebook 14) gives each kind of mistake its own hint."""

import pytest
import torch

from helpers.exercises.gpu_memory import check_fit_in_micro_batches, reference_fit_in_micro_batches


def no_retry(step, batch_size):  # runs the whole batch and hopes
    step(1)
    return 1


def retries_inside_except(step, batch_size, micro_batches=1):  # recursion from the handler: the traceback lives on
    try:
        step(micro_batches)
        return micro_batches
    except torch.OutOfMemoryError:
        if 2 * micro_batches > batch_size:
            raise
        return retries_inside_except(step, batch_size, 2 * micro_batches)


def catches_everything(step, batch_size):  # a bug in the step looks like a lack of memory
    micro_batches = 1
    while micro_batches <= batch_size:
        try:
            step(micro_batches)
            return micro_batches
        except Exception:
            pass
        micro_batches *= 2
    return None


def catches_runtime_error(step, batch_size):  # OOM is a RuntimeError, but not every RuntimeError is an OOM
    micro_batches = 1
    while True:
        try:
            step(micro_batches)
            return micro_batches
        except RuntimeError:
            if 2 * micro_batches > batch_size:
                raise
        micro_batches *= 2


def never_gives_up(step, batch_size):  # no bound: asks for micro-batches smaller than a sample
    micro_batches = 1
    while True:
        try:
            step(micro_batches)
            return micro_batches
        except torch.OutOfMemoryError:
            pass
        micro_batches *= 2


def gives_up_quietly(step, batch_size):  # nothing fits, and the caller is not told
    micro_batches = 1
    while micro_batches <= batch_size:
        try:
            step(micro_batches)
            return micro_batches
        except torch.OutOfMemoryError:
            pass
        micro_batches *= 2
    return micro_batches


def returns_the_next_count(step, batch_size):  # doubles once too often before returning
    micro_batches = 1
    while True:
        try:
            step(micro_batches)
            break
        except torch.OutOfMemoryError:
            if 2 * micro_batches > batch_size:
                raise
        micro_batches *= 2
    return 2 * micro_batches


def runs_the_step_twice(step, batch_size):  # finds the count, then runs it again "for real"
    micro_batches = reference_fit_in_micro_batches(step, batch_size)
    step(micro_batches)
    return micro_batches


def adds_one(step, batch_size):  # 1, 2, 3, 4, ...: more tries than doubling
    micro_batches = 1
    while True:
        try:
            step(micro_batches)
            return micro_batches
        except torch.OutOfMemoryError:
            if micro_batches >= batch_size:
                raise
        micro_batches += 1


def iterative_with_flag(step, batch_size):  # notes the failure in a flag and retries after the handler
    for exponent in range(batch_size.bit_length()):
        failed = False
        try:
            step(2**exponent)
        except torch.OutOfMemoryError as error:
            failed, last = True, error
        if not failed:
            return 2**exponent
    raise last


def with_for_else(step, batch_size):
    micro_batches = 1
    while micro_batches <= batch_size:
        try:
            step(micro_batches)
        except torch.OutOfMemoryError as error:
            last = error
        else:
            return micro_batches
        micro_batches *= 2
    raise last


def gives_up_one_doubling_early(step, batch_size):  # >= where > belongs: one-sample micro-batches never tried
    micro_batches = 1
    while True:
        try:
            step(micro_batches)
            return micro_batches
        except torch.OutOfMemoryError:
            if 2 * micro_batches >= batch_size:
                raise
        micro_batches *= 2


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (no_retry, "left your function: catch torch.OutOfMemoryError and try twice"),
    (retries_inside_except, "was called inside an except block"),
    (catches_everything, "no lack of memory, and your function tried again"),
    (catches_runtime_error, "no lack of memory, and your function tried again"),
    (never_gives_up, "a micro-batch needs at least one sample"),
    (gives_up_quietly, "not even one sample fitted .* yet your function returned 16"),
    (returns_the_next_count, "first fitted in 1 micro-batches .* returned 2"),
    (runs_the_step_twice, "ran to the end 2 times"),
    (adds_one, r"try 1, 2, 4, ... micro-batches in turn \(\[1, 2, 4\]\), your calls were \[1, 2, 3, 4\]"),
    (gives_up_one_doubling_early, r"gave up after step\(4\) \(calls: \[1, 2, 4\]\) though 8 micro-batches of 1"),
]
RIGHT = [iterative_with_flag, with_for_else]


@pytest.mark.parametrize("wrong, hint", WRONG, ids=lambda v: getattr(v, "__name__", "hint"))
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        check_fit_in_micro_batches.check(wrong)


@pytest.mark.parametrize("right", RIGHT, ids=lambda v: v.__name__)
def test_other_right_answers_pass(right):
    assert check_fit_in_micro_batches.check(right).startswith("✓ ")


def test_the_reference_raises_the_error_when_one_sample_does_not_fit():
    def step(micro_batches):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    with pytest.raises(torch.OutOfMemoryError):
        reference_fit_in_micro_batches(step, 4)
