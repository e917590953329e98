"""Your environment (the appendix): write `reproducible()`, a block with deterministic algorithms on and
cudnn.benchmark off that puts both settings back as they were, exception or not."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import exercise

Settings = tuple[bool, bool]  # (deterministic algorithms on, cudnn.benchmark on)


@contextlib.contextmanager
def reference_reproducible() -> Iterator[None]:
    """Deterministic algorithms on and cudnn.benchmark off inside; both as they were after, exception or not."""
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


def _settings() -> Settings:
    return torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark


def _set(settings: Settings) -> None:
    torch.use_deterministic_algorithms(settings[0])
    torch.backends.cudnn.benchmark = settings[1]


class _Raised(Exception):
    """The exception the check raises inside the learner's block."""


def _open(reproducible: Callable[[], Any]) -> Any:
    """reproducible(), refused with a hint when it is not a context manager."""
    block = reproducible()
    if not (hasattr(block, "__enter__") and hasattr(block, "__exit__")):
        raise AssertionError(
            f"hint: reproducible() returned {type(block).__name__}, not a context manager: put @contextmanager "
            "above a generator function that yields once (or write a class with __enter__ and __exit__)"
        )
    return block


def _inside(start: Settings) -> None:
    """Inside the block, whatever the settings were before it."""
    deterministic, benchmark = _settings()
    assert deterministic, (
        f"hint: starting from deterministic={start[0]}, inside the block torch.are_deterministic_algorithms_enabled() "
        "was False: call torch.use_deterministic_algorithms(True) (cudnn.deterministic covers cuDNN only)"
    )
    assert not benchmark, (
        f"hint: starting from cudnn.benchmark={start[1]}, it was still True inside the block: set "
        "torch.backends.cudnn.benchmark = False (benchmark picks algorithms by timing, run by run)"
    )


def _after(start: Settings, how: str) -> None:
    assert _settings() == start, (
        f"hint: {how}, the settings were (deterministic, benchmark) = {_settings()}, not {start} as before the "
        "block: save both before switching them and put those values back (not the defaults)"
        + (" in a finally around the yield, so an exception restores them too" if "raised" in how else "")
    )


def _check(reproducible: Callable[[], Any]) -> None:
    for start in ((False, True), (True, False), (False, False)):
        _set(start)
        with _open(reproducible):
            _inside(start)
        _after(start, f"after a block entered with {start}")
    start = (False, True)
    _set(start)
    try:
        with _open(reproducible):
            raise _Raised
    except _Raised:
        pass
    else:
        raise AssertionError(
            "hint: an exception raised inside the block never reached the caller: do not catch it (a finally "
            "restores the settings and lets it through; an __exit__ must return False)"
        )
    _after(start, "after the block raised")
    with _open(reproducible):
        with _open(reproducible):
            _inside(start)
        _inside(start)
    _after(start, "after two nested blocks")


@exercise("reproducible", reference=reference_reproducible)
def check_reproducible(reproducible: Callable[[], Any]) -> str:
    """Entered from three different settings, left normally and by an exception, and nested: inside, determinism
    on and benchmark off; after, the settings from before the block. The settings are put back in the end."""
    saved = _settings()
    try:
        _check(reproducible)
    finally:
        _set(saved)
    return "✓ reproducible() turned determinism on and benchmark off, then put back what was there, exception or not"
