"""Your environment (the appendix): write `reproducible()`, a block with deterministic algorithms on (erroring, not
only warning) and cudnn.benchmark off that puts every setting it touched back as it was, exception or not."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from . import exercise


class Settings(NamedTuple):
    deterministic: bool  # torch.are_deterministic_algorithms_enabled()
    warn_only: bool  # torch.is_deterministic_algorithms_warn_only_enabled(): a nondeterministic op only warns
    benchmark: bool  # torch.backends.cudnn.benchmark
    cudnn_deterministic: bool  # torch.backends.cudnn.deterministic


# What each setting is called where a learner reads and writes it, and how to put it back.
_HOW = {
    "deterministic": "torch.are_deterministic_algorithms_enabled()",
    "warn_only": "torch.is_deterministic_algorithms_warn_only_enabled() (use_deterministic_algorithms(mode, "
    "warn_only=...) sets both; leaving warn_only out sets it to False)",
    "benchmark": "torch.backends.cudnn.benchmark",
    "cudnn_deterministic": "torch.backends.cudnn.deterministic (use_deterministic_algorithms already covers cuDNN; "
    "if you set it, put it back)",
}


@contextlib.contextmanager
def reference_reproducible() -> Iterator[None]:
    """Deterministic algorithms on (errors, not warnings) and cudnn.benchmark off inside; as they were after,
    warn_only included, exception or not."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = benchmark


def _settings() -> Settings:
    return Settings(
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )


def _set(settings: Settings) -> None:
    torch.use_deterministic_algorithms(settings.deterministic, warn_only=settings.warn_only)
    torch.backends.cudnn.benchmark = settings.benchmark
    torch.backends.cudnn.deterministic = settings.cudnn_deterministic


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
    now = _settings()
    assert now.deterministic, (
        f"hint: starting from deterministic={start.deterministic}, inside the block "
        "torch.are_deterministic_algorithms_enabled() was False: call torch.use_deterministic_algorithms(True) "
        "(cudnn.deterministic covers cuDNN only)"
    )
    assert not now.warn_only, (
        "hint: inside the block deterministic algorithms only warned (warn_only=True): a nondeterministic op would "
        "still run, with a warning a long run scrolls past; call torch.use_deterministic_algorithms(True) without "
        "warn_only, so such an op raises"
    )
    assert not now.benchmark, (
        f"hint: starting from cudnn.benchmark={start.benchmark}, it was still True inside the block: set "
        "torch.backends.cudnn.benchmark = False (benchmark picks algorithms by timing, run by run)"
    )


def _after(start: Settings, how: str) -> None:
    now = _settings()
    changed = [name for name in Settings._fields if getattr(now, name) != getattr(start, name)]
    if changed:
        name = changed[0]
        raise AssertionError(
            f"hint: {how}, {name} was {getattr(now, name)}, not {getattr(start, name)} as before the block: save "
            f"{_HOW[name]} before switching it and put that value back (not the default)"
            + (" in a finally around the yield, so an exception restores it too" if "raised" in how else "")
        )


# The settings each pass through the block starts from: (deterministic, warn_only, benchmark, cudnn.deterministic)
STARTS = [Settings(False, False, True, False), Settings(True, True, False, True), Settings(False, False, False, False)]


def _check(reproducible: Callable[[], Any]) -> None:
    for start in STARTS:
        _set(start)
        with _open(reproducible):
            _inside(start)
        _after(start, f"after a block entered with {tuple(start)}")
    start = STARTS[1]
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
    on (not warn-only) and benchmark off; after, all four settings as before the block (warn_only and
    cudnn.deterministic included). The settings are put back in the end."""
    saved = _settings()
    try:
        _check(reproducible)
    finally:
        _set(saved)
    return "✓ reproducible() turned determinism on and benchmark off, then put back what was there, exception or not"
