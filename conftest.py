"""Shared by the unit tests and the notebook run: plots draw off-screen, executed notebooks count as slow, each
notebook's exercise check runs on the reference solution while the learner's stub is in place, no notebook cell
prints a wall of text, and every ✓ line is short."""

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
# The notebooks are stored with the learner's stubs; their kernels inherit this, so each exercise's check cell
# runs the reference solution through the same check (helpers/exercises/__init__.py).
os.environ.setdefault("COURSE_EXERCISES", "reference")

# A cell's text output (printed text and the text of displayed results) stays readable at a glance: a short
# table, a summary line, a plot. Beyond this it is a wall a learner scrolls past, or a saved notebook bloats.
MAX_CELL_TEXT = 3000
# A check cell ends with one line saying what it showed, read at a glance: "✓ ..." of at most this many characters.
MAX_TICK_LINE = 120


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be on the item by then
def pytest_collection_modifyitems(items):
    """Every executed notebook cell (nbval items from .ipynb files) is a slow test."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


def cell_texts(outputs) -> list[str]:
    """The text a cell showed: streams, and the text/plain of results and displays (not images)."""

    def text(value) -> str:  # a string from a kernel message, a list of lines in a stored .ipynb
        return "".join(value) if isinstance(value, list) else str(value)

    texts = []
    for output in outputs or []:
        if output.get("output_type") == "stream":
            texts.append(text(output.get("text", "")))
        elif "data" in output:
            texts.append(text(output["data"].get("text/plain", "")))
    return texts


def cell_text_length(outputs) -> int:
    """Characters of text a cell showed."""
    return sum(len(text) for text in cell_texts(outputs))


def long_tick_lines(outputs) -> list[str]:
    """The "✓ ..." lines a cell printed that are longer than MAX_TICK_LINE."""
    lines = [line.strip() for text in cell_texts(outputs) for line in text.splitlines()]
    return [line for line in lines if line.startswith("✓") and len(line) > MAX_TICK_LINE]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After an nbval cell has run, fail it when its text output is a wall of text."""
    result = yield
    outputs = getattr(item, "test_outputs", None)
    if item.path.suffix == ".ipynb" and outputs is not None:
        length = cell_text_length(outputs)
        if length > MAX_CELL_TEXT:
            raise AssertionError(
                f"{item.name} printed {length} characters of text (limit {MAX_CELL_TEXT}): show a table, a "
                f"summary line or a plot instead. It began: {str(outputs)[:300]}"
            )
        too_long = long_tick_lines(outputs)
        if too_long:
            raise AssertionError(
                f"{item.name} printed a ✓ line of {len(too_long[0])} characters (limit {MAX_TICK_LINE}): say what was "
                f"shown in one short line, and print the evidence above it: {too_long[0]}"
            )
    return result


@pytest.fixture()
def one_thread():
    """Bit-identical runs need the same CPU thread count in every run (the command-line runs use --threads 1)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
