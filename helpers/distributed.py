"""What a rank uses inside a process group: joining and leaving it, rank-0 printing, summed metrics.

    from helpers.distributed import setup_process_group, teardown_process_group
    device = setup_process_group(rank, world_size, backend=default_backend(world_size))

`setup_process_group` joins the default process group with a timeout (nccl when there is a GPU per rank,
gloo otherwise) and returns the device the rank computes on. `GlobalBatchSampler` replays, in one
process, the batches a DDP run sees. Starting the ranks is helpers/processes.py's job (`launch` from a
notebook, `run_torchrun` for a script).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler, Sampler

from .checks import check_choice, check_int, check_positive_number

BACKENDS = ("gloo", "nccl", "mpi")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def default_backend(world_size: int) -> str:
    """nccl when there is a CUDA device for each of `world_size` local ranks, gloo otherwise."""
    check_int("world_size", world_size)
    if dist.is_nccl_available() and torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under nccl (one process per GPU), the CPU otherwise."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _check_timeout(timeout_s: Any) -> None:
    check_positive_number("timeout_s", timeout_s)


def _check_backend(backend: str, world_size: int) -> None:
    check_choice("backend", backend, BACKENDS)
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    if not available[backend]:
        raise ValueError(
            f"backend={backend!r} is not built into this PyTorch "
            f"(available: {[name for name, ok in available.items() if ok]})"
        )
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < world_size):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(
            f"backend='nccl' needs one CUDA device per rank: {world_size} ranks, {count} devices; "
            "use backend='gloo' or fewer ranks"
        )


def setup_process_group(
    rank: int, world_size: int, *, backend: str = "gloo", init_method: str = "env://", timeout_s: float = 60.0
) -> torch.device:
    """Join the default process group as `rank` of `world_size`; return the device this rank should use.

    `init_method` is 'env://' (MASTER_ADDR / MASTER_PORT from the environment, as torchrun sets them),
    'tcp://host:port' or 'file:///path'. Collectives that wait longer than `timeout_s` raise.
    """
    check_int("world_size", world_size)
    check_int("rank", rank, minimum=0, maximum=world_size - 1)  # else the rendezvous waits for the missing rank
    _check_backend(backend, world_size)
    _check_timeout(timeout_s)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = rank_device(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # one process per GPU: this rank's "cuda" is its own GPU
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method == "env://" and "TORCHELASTIC_RESTART_COUNT" in os.environ:  # started by torchrun
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        store = attempt_store(store, world_size, int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    return device


def attempt_store(store: dist.Store, world_size: int, restart_count: int) -> dist.Store:
    """`store` seen through a prefix of this attempt's own, the same for every rank of the attempt.

    torchrun keeps one key-value store for the whole job, through every restart (`--max-restarts`) and every change
    of members (`--nnodes=1:2`). Ranks meet there: each writes its address and reads the others'. A restarted group
    reading the store as is could find the address a rank of the attempt before wrote, and wait on a process that
    is gone (gloo: "connectFullMesh failed ... Connection refused"), depending on which rank comes up first. So each
    rank counts itself in under the restart count torchrun gives it and the world size (torchrun re-forms a group
    without counting a restart when a node joins), and the ranks of one attempt, counted 1 to world_size, share a
    fresh prefix: no key of an earlier attempt can be read.
    """
    check_int("world_size", world_size)
    check_int("restart_count", restart_count, minimum=0)
    group = f"course/{restart_count}/{world_size}"
    attempt = (store.add(f"{group}/joined", 1) - 1) // world_size
    return dist.PrefixStore(f"{group}/{attempt}/", store)


def teardown_process_group() -> None:
    """Leave and destroy the default process group, if there is one.

    A world of one meets at a barrier first: on torch 2.6 gloo's destroy_process_group right after a collective now
    and then hangs; after a barrier it does not. A larger world gets none: a rank that failed would never arrive.
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:
            dist.barrier()
        dist.destroy_process_group()


def finish_run() -> None:
    """The end of a run that succeeded on every rank, in a process about to exit with os._exit.

    A world of one leaves and destroys its group (teardown_process_group). A rank of several meets the others at a
    barrier and keeps the group, which ends with its process: on torch 2.6, gloo's destroy_process_group now and
    then hangs in a rank whose peers have already left, even after a barrier (3 torchrun runs in 20 on a busy
    2-core machine), and os._exit skips it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() == 1:
        teardown_process_group()
    else:
        dist.barrier()


@contextlib.contextmanager
def world_of_one(*, backend: str = "gloo", timeout_s: float = 60.0) -> Iterator[torch.device]:
    """A process group of this process alone (rank 0 of 1, on a free local port) for the block; yields its device."""
    init_method = f"tcp://127.0.0.1:{find_free_port()}"
    device = setup_process_group(0, 1, backend=backend, init_method=init_method, timeout_s=timeout_s)
    try:
        yield device
    finally:
        teardown_process_group()


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
    accuracy of the whole data set, whatever each rank's share was. Values may be one-element tensors.
    Without a process group, returns the numbers unchanged (a world of one).
    """
    values = [float(value) for value in metrics.values()]
    if not (dist.is_available() and dist.is_initialized()):
        return dict(zip(metrics, values, strict=True))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    buffer = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    if average:
        buffer /= dist.get_world_size()
    return dict(zip(metrics, buffer.tolist(), strict=True))


class GlobalBatchSampler(Sampler[list[int]]):
    """The batches a DDP run sees, as one process: step k's batch is every rank's k-th batch, joined.

    Each rank r of a DDP run draws from DistributedSampler(num_replicas=world_size, rank=r,
    shuffle=True, seed=seed) in batches of `batch_size`. This sampler yields, per step, the indices of
    all ranks' batches together, so one process with batch world_size * batch_size follows the same
    samples (and, with a mean loss and equal shards, the same gradients). Call set_epoch like DDP does.
    """

    def __init__(
        self,
        dataset_size: int,
        world_size: int,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        check_int("dataset_size", dataset_size)
        check_int("world_size", world_size)
        check_int("batch_size", batch_size)
        self.dataset_size, self.world_size, self.batch_size = dataset_size, world_size, batch_size
        self.seed, self.shuffle, self.drop_last, self.epoch = seed, shuffle, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        """Use the order of `epoch` (each rank's DistributedSampler.set_epoch(epoch))."""
        self.epoch = epoch

    def _sampler(self, rank: int) -> DistributedSampler[int]:
        indices = cast("Dataset[int]", range(self.dataset_size))  # DistributedSampler only needs its length
        sampler: DistributedSampler[int] = DistributedSampler(
            indices, self.world_size, rank, shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last
        )
        sampler.set_epoch(self.epoch)
        return sampler

    def _rank_batches(self) -> list[list[list[int]]]:
        per_rank = []
        for rank in range(self.world_size):
            indices = list(self._sampler(rank))
            per_rank.append([indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)])
        return per_rank

    def __iter__(self) -> Iterator[list[int]]:
        # strict: every rank has as many batches, since DistributedSampler pads (or drops) to equal shards
        for step_batches in zip(*self._rank_batches(), strict=True):
            yield [index for batch in step_batches for index in batch]

    def __len__(self) -> int:
        return -(-len(self._sampler(0)) // self.batch_size)
