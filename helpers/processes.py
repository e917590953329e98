"""Starting ranks on one machine, from a notebook or a test: `launch` (spawned processes).

    from helpers.processes import import_fresh, launch
    lesson = import_fresh("lesson_ddp")                          # a module a notebook cell just (re)wrote
    results = launch(lesson.worker, nprocs=2, args=(seed,))      # worker(rank, world_size, seed)

`launch` starts one process per rank with the spawn start method, gives them a free port and a process
group with a timeout (helpers.distributed.setup_process_group), and returns what each rank's worker
returned. If a rank raises, the caller gets a `RankError` with that rank's number and traceback, and
every other rank is stopped. The ranks import the worker by name, so it must live in a module; when the
worker is the lesson, a notebook cell writes that module (`%%writefile lesson_ddp.py`) and `import_fresh`
imports it as it reads now, so an edited and rerun cell changes what the ranks compute. For scripts, `torchrun` does
the same job (helpers/torchrun.py starts it from a notebook or a test).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pickle
import queue as queue_module
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers.checks import check_choice, check_int
from helpers.distributed import (
    _check_backend,
    _check_timeout,
    default_backend,
    find_free_port,
    finish_run,
    setup_process_group,
)
from helpers.hangs import hang_report, register_stack_dump, request_stacks

INIT_METHODS = ("env", "tcp", "file")


class HangError(TimeoutError):
    """A launched run did not finish in time; carries where each rank was (`places`) and its stack (`stacks`)."""

    def __init__(
        self, waiting: list[int], world_size: int, timeout_s: float, report: str, stacks: dict, places: dict
    ) -> None:
        self.waiting, self.world_size, self.stacks, self.places = waiting, world_size, stacks, places
        super().__init__(
            f"ranks {waiting} of {world_size} did not finish within timeout_s={timeout_s} s; all ranks were "
            f"stopped. Where each rank was:\n{report}"
        )


class RankError(RuntimeError):
    """One rank of a launched run raised; carries the rank number and its traceback text."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        error_type: str,
        message: str,
        traceback_text: str,
        also_failed: Sequence[int] = (),
    ) -> None:
        self.rank, self.world_size, self.error_type = rank, world_size, error_type
        self.error_message, self.traceback_text, self.also_failed = message, traceback_text, list(also_failed)
        others = (
            f" (ranks {self.also_failed} failed after it, most likely because rank {rank} was gone)"
            if self.also_failed
            else ""
        )
        super().__init__(
            f"rank {rank} of {world_size} raised {error_type}: {message}{others}; "
            f"all ranks were stopped.\n\n--- traceback from rank {rank} ---\n{traceback_text}"
        )


