"""When a step does not fit (notebook 14): write `fit_in_micro_batches(step, batch_size)`, which retries an
out-of-memory step with twice the micro-batches each time, outside the `except` block, until it fits."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from . import exercise


def reference_fit_in_micro_batches(step: Callable[[int], Any], batch_size: int) -> int:
    """Run step(k) for k = 1, 2, 4, ... micro-batches until it fits; return k. Only an out-of-memory error is
    retried, outside the except block; when micro-batches of one sample do not fit either, that error is raised."""
    micro_batches = 1
    while True:
        try:
            step(micro_batches)
            return micro_batches
        except torch.OutOfMemoryError:
            if 2 * micro_batches > batch_size:
                raise
        micro_batches *= 2  # outside the except block: the failed try's traceback (and its tensors) is gone


class _Bug(ValueError):
    """An error of the step itself, not a lack of memory: it must reach the caller."""


class _Hint(BaseException):
    """A mistake seen inside the step: a BaseException, so that an `except Exception` cannot swallow it."""


class _CappedStep:
    """A stand-in for a training step under a memory cap: step(k) runs the batch in k micro-batches and runs out
    of memory when one micro-batch holds more than `fits` samples. It notes every call."""

    def __init__(self, batch_size: int, fits: int, error: type[Exception] | None = None) -> None:
        self.batch_size, self.fits, self.error = batch_size, fits, error
        self.calls: list[int] = []
        self.outer = sys.exc_info()[1]  # an error being handled around the whole check (not the learner's)
        self.done = 0  # steps that ran to the end

    def __call__(self, micro_batches: int) -> None:
        if not isinstance(micro_batches, int) or isinstance(micro_batches, bool):
            raise _Hint(f"hint: step(k) takes the number of micro-batches, an int, got {micro_batches!r}")
        if sys.exc_info()[1] not in (None, self.outer):
            raise _Hint(
                f"hint: step({micro_batches}) was called inside an except block: the error's traceback still holds "
                "the failed try's tensors, so the retry runs with that memory taken; leave the except block first"
            )
        if self.error is not None and self.calls:
            raise _Hint(
                f"hint: the step raised a {self.error.__name__} that is no lack of memory, and your function tried "
                f"again with {micro_batches} micro-batches: catch only torch.OutOfMemoryError, so a bug reaches you"
            )
        self.calls.append(micro_batches)
        if micro_batches > self.batch_size or len(self.calls) > 2 * self.batch_size:
            raise _Hint(
                f"hint: step({micro_batches}) on a batch of {self.batch_size} (calls: {self.calls[:8]}...): a "
                "micro-batch needs at least one sample; when one-sample micro-batches do not fit, raise the "
                "out-of-memory error"
            )
        if self.error is not None:
            raise self.error(f"a bug in the step at {micro_batches} micro-batch(es), not a lack of memory")
        if -(-self.batch_size // micro_batches) > self.fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory (test): {micro_batches} micro-batch(es) do not fit")
        self.done += 1


def _run(fit: Callable[[_CappedStep, int], Any], step: _CappedStep) -> Any:
    """fit(step, batch_size), with a mistake the step saw raised as an AssertionError with its hint."""
    try:
        return fit(step, step.batch_size)
    except _Hint as hint:
        raise AssertionError(str(hint)) from None


def _check_fits(fit: Callable[[_CappedStep, int], Any], batch_size: int, fits: int, expected: int) -> None:
    step = _CappedStep(batch_size, fits)
    try:
        got = _run(fit, step)
    except torch.OutOfMemoryError:
        last = step.calls[-1] if step.calls else None
        if last is not None and len(step.calls) > 1 and 2 * last <= batch_size:
            raise AssertionError(
                f"hint: a batch of {batch_size} fits in {expected} micro-batches, but your function gave up after "
                f"step({last}) (calls: {step.calls}) though {2 * last} micro-batches of {batch_size // (2 * last)} "
                "sample(s) were never tried: give up only when twice the micro-batches would exceed batch_size"
            ) from None
        raise AssertionError(
            f"hint: a batch of {batch_size} fits in {expected} micro-batches, but the out-of-memory error of "
            f"step({last if last is not None else '?'}) left your function: catch torch.OutOfMemoryError and try "
            "twice the micro-batches"
        ) from None
    assert step.done == 1, (
        f"hint: the step ran to the end {step.done} times (calls: {step.calls}): an optimizer step must run once"
    )
    assert got == expected, (
        f"hint: the batch of {batch_size} first fitted in {expected} micro-batches (calls: {step.calls}), but your "
        f"function returned {got!r}: start with 1 (the whole batch), double on each error, return the count that ran"
    )
    tried = [2**i for i in range(expected.bit_length())]
    assert step.calls == tried, f"hint: try 1, 2, 4, ... micro-batches in turn ({tried}), your calls were {step.calls}"


@exercise("fit_in_micro_batches", reference=reference_fit_in_micro_batches)
def check_fit_in_micro_batches(fit: Callable[[_CappedStep, int], Any]) -> str:
    """Through a stand-in capped step: the whole batch fitting, fitting only in 4 or in 8 micro-batches (the last of one
    sample each), a step with a bug of its own (a ValueError, then a RuntimeError that is not out of memory), and nothing fitting at all."""
    for batch_size, fits, expected in ((64, 64, 1), (64, 16, 4), (48, 6, 8), (1, 1, 1), (8, 1, 8)):
        _check_fits(fit, batch_size, fits, expected)
    for error in (_Bug, RuntimeError):
        step = _CappedStep(64, 16, error)
        try:
            _run(fit, step)
        except error:
            pass
        else:
            raise AssertionError(
                f"hint: the step raised a {error.__name__} that is no lack of memory, and your function swallowed it: "
                "catch only torch.OutOfMemoryError (a RuntimeError), so a bug in the step reaches you"
            )
    step = _CappedStep(8, 0)
    try:
        got = _run(fit, step)
    except torch.OutOfMemoryError:
        assert step.calls and step.calls[-1] == 8, (
            f"hint: nothing fitted a batch of 8 and your function raised after the calls {step.calls}, never trying "
            "8 micro-batches of one sample each: give up only when twice the micro-batches would exceed batch_size"
        )
    else:
        raise AssertionError(
            f"hint: not even one sample fitted (calls: {step.calls}), yet your function returned {got!r}: raise the "
            "out-of-memory error once a micro-batch would hold less than one sample, so the caller knows"
        )
    return "✓ fit_in_micro_batches doubled the micro-batches after each OOM, outside except; other errors went through"
