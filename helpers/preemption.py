"""Stopping a run on request: SIGTERM (what cloud schedulers and SLURM send before they take a machine back) asks
the training loop to finish the step it is in, write a checkpoint and leave with PREEMPTED_EXIT_CODE; the same
command started again resumes from that checkpoint.

    stop = StopRequest()
    with stop.installed():
        for step in ...:
            train_step(...)
            if stop.agreed():  # every rank stops after the same step
                save(...)
                break
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

import torch
import torch.distributed as dist

# os.EX_TEMPFAIL, "a temporary failure: try again": the run stopped because it was asked to, and resumes when
# started again (a scheduler that requeues on this code restarts it). 75 on every system; os has it on POSIX only.
PREEMPTED_EXIT_CODE = 75


class StopRequest:
    """A flag that a signal sets and the training loop reads between steps."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the signal that asked to stop, once one did

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: remember the request; the loop acts on it after its step."""
        self.signal = signum

    @property
    def requested(self) -> bool:
        """Whether this process was asked to stop."""
        return self.signal is not None

    @contextlib.contextmanager
    def installed(self, signals: Sequence[int] = (signal.SIGTERM,)) -> Iterator[StopRequest]:
        """Handle `signals` with this request for the block (the main thread only, as Python requires); the
        handlers before it are put back after."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("a StopRequest can be installed from the main thread only (Python's signal rule)")
        before = {signum: signal.signal(signum, self) for signum in signals}
        try:
            yield self
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)

    def agreed(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank was asked to stop (every rank calls it after the same step, so all stop together);
        in a world of one, whether this process was. `device`: where this rank's collectives run."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def exit_code_name(code: int) -> str:
    """What a training process's exit code says, in words, for a launcher's log."""
    if code == 0:
        return "finished"
    if code == PREEMPTED_EXIT_CODE:
        return "stopped on request after a checkpoint: start it again to resume"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"failed (exit code {code})"
