"""Every notebook's exercise: its check fails on the stub, passes the reference, and (per lesson, in
tests/test_exercise_*.py) gives each kind of mistake its own hint."""

import pytest

from helpers.exercises import ENVIRONMENT_VARIABLE, ExerciseNotDone, all_exercises

EXERCISES = all_exercises()
# Checks that train models for tens of seconds (my_rung trains two runs of several epochs, TrainingCheckpoint
# trains and resumes one): their full runs count as slow tests; `make test` runs them, `make test-fast` not.
HEAVY = {"my_rung", "TrainingCheckpoint"}
NAMES = [pytest.param(name, marks=pytest.mark.slow) if name in HEAVY else name for name in sorted(EXERCISES)]


def stub(*args, **kwargs):
    raise NotImplementedError("write it here")


@pytest.mark.parametrize("name", NAMES)
def test_the_stub_fails_and_says_so(name, monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    with pytest.raises(ExerciseNotDone, match=f"{name} is still the stub"):
        EXERCISES[name](stub)
    assert issubclass(ExerciseNotDone, AssertionError)  # a failed check, as any other


@pytest.mark.parametrize("name", NAMES)
def test_the_reference_passes_with_one_short_tick_line(name, capsys, monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    EXERCISES[name](EXERCISES[name].reference)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("✓ ") and len(line) <= 120


@pytest.mark.parametrize("name", NAMES)
def test_headless_runs_check_the_reference_through_the_same_check(name, capsys, monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "reference")
    EXERCISES[name](stub)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{name} is still the stub; {ENVIRONMENT_VARIABLE}=reference: the reference solution was checked"
    assert out[1].startswith("✓ ")


def test_a_check_refuses_what_is_not_a_function():
    name = sorted(EXERCISES)[0]
    with pytest.raises(TypeError, match=f"{name} must be a function"):
        EXERCISES[name](None)


def test_every_notebook_has_an_exercise_whose_stub_it_calls_by_name():
    """Each notebook defines the learner's stub and passes it to its lesson's check."""
    import json
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parents[1].joinpath("notebooks").glob("*.ipynb")):
        code = "\n".join(
            "".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"
        )
        names = [name for name in EXERCISES if f"({name})" in code]
        assert names, f"{path.name} calls no exercise check on the learner's function"
        for name in names:
            defined = f"def {name}(" in code or f"class {name}(" in code or f"class {name}:" in code
            assert "raise NotImplementedError" in code and defined, (
                f"{path.name}: the stub {name} must be defined in the notebook and raise NotImplementedError"
            )


def _test_module(lesson: str):
    """tests/test_exercise_<lesson>.py, imported from its file (under its own name, whatever pytest's import mode)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name(f"test_exercise_{lesson}.py")
    assert path.exists(), f"no {path.name}: every exercise needs its test module"
    spec = importlib.util.spec_from_file_location(f"_counted_test_exercise_{lesson}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_check_is_tested_on_five_wrong_answers_and_another_right_one(name):
    """The convention: the check of exercise `name` lives in helpers/exercises/<lesson>.py, and its test module
    tests/test_exercise_<lesson>.py holds, at module level,

    - WRONG, a list of (wrong answer, hint pattern) pairs: at least five different functions (or classes), each a
      mistake learners make, fed to a test parametrized over WRONG itself that asserts the check refuses it with
      that hint;
    - RIGHT, a list of right answers other than the reference (which the tests above check), fed to a test
      parametrized over RIGHT that asserts the check passes them.

    This test imports each such module and counts; it does not run the checks.
    """
    exercise = EXERCISES[name]
    lesson = exercise.check.__module__.rsplit(".", 1)[-1]
    module = _test_module(lesson)
    wrong, right = getattr(module, "WRONG", []), getattr(module, "RIGHT", [])
    where = f"tests/test_exercise_{lesson}.py"
    assert all(callable(answer) and isinstance(hint, str) and hint for answer, hint in wrong), (
        f"{where}: WRONG must hold (wrong answer, hint pattern) pairs"
    )
    answers = {answer for answer, _ in wrong}
    assert len(answers) >= 5, f"{where}: WRONG holds {len(answers)} different wrong answers for {name}, fewer than 5"
    assert [answer for answer in right if answer is not exercise.reference], (
        f"{where}: RIGHT holds no right answer besides the reference"
    )
    for listed, title, argnames in ((wrong, "WRONG", "wrong, hint"), (right, "RIGHT", "right")):
        parametrized = [
            mark.args[1]
            for test in vars(module).values()
            for mark in getattr(test, "pytestmark", [])
            if mark.name == "parametrize" and mark.args[0] == argnames
        ]
        assert any(all(entry in values for entry in listed) for values in parametrized), (
            f"{where}: no test is parametrized over {argnames!r} with every entry of {title}"
        )
