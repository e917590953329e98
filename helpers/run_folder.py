"""One run per folder: a training script claims its output folder while it runs, so a second run started into the
same folder (a command pasted twice, two jobs given the same --out) is refused instead of mixing checkpoints.

    with claim_run_folder(out):      # ValueError naming the process that holds it, if one still runs here
        train(...)

The claim is an operating-system lock on `.lock` in the folder (the `filelock` package: flock on Linux and macOS,
msvcrt on Windows), held while the run lasts. Two runs started at the same instant cannot both get it, and a run
that dies (killed, preempted, restarted by torchrun) releases it with its process: that is how a resumed run gets
its folder back. Beside it, `.owner` says who holds it (process id, start time, host) for the refusal's message.
The same process may claim again. A claim made on another host cannot be checked from here (locks over a network
file system are not to be relied on): it is taken over with a warning, so start one writer per folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

import filelock
import psutil

OWNER_FILE = ".owner"
LOCK_FILE = ".lock"
_HELD: dict[Path, int] = {}  # folders this process holds -> how many claims are open


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
    """Hold `folder` (created if missing) for this process for the block; refuse it while another live process
    holds it. The claim is removed at the end of the block; a process that dies leaves only a stale `.owner`."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path, got {type(folder).__name__}")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    key = path.resolve()
    if key in _HELD:  # this process holds it already
        _HELD[key] += 1
        try:
            yield path
        finally:
            _HELD[key] -= 1
        return
    lock = filelock.FileLock(path / LOCK_FILE, timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        owner = folder_owner(path)
        who = f"process {owner['pid']} on this machine" if owner else "another process"
        raise ValueError(
            f"{path} is the folder of a run still going: {who} writes there; give this run another folder, or "
            "stop that one first"
        ) from None
    _HELD[key] = 1
    me, marker = _me(), path / OWNER_FILE
    try:
        with contextlib.suppress(OSError, ValueError):
            before = json.loads(marker.read_text())
            if isinstance(before, dict) and before.get("host") not in (None, me["host"]):
                warnings.warn(
                    f"{path} was claimed by process {before.get('pid')} on {before.get('host')}, which cannot be "
                    "checked from here; taking it over",
                    stacklevel=3,
                )
        temporary = path / f"{OWNER_FILE}.{me['pid']}"
        temporary.write_text(json.dumps(me))
        os.replace(temporary, marker)
        yield path
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError, ValueError):
            if json.loads(marker.read_text()).get("pid") == me["pid"]:
                marker.unlink()
        lock.release()
