"""Finding a hang: where each rank of a group is stuck, from its stack, and which rank is not where the others are.

A group hangs when its ranks do not call the same collectives in the same order: the classic is a collective under
a condition true on some ranks only. The ranks that did call it wait (until the group's timeout); the ones that
skipped it are somewhere else. helpers.processes.launch uses this module: each rank registers a stack dump on
SIGUSR1 (`faulthandler`); when the run times out, the launcher asks every rank still running for its stack and
reports where each one is:

    HangError: ranks [0] of 2 did not finish within timeout_s=10 s; all ranks were stopped.
      rank 0: waiting in dist.all_reduce, called at lesson_hang.py:9 in worker
      rank 1: its worker returned; waiting for the others at the end of the run
    rank 1 never reached the dist.all_reduce at lesson_hang.py:9 that rank 0 waits in: ...

On Windows there is no SIGUSR1: the report then gives the places it has (the ranks' own errors) and says so.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

CAN_DUMP = hasattr(signal, "SIGUSR1")  # POSIX: Linux, macOS
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
_C10D = os.path.join("torch", "distributed")


def register_stack_dump(path: str | os.PathLike) -> IO[str] | None:
    """In a rank: on SIGUSR1, write every thread's Python stack to `path` (kept open; returned). None on Windows."""
    if not CAN_DUMP:
        return None
    handle = open(path, "w")  # noqa: SIM115 - open for the life of the process: faulthandler writes to its fd
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)
    return handle


def request_stacks(pids: Mapping[int, int], folder: str | os.PathLike, wait_s: float = 1.0) -> dict[int, str]:
    """Ask each rank (rank -> pid) to dump its stack into `folder`/rank<r>.txt; the stacks that came, by rank."""
    if not CAN_DUMP:
        return {}
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    deadline, stacks = time.monotonic() + wait_s, dict[int, str]()
    while time.monotonic() < deadline and len(stacks) < len(pids):
        time.sleep(0.05)
        for rank in pids:
            text = _read(Path(folder) / f"rank{rank}.txt")
            if "most recent call first" in text:
                stacks[rank] = text
    return stacks


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def main_thread_frames(stack: str) -> list[tuple[str, int, str]]:
    """The frames (file, line, function) of the thread that runs Python code of its own, innermost first.

    faulthandler lists each thread ("Thread 0x..." or "Current thread 0x...") innermost frame first; threads that
    torch or the queue start run only library code, so the thread with a frame outside `threading` is the main one.
    """
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack)
    parsed = [
        [(match["file"], int(match["line"]), match["function"]) for match in _FRAME.finditer(block)] for block in blocks
    ]
    for frames in parsed:
        if any(function == "_run_rank" for _, _, function in frames):
            return frames
    return max(parsed, key=len, default=[])


@dataclass(frozen=True)
class Place:
    """Where a rank is: the collective it waits in (None when it is not in one), the call site `at` ("file.py:9 in
    worker": the collective's caller outside torch, else the innermost frame; None when neither is known), and
    `words`, the place as the report says it."""

    collective: str | None
    at: str | None

    @property
    def words(self) -> str:
        if self.collective is not None:
            return f"waiting in dist.{self.collective}" + (f", called at {self.at}" if self.at else "")
        return f"at {self.at}" if self.at else "its stack could not be read"


def _site(frame: tuple[str, int, str]) -> str:
    file, line, function = frame
    return f"{os.path.basename(file)}:{line} in {function}"


def place(frames: list[tuple[str, int, str]]) -> Place:
    """Where a rank with these frames (innermost first) is."""
    collective_at = [i for i, (file, _, _) in enumerate(frames) if file.endswith("distributed_c10d.py")]
    if collective_at:
        outermost = collective_at[-1]
        caller = next((frame for frame in frames[outermost + 1 :] if _C10D not in frame[0]), None)
        return Place(frames[outermost][2], _site(caller) if caller else None)
    return Place(None, _site(frames[0]) if frames else None)


def hang_report(
    waiting: list[int], finished: list[int], stacks: Mapping[int, str], world_size: int
) -> tuple[str, dict[int, str]]:
    """Lines saying where each rank is, and which rank(s) are not where the waiting ones wait; also by rank."""
    places: dict[int, str] = {}
    waits: dict[int, Place] = {}  # rank -> the collective it waits in, with its call site
    for rank in range(world_size):
        frames = main_thread_frames(stacks[rank]) if rank in stacks else []
        where = place(frames)
        if rank in finished and (where.collective is None or any(fn == "finish_run" for _, _, fn in frames)):
            places[rank] = "its worker returned; waiting for the others at the end of the run"
            continue
        if rank not in stacks:
            places[rank] = "no stack (stacks need SIGUSR1: Linux or macOS)" if not CAN_DUMP else where.words
            continue
        places[rank] = where.words
        if where.collective is not None:
            waits[rank] = where
    lines = [f"  rank {rank}: {places[rank]}" for rank in range(world_size)]
    if waits:
        common = max(set(waits.values()), key=list(waits.values()).count)  # where most waiting ranks wait
        there = sorted(rank for rank, where in waits.items() if where == common)
        elsewhere = [rank for rank in range(world_size) if rank not in there]
        if elsewhere:
            site = f" at {common.at}" if common.at else ""
            lines.append(
                f"rank(s) {elsewhere} never reached the dist.{common.collective}{site} that rank(s) {there} wait in: "
                "every rank must call the same collectives in the same order, so look for a condition that is true "
                "on some ranks only (TORCH_DISTRIBUTED_DEBUG=DETAIL makes the ranks compare each collective first)"
            )
    return "\n".join(lines), places
