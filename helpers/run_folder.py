"""One run per folder: a training script claims its output folder while it runs, so a second run started into the
same folder (a command pasted twice, two jobs given the same --out) is refused instead of mixing checkpoints.

    with claim_run_folder(out):      # ValueError naming the process that holds it, if one still runs here
        train(...)

The claim is a small file, `.owner`, holding the process id, its start time and the host. A claim whose process is
gone (killed, preempted, restarted by torchrun) is stale and taken over: that is how a resumed run gets its folder
back. The same process may claim again. A claim made on another host cannot be checked from here, and is taken
over with a warning (a shared file system across nodes: start one writer per folder).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

import psutil

OWNER_FILE = ".owner"


def _me() -> dict:
    me = psutil.Process()
    return {"pid": me.pid, "started": me.create_time(), "host": socket.gethostname()}


def _alive(owner: dict) -> bool:
    """Whether the process that wrote `owner` still runs (the same pid and start time: not a reused pid)."""
    try:
        return abs(psutil.Process(int(owner["pid"])).create_time() - float(owner["started"])) < 0.01
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def folder_owner(folder: str | os.PathLike) -> dict | None:
    """Who claims `folder` now: {"pid", "started", "host"} of a process still running on this host, else None."""
    try:
        owner = json.loads((Path(folder) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return None
    return owner if _alive(owner) else None


@contextlib.contextmanager
def claim_run_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold `folder` (created if missing) for this process for the block; refuse it while another live process here
    holds it. The claim is removed at the end of the block, and left behind only by a process that died."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path, got {type(folder).__name__}")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    me, marker = _me(), path / OWNER_FILE
    owner = folder_owner(path)
    if owner is not None and owner["pid"] != me["pid"]:
        raise ValueError(
            f"{path} is the folder of a run still going: process {owner['pid']} on this machine writes there; "
            "give this run another folder, or stop that one first"
        )
    with contextlib.suppress(OSError, ValueError):
        before = json.loads(marker.read_text())
        if isinstance(before, dict) and before.get("host") not in (None, me["host"]):
            warnings.warn(
                f"{path} was claimed by process {before.get('pid')} on {before.get('host')}, which cannot be checked "
                "from here; taking it over",
                stacklevel=3,
            )
    temporary = path / f"{OWNER_FILE}.{me['pid']}"
    temporary.write_text(json.dumps(me))
    os.replace(temporary, marker)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(marker.read_text()).get("pid") == me["pid"]:
                marker.unlink()
