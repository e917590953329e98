"""Every notebook's exercise: its check fails on the stub, passes the reference, and (per lesson, in
tests/test_exercise_*.py) gives each kind of mistake its own hint."""

import pytest

from helpers.exercises import ENVIRONMENT_VARIABLE, ExerciseNotDone, all_exercises

EXERCISES = all_exercises()


def stub(*args, **kwargs):
    raise NotImplementedError("write it here")


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_stub_fails_and_says_so(name, monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    with pytest.raises(ExerciseNotDone, match=f"{name} is still the stub"):
        EXERCISES[name](stub)
    assert issubclass(ExerciseNotDone, AssertionError)  # a failed check, as any other


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_reference_passes_with_one_short_tick_line(name, capsys, monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    EXERCISES[name](EXERCISES[name].reference)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("✓ ") and len(line) <= 120


@pytest.mark.parametrize("name", sorted(EXERCISES))
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
