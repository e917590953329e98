"""Inference settings shared by the benchmark and the notebooks: the torch thread count for a block of code.

`format_table` lives in `helpers.tables`; it is also importable from here for notebooks that still do.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .tables import format_table  # noqa: F401  (re-exported)


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """Run the block with torch.set_num_threads(threads) (None: leave as is); restore the old count after."""
    if isinstance(threads, bool) or not (threads is None or isinstance(threads, int) and threads >= 1):
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(before)
