"""Progress bars where a person watches (a notebook or a terminal), and none in a log file or CI output."""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm.auto import tqdm


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where tqdm.auto draws a widget and plots can update in place)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


def someone_watches() -> bool:
    """True in a notebook, or on a terminal outside CI; False when output goes to a file, a pipe or a CI log.

    A bar redrawn with carriage returns is a live display: in a log every redraw is kept, and a few tables
    drown in thousands of them.
    """
    if in_notebook():
        return True
    stream = sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("CI")


def progress_bar(iterable: Any = None, *, enabled: bool = True, **options: Any) -> tqdm:
    """A tqdm.auto bar, shown only when `enabled` and someone watches (`someone_watches`)."""
    return tqdm(iterable, disable=not (enabled and someone_watches()), **options)