def _plain(value: Any) -> Any:
    """Copy tensors out to the CPU (detached), through lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_plain(item) for item in value)
    return value


def _run_rank(
    rank: int,
    world_size: int,
    worker: Callable[..., Any],
    args: tuple,
    backend: str,
    init_method: str,
    timeout_s: float,
    threads: int,
    env: dict,
    results: Any,
    stacks_dir: str,
) -> None:
    """What each spawned process runs: join the group, call the worker, report its result or error."""
    try:
        os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))  # what torchrun gives each rank
        register_stack_dump(os.path.join(stacks_dir, f"rank{rank}.txt"))  # the launcher asks for it on a hang
        dist.set_debug_level_from_env()  # torch read TORCH_DISTRIBUTED_DEBUG on import, before `env` was set
        torch.set_num_threads(threads)
        setup_process_group(rank, world_size, backend=backend, init_method=init_method, timeout_s=timeout_s)
        value = worker(rank, world_size, *args)
        # Plain pickle copies tensor data into the message; the shared-memory tensors that
        # torch.multiprocessing would send could not be opened once this process has exited.
        payload = pickle.dumps(_plain(value))
        results.put((rank, "ok", payload, time.time()))
    except BaseException as error:  # every failure, even KeyboardInterrupt, must reach the caller
        failed_at = time.time()
        results.put((rank, "error", (type(error).__name__, str(error), traceback.format_exc()), failed_at))
        results.close()
        results.join_thread()
        os._exit(1)  # skip destroy_process_group: peers blocked in a collective must not wait on us
    results.close()
    results.join_thread()  # the report has reached the pipe, even if leaving the group below hangs
    try:
        finish_run()  # a barrier (launch stops a rank left waiting there by a failed one); os._exit below
    except Exception as error:  # a peer failed after this rank's report (the launcher names it), or the barrier did
        print(f"rank {rank}: its worker returned, then leaving the group failed: {error}", file=sys.stderr, flush=True)
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's shutdown: PyTorch's C++ destructors now and then abort a finished rank
    # there ("terminate called without an active exception"), after its work is done and reported.
    os._exit(0)


def _check_worker(worker: Any) -> None:
    if not callable(worker):
        raise TypeError(f"worker must be a function, got {type(worker).__name__}")
    module = getattr(worker, "__module__", None)
    qualname = getattr(worker, "__qualname__", "")
    main = sys.modules.get("__main__")
    from_notebook = module == "__main__" and not getattr(main, "__file__", None)
    if "<lambda>" in qualname or "<locals>" in qualname or from_notebook:
        raise TypeError(
            f"worker must be a top-level function of an importable module, got {module}.{qualname}: "
            "spawned processes import the worker by name, so a lambda, a nested function or a function "
            "defined in a notebook cannot reach them; write it into a module from a cell (`%%writefile "
            "lesson.py`), then pass import_fresh('lesson').worker"
        )


def import_fresh(name: str) -> ModuleType:
    """Import module `name` as its file reads now: after a notebook cell rewrote it, this process and every rank
    launched from here run the new text.

    Forgets the module imported before and deletes its cached bytecode: Python trusts a .pyc whose source has the
    same size and modification second, so an edit written within a second of the last could otherwise go unseen.
    """
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"name must be a module name such as 'lesson_ddp', got {name!r}")
    importlib.invalidate_caches()  # a file written since the last import is found
    sys.modules.pop(name, None)  # forget the copy imported before the edit
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"no module {name!r} on sys.path (from {os.getcwd()}): run the cell that writes {name}.py first",
            name=name,
        )
    with contextlib.suppress(FileNotFoundError, NotImplementedError):
        os.remove(importlib.util.cache_from_source(spec.origin))  # bytecode compiled from the text before the edit
    return importlib.import_module(name)


def launch(
    worker: Callable[..., Any],
    nprocs: int = 2,
    *,
    args: Sequence[Any] = (),
    backend: str | None = None,
    init_method: str = "env",
    timeout_s: float = 60.0,
    threads_per_process: int = 1,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run worker(rank, world_size, *args) on `nprocs` local processes in one process group; return their results.

    `backend` defaults to default_backend(nprocs). `init_method` is 'env', 'tcp' or 'file' (how the ranks
    find each other). The whole run, and every collective, must finish within `timeout_s`. Results come
    back in rank order, tensors copied to the CPU. If a rank raises or dies, raises RankError naming it;
    if the time runs out, HangError (a TimeoutError) saying where each rank was, from its stack, and which rank
    is not where the others wait. Either way no rank is left running. `env`: more environment variables for the
    ranks, such as {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} (each collective compared across the ranks first).
    """
    _check_worker(worker)
    check_int("nprocs", nprocs)
    check_int("threads_per_process", threads_per_process)
    _check_timeout(timeout_s)
    check_choice("init_method", init_method, INIT_METHODS)
    extra = dict(env or {})
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in extra.items()):
        raise TypeError(f"env must map names to strings, such as {{'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'}}, got {env!r}")
    backend = default_backend(nprocs) if backend is None else backend
    _check_backend(backend, nprocs)

    host, port = "127.0.0.1", find_free_port()
    file_dir = tempfile.mkdtemp(prefix="pg-init-") if init_method == "file" else None
    url = {
        "env": "env://",
        "tcp": f"tcp://{host}:{port}",
        "file": f"file://{os.path.join(file_dir, 'rendezvous')}" if file_dir else "",
    }[init_method]
    context = mp.get_context("spawn")  # safe in notebooks and on every OS; fork is not, with threads around
    results = context.Queue()
    where = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs)}
    stacks_dir = tempfile.mkdtemp(prefix="rank-stacks-")
    shared = (nprocs, worker, tuple(args), backend, url, float(timeout_s), threads_per_process, extra | where, results)
    processes = []
    try:
        for rank in range(nprocs):
            process = context.Process(target=_run_rank, name=f"rank{rank}", args=(rank, *shared, stacks_dir))
            process.start()
            processes.append(process)
        return _collect(processes, results, nprocs, timeout_s, stacks_dir)
    finally:
        _stop(processes)
        results.close()
        results.cancel_join_thread()
        shutil.rmtree(stacks_dir, ignore_errors=True)
        if file_dir:
            shutil.rmtree(file_dir, ignore_errors=True)


