"""Distributed runs on one machine: a launcher for N local ranks, and the helpers a DDP lesson needs.

    from helpers.distributed import launch
    results = launch(my_module.worker, nprocs=2, args=(seed,))   # worker(rank, world_size, seed)

`launch` starts one process per rank with the spawn start method, gives them a free port and a process
group with a timeout (nccl when there is a GPU per rank, gloo otherwise), and returns what each rank's
worker returned. If a rank raises, the caller gets a `RankError` with that rank's number and traceback,
and every other rank is stopped. For scripts, `torchrun` does the same job (see helpers/cli/train_ddp.py).
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import shutil
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DistributedSampler, Sampler

BACKENDS = ("gloo", "nccl", "mpi")
INIT_METHODS = ("env", "tcp", "file")


class RankError(RuntimeError):
    """One rank of a launched run raised; carries the rank number and its traceback text."""

    def __init__(self, rank: int, world_size: int, error_type: str, message: str, traceback_text: str,
                 also_failed: Sequence[int] = ()) -> None:
        self.rank, self.world_size, self.error_type = rank, world_size, error_type
        self.error_message, self.traceback_text, self.also_failed = message, traceback_text, list(also_failed)
        others = (f" (ranks {self.also_failed} failed after it, most likely because rank {rank} was gone)"
                  if self.also_failed else "")
        super().__init__(f"rank {rank} of {world_size} raised {error_type}: {message}{others}; "
                         f"all ranks were stopped.\n\n--- traceback from rank {rank} ---\n{traceback_text}")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def default_backend(world_size: int) -> str:
    """nccl when there is a CUDA device for each of `world_size` local ranks, gloo otherwise."""
    _check_positive_int("world_size", world_size)
    if dist.is_nccl_available() and torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under nccl (one process per GPU), the CPU otherwise."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_timeout(timeout_s: Any) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def _check_backend(backend: str, world_size: int) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    if not available[backend]:
        raise ValueError(f"backend={backend!r} is not built into this PyTorch "
                         f"(available: {[name for name, ok in available.items() if ok]})")
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < world_size):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"backend='nccl' needs one CUDA device per rank: {world_size} ranks, {count} devices; "
                         "use backend='gloo' or fewer ranks")


def setup_process_group(rank: int, world_size: int, *, backend: str = "gloo", init_method: str = "env://",
                        timeout_s: float = 60.0) -> torch.device:
    """Join the default process group as `rank` of `world_size`; return the device this rank should use.

    `init_method` is 'env://' (MASTER_ADDR / MASTER_PORT from the environment, as torchrun sets them),
    'tcp://host:port' or 'file:///path'. Collectives that wait longer than `timeout_s` raise.
    """
    _check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    _check_backend(backend, world_size)
    _check_timeout(timeout_s)
    if not isinstance(init_method, str) or not init_method.startswith(("env://", "tcp://", "file://")):
        raise ValueError(f"init_method must start with 'env://', 'tcp://' or 'file://', got {init_method!r}")
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process; "
                           "call teardown_process_group() first")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = rank_device(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # one process per GPU: this rank's "cuda" is its own GPU
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return device


def teardown_process_group() -> None:
    """Leave and destroy the default process group, if there is one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_rank0() -> bool:
    """True on rank 0, and in a process that is not part of a process group."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def print_rank0(*args: Any, **kwargs: Any) -> None:
    """print(), but only on rank 0 (so N ranks do not print every line N times)."""
    if is_rank0():
        print(*args, **kwargs)


def all_reduce_metrics(metrics: Mapping[str, float], *, average: bool = False) -> dict[str, float]:
    """Sum (or average, with `average`) each named number over all ranks, in one collective.

    Sum counts and totals, then divide: all_reduce_metrics({"correct": c, "samples": n}) gives the
    accuracy of the whole data set, whatever each rank's share was. Without a process group, returns
    the numbers unchanged (a world of one).
    """
    if not isinstance(metrics, Mapping) or not metrics:
        raise ValueError(f"metrics must be a non-empty mapping of names to numbers, got {metrics!r}")
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)) or (
                isinstance(value, torch.Tensor) and value.numel() != 1):
            raise TypeError(f"metrics[{name!r}] must be a number or a one-element tensor, got {value!r}")
    values = [float(value) for value in metrics.values()]
    if not (dist.is_available() and dist.is_initialized()):
        return dict(zip(metrics, values))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    buffer = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    if average:
        buffer /= dist.get_world_size()
    return dict(zip(metrics, buffer.tolist()))


class GlobalBatchSampler(Sampler[list[int]]):
    """The batches a DDP run sees, as one process: step k's batch is every rank's k-th batch, joined.

    Each rank r of a DDP run draws from DistributedSampler(num_replicas=world_size, rank=r,
    shuffle=True, seed=seed) in batches of `batch_size`. This sampler yields, per step, the indices of
    all ranks' batches together, so one process with batch world_size * batch_size follows the same
    samples (and, with a mean loss and equal shards, the same gradients). Call set_epoch like DDP does.
    """

    def __init__(self, dataset_size: int, world_size: int, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> None:
        _check_positive_int("dataset_size", dataset_size)
        _check_positive_int("world_size", world_size)
        _check_positive_int("batch_size", batch_size)
        self.dataset_size, self.world_size, self.batch_size = dataset_size, world_size, batch_size
        self.seed, self.shuffle, self.drop_last, self.epoch = seed, shuffle, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        """Use the order of `epoch` (each rank's DistributedSampler.set_epoch(epoch))."""
        self.epoch = epoch

    def _rank_batches(self) -> list[list[list[int]]]:
        per_rank = []
        for rank in range(self.world_size):
            sampler = DistributedSampler(range(self.dataset_size), num_replicas=self.world_size, rank=rank,
                                         shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last)
            sampler.set_epoch(self.epoch)
            indices = list(sampler)
            per_rank.append([indices[i:i + self.batch_size] for i in range(0, len(indices), self.batch_size)])
        return per_rank

    def __iter__(self) -> Iterator[list[int]]:
        for step_batches in zip(*self._rank_batches()):
            yield [index for batch in step_batches for index in batch]

    def __len__(self) -> int:
        per_rank = len(DistributedSampler(range(self.dataset_size), num_replicas=self.world_size, rank=0,
                                          shuffle=False, drop_last=self.drop_last))
        return -(-per_rank // self.batch_size)


# ---------------------------------------------------------------- the launcher

def _plain(value: Any) -> Any:
    """Copy tensors out to the CPU (detached), through lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_plain(item) for item in value)
    return value


def _run_rank(rank: int, world_size: int, worker: Callable[..., Any], args: tuple, backend: str,
              init_method: str, timeout_s: float, threads: int, env: dict, results: Any) -> None:
    """What each spawned process runs: join the group, call the worker, report its result or error."""
    try:
        os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))  # what torchrun gives each rank
        torch.set_num_threads(threads)
        setup_process_group(rank, world_size, backend=backend, init_method=init_method, timeout_s=timeout_s)
        value = worker(rank, world_size, *args)
        # Plain pickle copies tensor data into the message; the shared-memory tensors that
        # torch.multiprocessing would send could not be opened once this process has exited.
        payload = pickle.dumps(_plain(value))
        results.put((rank, "ok", payload, time.time()))
    except BaseException as error:  # noqa: BLE001 - every failure must reach the caller
        failed_at = time.time()
        results.put((rank, "error", (type(error).__name__, str(error), traceback.format_exc()), failed_at))
        results.close()
        results.join_thread()
        os._exit(1)  # skip destroy_process_group: peers blocked in a collective must not wait on us
    teardown_process_group()
    results.close()
    results.join_thread()  # the report has reached the pipe
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
            "defined in a notebook cannot reach them; move it into a .py module (e.g. helpers/...)")


def launch(worker: Callable[..., Any], nprocs: int = 2, *, args: Sequence[Any] = (), backend: str | None = None,
           init_method: str = "env", timeout_s: float = 60.0, threads_per_process: int = 1) -> list[Any]:
    """Run worker(rank, world_size, *args) on `nprocs` local processes in one process group; return their results.

    `backend` defaults to default_backend(nprocs). `init_method` is 'env', 'tcp' or 'file' (how the ranks
    find each other). The whole run, and every collective, must finish within `timeout_s`. Results come
    back in rank order, tensors copied to the CPU. If a rank raises or dies, raises RankError naming it;
    if the time runs out, TimeoutError. Either way no rank is left running.
    """
    _check_worker(worker)
    _check_positive_int("nprocs", nprocs)
    _check_positive_int("threads_per_process", threads_per_process)
    _check_timeout(timeout_s)
    if init_method not in INIT_METHODS:
        raise ValueError(f"init_method must be one of {INIT_METHODS}, got {init_method!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra worker arguments, got {type(args).__name__}")
    backend = default_backend(nprocs) if backend is None else backend
    _check_backend(backend, nprocs)

    host, port = "127.0.0.1", find_free_port()
    file_dir = tempfile.mkdtemp(prefix="pg-init-") if init_method == "file" else None
    url = {"env": "env://", "tcp": f"tcp://{host}:{port}",
           "file": f"file://{os.path.join(file_dir, 'rendezvous')}" if file_dir else ""}[init_method]
    context = mp.get_context("spawn")  # safe in notebooks and on every OS; fork is not, with threads around
    results = context.Queue()
    env = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "WORLD_SIZE": str(nprocs),
           "LOCAL_WORLD_SIZE": str(nprocs)}
    processes = []
    try:
        for rank in range(nprocs):
            process = context.Process(
                target=_run_rank, name=f"rank{rank}",
                args=(rank, nprocs, worker, tuple(args), backend, url, float(timeout_s), threads_per_process,
                      env, results))
            process.start()
            processes.append(process)
        return _collect(processes, results, nprocs, timeout_s)
    finally:
        _stop(processes)
        results.close()
        results.cancel_join_thread()
        if file_dir:
            shutil.rmtree(file_dir, ignore_errors=True)


def _collect(processes: list, results: Any, nprocs: int, timeout_s: float) -> list[Any]:
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
                silent = [rank for rank, process in enumerate(processes)
                          if rank not in outcomes and not process.is_alive() and process.exitcode != 0]
                if silent:  # a rank that died without a word is the likelier cause of the others' errors
                    raise _silent_exit(silent[0], processes[silent[0]].exitcode, nprocs, also_failed=sorted(errors))
                first = min(errors, key=lambda rank: errors[rank][2])
                error_type, message, text = errors[first][1]
                raise RankError(first, nprocs, error_type, message, text,
                                also_failed=sorted(rank for rank in errors if rank != first))
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
            raise TimeoutError(f"ranks {waiting} of {nprocs} did not finish within timeout_s={timeout_s} s; "
                               "all ranks were stopped")


def _silent_exit(rank: int, exitcode: int | None, nprocs: int, also_failed: Sequence[int] = ()) -> RankError:
    return RankError(rank, nprocs, "ProcessExit",
                     f"its process exited with code {exitcode} without reporting a Python error (os._exit, "
                     "killed by a signal or out of memory, a crash in native code, or a failure while "
                     "starting up: see its stderr above)", "(no Python traceback)", also_failed=also_failed)


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


def torchrun_command(module: str, args: Sequence[str] = (), *, nproc_per_node: int = 2) -> list[str]:
    """The command line `torchrun --standalone --nproc_per_node=N -m module args...`, via this Python."""
    if not isinstance(module, str) or not module.replace(".", "").replace("_", "").isalnum():
        raise ValueError(f"module must be a dotted module name such as 'helpers.cli.train_ddp', got {module!r}")
    _check_positive_int("nproc_per_node", nproc_per_node)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
            "-m", module, *[str(arg) for arg in args]]


def run_torchrun(module: str, args: Sequence[str] = (), *, nproc_per_node: int = 2, timeout_s: float = 300.0,
                 cwd: str | os.PathLike | None = None) -> str:
    """Run `module` under torchrun as a subprocess; return its output, or raise with its tail on failure or timeout.

    The subprocess gets its own session, so on timeout torchrun and all its ranks are stopped together.
    """
    import subprocess

    _check_timeout(timeout_s)
    command = torchrun_command(module, args, nproc_per_node=nproc_per_node)
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join(filter(None, [project, os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen(command, cwd=cwd or project, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=os.name == "posix")
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_session(process)
        output, _ = process.communicate()
        raise TimeoutError(f"{' '.join(command[1:])} did not finish within timeout_s={timeout_s} s and was "
                           f"stopped with all its ranks; last output:\n{(output or '')[-3000:]}") from None
    except BaseException:  # e.g. KeyboardInterrupt in a notebook: leave no rank behind
        _stop_session(process)
        raise
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed with exit code {process.returncode}; "
                           f"last output:\n{output[-3000:]}")
    return output


def _stop_session(process: Any) -> None:
    """SIGTERM, then SIGKILL, to a subprocess and everything in its session (torchrun and its ranks)."""
    import signal
    import subprocess

    if os.name != "posix":
        process.kill()
        process.wait()
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL too: a rank may outlive torchrun itself
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
