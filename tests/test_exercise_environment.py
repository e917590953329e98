"""The reproducible() exercise gives each kind of mistake its own hint, and leaves the settings as it found them."""

import contextlib

import pytest
import torch

from helpers.exercises.environment import check_reproducible


def _settings():
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )


def _restore(before):
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.benchmark = before[2]


@contextlib.contextmanager
def never_restores():  # switches both, and leaves them so
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    yield


@contextlib.contextmanager
def restores_the_defaults():  # puts back the defaults, not what was there
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def without_finally():  # right when the block ends normally; an exception skips the restore
    before = _settings()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    yield
    _restore(before)


@contextlib.contextmanager
def swallows_the_exception():  # restores, but the caller never hears of the error
    before = _settings()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    except Exception:
        pass
    finally:
        _restore(before)


@contextlib.contextmanager
def cudnn_deterministic_only():  # the post's switch: cuDNN alone, torch's other ops unchecked
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


@contextlib.contextmanager
def benchmark_left_on():  # determinism on, but benchmark still picks algorithms by timing
    before = _settings()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        _restore(before)


@contextlib.contextmanager
def only_warns():  # a nondeterministic op would still run, with a warning
    before = _settings()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        _restore(before)


@contextlib.contextmanager
def forgets_warn_only():  # restores the mode but not warn_only, which use_deterministic_algorithms(mode) resets
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


@contextlib.contextmanager
def cudnn_deterministic_left_set():  # right about the two settings, and sets a third it never puts back
    before = _settings()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    try:
        yield
    finally:
        _restore(before)


def not_a_context_manager():  # switches the settings when called; nothing to enter or leave
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


_SAVED_ONCE = (False, False, False)  # read when the module was written, not when the block starts


@contextlib.contextmanager
def saved_when_defined():
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        _restore(_SAVED_ONCE)


class Reproducible:  # the class form: __enter__ saves and switches, __exit__ restores and lets errors through
    def __enter__(self):
        self.before = _settings()
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        return self

    def __exit__(self, *exc):
        _restore(self.before)
        return False


@contextlib.contextmanager
def with_exit_stack():  # contextlib.ExitStack's callbacks run on any exit
    with contextlib.ExitStack() as stack:
        mode, warn_only = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        stack.callback(torch.use_deterministic_algorithms, mode, warn_only=warn_only)
        stack.callback(setattr, torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        yield


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (never_restores, "deterministic was True, not False as before the block"),
    (restores_the_defaults, "benchmark was False, not True as before the block: save torch.backends.cudnn.benchmark"),
    (without_finally, "after the block raised.*in a finally around the yield"),
    (swallows_the_exception, "never reached the caller"),
    (cudnn_deterministic_only, r"torch.use_deterministic_algorithms\(True\) \(cudnn.deterministic covers"),
    (benchmark_left_on, "it was still True inside the block"),
    (not_a_context_manager, "returned NoneType, not a context manager"),
    (saved_when_defined, "benchmark was False, not True as before the block"),
    (only_warns, r"only warned \(warn_only=True\)"),
    (forgets_warn_only, "warn_only was False, not True as before the block: save torch.is_deterministic"),
    (cudnn_deterministic_left_set, "cudnn_deterministic was True, not False as before the block"),
]
RIGHT = [Reproducible, with_exit_stack]


@pytest.mark.parametrize("wrong, hint", WRONG, ids=lambda v: getattr(v, "__name__", "hint"))
def test_each_mistake_gets_its_hint_and_the_settings_come_back(wrong, hint):
    before = _settings()
    with pytest.raises(AssertionError, match=hint):
        check_reproducible.check(wrong)
    assert _settings() == before, "a wrong answer must not leave its settings in the learner's kernel"


@pytest.mark.parametrize("right", RIGHT, ids=lambda v: v.__name__)
def test_other_right_answers_pass(right):
    before = _settings()
    assert check_reproducible.check(right).startswith("✓ ")
    assert _settings() == before


def test_the_check_restores_a_non_default_start():
    torch.backends.cudnn.benchmark = True
    try:
        check_reproducible.check(check_reproducible.reference)
        assert _settings() == (False, False, True, False)
    finally:
        torch.backends.cudnn.benchmark = False
