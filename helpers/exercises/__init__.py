"""The write-it-yourself exercises that end each notebook: their checks, and their reference solutions.

A notebook's exercise cell holds a stub that raises NotImplementedError; the learner replaces its body. The
check cell calls the lesson's check on the learner's function, e.g. `check_amp_step(my_amp_step)`: it runs the
function on cases that tell right from wrong, stops at the first wrong answer with a hint for that kind of
mistake, and prints one ✓ line when all pass. A function that still raises NotImplementedError fails with
`ExerciseNotDone`, which says so.

Each lesson's module here holds its check and, out of the notebook's way, its reference solution. With the
environment variable COURSE_EXERCISES=reference (the test suite sets it; `COURSE_EXERCISES=reference papermill
...` does too), a stub is checked by running the reference solution through the very same check instead, so
every headless run of the course proves that each check passes a right answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENVIRONMENT_VARIABLE = "COURSE_EXERCISES"
EXERCISES: dict[str, Exercise] = {}  # every exercise of the course, by the learner's function name


class ExerciseNotDone(AssertionError):
    """The learner's function is still the stub (it raised NotImplementedError)."""


@dataclass(frozen=True)
class Exercise:
    """A check (raises AssertionError with a hint; returns the ✓ line) and the reference solution it must pass."""

    name: str  # the name the notebook's stub has, e.g. 'my_amp_step'
    check: Callable[[Callable[..., Any]], str]
    reference: Callable[..., Any]

    def __call__(self, mine: Callable[..., Any]) -> None:
        """Check the learner's function and print the ✓ line; raise AssertionError (with a hint) if it is wrong."""
        if not callable(mine):
            raise TypeError(f"{self.name} must be a function (or class), got {type(mine).__name__}")
        try:
            line = self.check(mine)
        except NotImplementedError:
            if os.environ.get(ENVIRONMENT_VARIABLE) != "reference":
                raise ExerciseNotDone(
                    f"{self.name} is still the stub (it raises NotImplementedError): replace its body with your "
                    "code in the cell above, run that cell, then run this one again"
                ) from None
            print(
                f"{self.name} is still the stub; {ENVIRONMENT_VARIABLE}=reference: the reference solution was checked"
            )
            line = self.check(self.reference)
        print(line)


def exercise(name: str, *, reference: Callable[..., Any]) -> Callable[[Callable[[Callable[..., Any]], str]], Exercise]:
    """Decorate a check function: it becomes the Exercise that notebooks call with the learner's function."""

    def register(check: Callable[[Callable[..., Any]], str]) -> Exercise:
        EXERCISES[name] = Exercise(name, check, reference)
        return EXERCISES[name]

    return register


def all_exercises() -> dict[str, Exercise]:
    """Every lesson's exercise (importing each lesson's module registers it)."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return dict(EXERCISES)
