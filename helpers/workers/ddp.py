"""The small rank functions of notebooks 07 and 08: who is who, point-to-point and collectives, buffers, the sampler,
gradients averaged by hand, by DDP and under no_sync, and failures for the launcher's checks.

A spawned rank imports its function by name, so these live in a module. The lesson's training step is not here:
a cell of notebook 08 writes it into the module its ranks import (`lesson_ddp.py`), so the learner's edit is what
the ranks run; helpers.workers.training holds the same loop for the torchrun script (`train_ddp`) and its
one-process twin. helpers.processes.launch calls each worker as worker(rank, world_size, *args) with the default
process group already set up; the workers return plain values or tensors.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from helpers.checks import check_choice
from helpers.compat import ddp_buffer_sync
from helpers.distributed import all_reduce_metrics
from helpers.grads import flat_grad

from .common import ddp_device_ids, gradient_batch, local_device, mlp

FAILURE_MODES = ("raise", "exit", "hang", "skip")


# ---------------------------------------------------------------- who is who


def describe_rank(rank: int, world_size: int) -> dict:
    """This rank's view of the group, and the sum of all rank numbers computed with one all_reduce."""
    total = torch.tensor([float(rank)], device=local_device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
        "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
        "device": str(local_device()),
        "torch_threads": torch.get_num_threads(),
        "sum_of_ranks": float(total.item()),
    }


# ---------------------------------------------------------------- point-to-point and collectives


def payload_for(seed: int, destination: int) -> torch.Tensor:
    """The tensor rank 0 sends to `destination`: 4 seeded random numbers, so the receiver can be checked."""
    return torch.randn(4, generator=torch.Generator().manual_seed(seed * 1000 + destination))  # 64-bit seeds


def contribution_of(seed: int, rank: int) -> torch.Tensor:
    """What `rank` puts into the all_reduce: 4 seeded random numbers of its own."""
    return torch.randn(4, generator=torch.Generator().manual_seed(seed * 1000 + 500 + rank))


def send_recv_worker(rank: int, world_size: int, seed: int) -> dict:
    """Point-to-point: rank 0 sends each other rank its own tensor with dist.send; they dist.recv it."""
    device = local_device()
    if rank == 0:
        for destination in range(1, world_size):
            dist.send(payload_for(seed, destination).to(device), dst=destination)
        return {"rank": rank, "sent_to": list(range(1, world_size))}
    buffer = torch.empty(4, device=device)  # recv fills a tensor of the right shape and dtype
    source = dist.recv(buffer, src=0)
    return {"rank": rank, "received": buffer, "from": source}


def all_reduce_worker(rank: int, world_size: int, seed: int) -> dict:
    """Collective: every rank adds its tensor into one sum that every rank then holds."""
    mine = contribution_of(seed, rank)
    reduced = mine.clone().to(local_device())
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)  # in place, on every rank
    metric = all_reduce_metrics({"value": float(mine.sum())}, average=True)
    return {"rank": rank, "contribution": mine, "reduced": reduced, "mean_of_sums": metric["value"]}


def communication_worker(rank: int, world_size: int, seed: int) -> dict:
    """send_recv_worker, then all_reduce_worker, in one run (one process start-up instead of two)."""
    return {
        "send_recv": send_recv_worker(rank, world_size, seed),
        "all_reduce": all_reduce_worker(rank, world_size, seed),
    }


def buffers_worker(rank: int, world_size: int, seed: int) -> dict:
    """BatchNorm's running mean under DDP: set per rank before the wrap, then as each forward finds it, per setting.

    Every rank starts with running_mean = rank, so the wrap's broadcast shows; then two forwards on its own
    batch (BatchNorm updates the statistics from it) with the per-forward sync on (the default) and off:
    `forward_sync_buffers` from torch 2.13, `broadcast_buffers` before (helpers.compat.ddp_buffer_sync).
    """
    device = local_device()
    result: dict = {"rank": rank}
    for sync in (True, False):
        torch.manual_seed(seed)
        norm = nn.BatchNorm1d(4)
        model = nn.Sequential(nn.Linear(8, 4), norm).to(device)
        running_mean = norm.running_mean
        assert running_mean is not None  # track_running_stats is on by default
        running_mean.fill_(float(rank))  # rank-local statistics, before the wrap
        seen: list[torch.Tensor] = []  # the running mean each forward starts from (after DDP's broadcast)
        norm.register_forward_pre_hook(lambda module, args, seen=seen: seen.append(module.running_mean.clone()))
        ddp = DistributedDataParallel(model, device_ids=ddp_device_ids(device), **ddp_buffer_sync(sync))
        at_wrap = running_mean.clone()
        batches = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(seed + 1 + rank))  # rank's own
        for batch in batches:
            ddp(batch.to(device)).sum().backward()
        result[sync] = {"at_wrap": at_wrap, "seen": seen, "after": running_mean.clone()}
    return result


