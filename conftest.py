"""Shared by the unit tests and the notebook run: plots draw off-screen, executed notebooks count as slow, and
no notebook cell prints a wall of text."""

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

# A cell's text output (printed text and the text of displayed results) stays readable at a glance: a short
# table, a summary line, a plot. Beyond this it is a wall a learner scrolls past, or a saved notebook bloats.
MAX_CELL_TEXT = 3000


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be on the item by then
def pytest_collection_modifyitems(items):
    """Every executed notebook cell (nbval items from .ipynb files) is a slow test."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


def cell_text_length(outputs) -> int:
    """Characters of text a cell showed: streams, and the text/plain of results and displays (not images)."""

    def text(value) -> str:  # a string from a kernel message, a list of lines in a stored .ipynb
        return "".join(value) if isinstance(value, list) else str(value)

    total = 0
    for output in outputs or []:
        if output.get("output_type") == "stream":
            total += len(text(output.get("text", "")))
        elif "data" in output:
            total += len(text(output["data"].get("text/plain", "")))
    return total


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
    return result
