"""Shared by the unit tests and the notebook run: plots draw off-screen, and executed notebooks count as slow."""

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be on the item by then
def pytest_collection_modifyitems(items):
    """Every executed notebook cell (nbval items from .ipynb files) is a slow test."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