def _collect(processes: list, results: Any, nprocs: int, timeout_s: float, stacks_dir: str) -> list[Any]:
    """Wait for every rank's report; raise on the first failure, a silent death, or the deadline."""
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, tuple] = {}  # rank -> (status, payload, wall-clock time of the report)
    first_error_at = None
    while True:
        _read(results, outcomes, timeout_s=0.05)
        errors = {rank: outcome for rank, outcome in outcomes.items() if outcome[0] == "error"}
        if errors:
            first_error_at = first_error_at or time.monotonic()
            # Give the others a moment to report too, then blame the rank that failed first:
            # the rest usually fail later, in a collective, because that rank is gone.
            if len(outcomes) == nprocs or time.monotonic() - first_error_at > 1.0:
                silent = [
                    rank
                    for rank, process in enumerate(processes)
                    if rank not in outcomes and not process.is_alive() and process.exitcode != 0
                ]
                if silent:  # a rank that died without a word is the likelier cause of the others' errors
                    raise _silent_exit(silent[0], processes[silent[0]].exitcode, nprocs, also_failed=sorted(errors))
                first = min(errors, key=lambda rank: errors[rank][2])
                error_type, message, text = errors[first][1]
                raise RankError(
                    first,
                    nprocs,
                    error_type,
                    message,
                    text,
                    also_failed=sorted(rank for rank in errors if rank != first),
                )
            continue
        if len(outcomes) == nprocs:
            return [pickle.loads(outcomes[rank][1]) for rank in range(nprocs)]
        for rank, process in enumerate(processes):
            if rank not in outcomes and not process.is_alive():
                end = time.monotonic() + 2.0  # its report may still be in the pipe
                while rank not in outcomes and time.monotonic() < end:
                    _read(results, outcomes, timeout_s=0.1)
                if rank not in outcomes:
                    raise _silent_exit(rank, process.exitcode, nprocs)
        if time.monotonic() > deadline:
            waiting = [rank for rank in range(nprocs) if rank not in outcomes]
            finished = [rank for rank, outcome in outcomes.items() if outcome[0] == "ok"]
            alive = {rank: process.pid for rank, process in enumerate(processes) if process.is_alive()}
            stacks = request_stacks(alive, stacks_dir)
            report, places = hang_report(waiting, finished, stacks, nprocs)
            raise HangError(waiting, nprocs, timeout_s, report, stacks, places)


def _silent_exit(rank: int, exitcode: int | None, nprocs: int, also_failed: Sequence[int] = ()) -> RankError:
    return RankError(
        rank,
        nprocs,
        "ProcessExit",
        f"its process exited with code {exitcode} without reporting a Python error (os._exit, "
        "killed by a signal or out of memory, a crash in native code, or a failure while "
        "starting up: see its stderr above)",
        "(no Python traceback)",
        also_failed=also_failed,
    )


def _read(results: Any, outcomes: dict, timeout_s: float) -> None:
    """Store the next report, if one arrives within `timeout_s`."""
    try:
        rank, status, payload, stamp = results.get(timeout=timeout_s)
    except queue_module.Empty:
        return
    outcomes[rank] = (status, payload, stamp)


def _stop(processes: list, grace_s: float = 5.0) -> None:
    """Join finished ranks; terminate, then kill, any rank still running."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        if process.is_alive():
            process.join(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)


def is_running(pid: int) -> bool:
    """Whether a process with this id exists (signal 0 only asks; nothing is sent)."""
    check_int("pid", pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, but belongs to another user
        return True
    return True


def wait_for_lines(process: subprocess.Popen, prefix: str, count: int = 1) -> bool:
    """Read a running process's output until `count` lines starting with `prefix` came (True), or the process
    closed its output first (False). It must be started with stdout=subprocess.PIPE and text=True."""
    check_int("count", count)
    if process.stdout is None:
        raise ValueError("process must be started with stdout=subprocess.PIPE (and text=True) to be read")
    for line in iter(process.stdout.readline, ""):
        if line.startswith(prefix):
            count -= 1
            if count == 0:
                return True
    return False