def sampler_worker(rank: int, world_size: int, dataset_size: int, seed: int) -> dict:
    """The indices DistributedSampler gives this rank: epoch 0, epoch 0 again without set_epoch, epoch 1."""
    sampler: DistributedSampler[int] = DistributedSampler(range(dataset_size), shuffle=True, seed=seed)  # type: ignore[arg-type]
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    again_without_set_epoch = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    return {"rank": rank, "epoch0": epoch0, "epoch0_again": again_without_set_epoch, "epoch1": epoch1}


# ---------------------------------------------------------------- gradients: by hand, DDP, no_sync


def average_gradients(model: nn.Module) -> None:
    """Hand-written data parallelism: all_reduce (sum) every gradient, then divide by the number of ranks."""
    world_size = dist.get_world_size()
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
            parameter.grad /= world_size


def full_batch_gradient(seed: int, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The one-process reference: the flat gradient of the mean loss over the whole batch, from the seeded model."""
    model = mlp(seed, (64,))  # TrainConfig's hidden widths: the model the training run trains
    nn.functional.cross_entropy(model(inputs), targets).backward()
    return flat_grad(model).cpu()


def gradients_worker(rank: int, world_size: int, seed: int, batch_size: int) -> dict:
    """One rank's gradients: its own, hand-averaged, from DDP, and under no_sync then after a synchronising step.

    The global batch is gradient_batch(seed, 2 * world_size * batch_size). Micro-batch 0 of rank r is
    rows [r*B, (r+1)*B); micro-batch 1 is the same slice of the second half.
    """
    device = local_device()
    inputs, targets = gradient_batch(seed, 2 * world_size * batch_size)
    inputs, targets = inputs.to(device), targets.to(device)
    half = world_size * batch_size
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    second = slice(half + rank * batch_size, half + (rank + 1) * batch_size)
    loss_fn = nn.CrossEntropyLoss()
    model = mlp(seed, (64,)).to(device)  # same seed: the same starting weights on every rank

    by_hand = copy.deepcopy(model)
    loss_fn(by_hand(inputs[mine]), targets[mine]).backward()
    local = flat_grad(by_hand).cpu()  # this rank's own gradient, before any communication
    average_gradients(by_hand)

    ddp = DistributedDataParallel(copy.deepcopy(model), device_ids=ddp_device_ids(device))
    loss_fn(ddp(inputs[mine]), targets[mine]).backward()  # DDP averages during backward

    accumulating = DistributedDataParallel(copy.deepcopy(model), device_ids=ddp_device_ids(device))
    with accumulating.no_sync():  # micro-batch 1 of 2: gradients stay local
        (loss_fn(accumulating(inputs[mine]), targets[mine]) / 2).backward()
    under_no_sync = flat_grad(accumulating.module).cpu()
    (loss_fn(accumulating(inputs[second]), targets[second]) / 2).backward()  # micro-batch 2: all-reduce now
    return {
        "rank": rank,
        "local": local,
        "by_hand": flat_grad(by_hand).cpu(),
        "ddp": flat_grad(ddp.module).cpu(),
        "under_no_sync": under_no_sync,
        "after_sync": flat_grad(accumulating.module).cpu(),
    }


# ---------------------------------------------------------------- failures, for the launcher's checks


def failing_worker(rank: int, world_size: int, bad_rank: int, mode: str = "raise", pid_dir: str | None = None) -> int:
    """Rank `bad_rank` fails ('raise' an error, 'exit' hard, 'hang', or 'skip' the all_reduce every other rank
    calls, the classic hang); the others wait at a barrier."""
    check_choice("mode", mode, FAILURE_MODES)
    if pid_dir is not None:
        Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == bad_rank:
        if mode == "raise":
            raise ValueError(f"rank {rank} was told to fail")
        if mode == "exit":
            os._exit(3)
        if mode == "skip":  # the all_reduce below, skipped here only: a condition true on one rank
            return rank
        while True:
            time.sleep(0.1)
    if mode == "skip":
        dist.all_reduce(torch.ones(1))  # every other rank waits here for the bad rank, which never comes
    dist.barrier()  # waits for the bad rank, which never arrives
    return rank
