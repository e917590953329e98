"""What the ranks of notebook 06 run, and the DDP training loop that `torchrun -m helpers.cli.train_ddp` runs.

A spawned rank imports its function by name, so these live in a module, never in a notebook.
helpers.processes.launch calls each worker as worker(rank, world_size, *args) with the default
process group already set up; the workers return plain values or tensors. `train_ddp` is one rank's
whole training run (sampler, DDP wrapper, the step, metrics, rank-0 logging and checkpoint);
`train_one_process` is its one-process twin, on the very batches the ranks see together.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, random_split

from helpers.checkpoint import save_checkpoint, unwrap_model
from helpers.checks import check_int, check_positive_number
from helpers.compat import ddp_buffer_sync
from helpers.data import DigitsDataset
from helpers.distributed import GlobalBatchSampler, all_reduce_metrics, print_rank0, rank_device
from helpers.loop import evaluate, train_epoch
from helpers.models import MLP

FAILURE_MODES = ("raise", "exit", "hang")


def local_device() -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK) under nccl, the CPU under gloo."""
    return rank_device(dist.get_backend(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))


def ddp_device_ids(device: torch.device) -> list[int] | None:
    """DistributedDataParallel's device_ids for a module on `device`."""
    return [device.index] if device.type == "cuda" else None  # DDP wants its GPU named, and no ids on the CPU


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


def flat_gradient(model: nn.Module) -> torch.Tensor:
    """All of a model's gradients as one flat CPU vector (zeros where a gradient is missing)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu() for p in model.parameters()]
    )


def gradient_batch(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`samples` digits (images, labels) drawn without repetition from the training split by `seed`."""
    dataset = DigitsDataset("train")
    check_int("samples", samples, maximum=len(dataset))
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:samples]
    return dataset.images[order], dataset.targets[order]


def full_batch_gradient(seed: int, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The one-process reference: the flat gradient of the mean loss over the whole batch, from the seeded model."""
    model = build_model(TrainConfig(seed=seed))
    nn.functional.cross_entropy(model(inputs), targets).backward()
    return flat_gradient(model)


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
    model = build_model(TrainConfig(seed=seed)).to(device)  # same seed: the same starting weights on every rank

    by_hand = copy.deepcopy(model)
    loss_fn(by_hand(inputs[mine]), targets[mine]).backward()
    local = flat_gradient(by_hand)  # this rank's own gradient, before any communication
    average_gradients(by_hand)

    ddp = DistributedDataParallel(copy.deepcopy(model), device_ids=ddp_device_ids(device))
    loss_fn(ddp(inputs[mine]), targets[mine]).backward()  # DDP averages during backward

    accumulating = DistributedDataParallel(copy.deepcopy(model), device_ids=ddp_device_ids(device))
    with accumulating.no_sync():  # micro-batch 1 of 2: gradients stay local
        (loss_fn(accumulating(inputs[mine]), targets[mine]) / 2).backward()
    under_no_sync = flat_gradient(accumulating.module)
    (loss_fn(accumulating(inputs[second]), targets[second]) / 2).backward()  # micro-batch 2: all-reduce now
    return {
        "rank": rank,
        "local": local,
        "by_hand": flat_gradient(by_hand),
        "ddp": flat_gradient(ddp.module),
        "under_no_sync": under_no_sync,
        "after_sync": flat_gradient(accumulating.module),
    }


# ---------------------------------------------------------------- failures, for the launcher's checks


def failing_worker(rank: int, world_size: int, bad_rank: int, mode: str = "raise", pid_dir: str | None = None) -> int:
    """Rank `bad_rank` fails ('raise' an error, 'exit' hard, or 'hang'); the others wait at a barrier."""
    if mode not in FAILURE_MODES:
        raise ValueError(f"mode must be one of {FAILURE_MODES}, got {mode!r}")
    if pid_dir is not None:
        Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == bad_rank:
        if mode == "raise":
            raise ValueError(f"rank {rank} was told to fail")
        if mode == "exit":
            os._exit(3)
        while True:
            time.sleep(0.1)
    dist.barrier()  # waits for the bad rank, which never arrives
    return rank


# ---------------------------------------------------------------- DDP training (torchrun -m helpers.cli.train_ddp)


@dataclass
class TrainConfig:
    """What a run needs; batch_size is per rank, so the effective batch is world_size * batch_size."""

    epochs: int = 3
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    hidden: tuple[int, ...] = (64,)
    seed: int = 0
    out: str | None = None
    backend: str | None = None
    timeout_s: float = 120.0
    progress: bool = True

    def __post_init__(self) -> None:
        check_int("epochs", self.epochs)
        check_int("batch_size", self.batch_size)
        check_int("seed", self.seed, minimum=0)
        check_positive_number("lr", self.lr)
        if not isinstance(self.momentum, (int, float)) or not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if not self.hidden or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.hidden):
            raise ValueError(f"hidden must be a non-empty tuple of positive ints, got {self.hidden!r}")


def build_model(config: TrainConfig) -> nn.Module:
    """The course MLP, initialised from config.seed (so every rank starts from the same weights)."""
    torch.manual_seed(config.seed)  # torch takes any 64-bit seed
    return MLP(64, config.hidden, 10)


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD with momentum, built after the model is on its device."""
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)


def train_validation_split(seed: int) -> list[Subset]:
    """The training digits split 80 / 20 into training and validation subsets, the same split for the same seed."""
    return random_split(DigitsDataset("train"), [0.8, 0.2], generator=torch.Generator().manual_seed(seed))


def evaluate_sharded(model: nn.Module, dataset, device: torch.device, rank: int, world_size: int) -> dict:
    """Each rank scores every world_size-th sample (no padding, no overlap); the sums are all-reduced.

    Under FSDP every forward all-gathers, so every rank must run as many batches: the shards differ by at most one
    sample, one batch of 256 each for the validation split on 2 ranks or more."""
    shard = Subset(dataset, range(rank, len(dataset), world_size))
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for inputs, targets in DataLoader(shard, batch_size=256):
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = model(inputs)
            loss_sum += float(loss_fn(outputs, targets))
            correct += int((outputs.argmax(dim=1) == targets).sum())
    model.train(was_training)
    totals = all_reduce_metrics({"loss_sum": loss_sum, "correct": correct, "samples": len(shard)})
    return {"loss": totals["loss_sum"] / totals["samples"], "accuracy": totals["correct"] / totals["samples"]}


STRATEGIES = ("ddp", "fsdp")  # a whole copy of the model per rank (DDP), or a shard per rank (FSDP2, notebook 07)


def train_ddp(
    config: TrainConfig, rank: int, world_size: int, device: torch.device, *, strategy: str = "ddp"
) -> list[dict]:
    """One rank's training run, in a process group already set up; returns the history (on every rank).

    `strategy` 'ddp' wraps the model in DistributedDataParallel; 'fsdp' shards it with fully_shard
    (helpers.workers.fsdp.shard_model). The loop is the same: only what backward() communicates differs.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    from .fsdp import gather_whole, shard_model  # FSDP2's two changes (notebook 07); imported here: fsdp imports us

    train_set, val_set = train_validation_split(config.seed)  # the same split on every rank
    sampler: DistributedSampler[int] = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed
    )
    loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler)  # this rank's shard only
    model = build_model(config).to(device)  # same seed on every rank (and DDP broadcasts rank 0's weights)
    # DDP: a whole copy per rank; FSDP: each rank keeps its shards
    model = (
        DistributedDataParallel(model, device_ids=ddp_device_ids(device)) if strategy == "ddp" else shard_model(model)
    )
    optimizer = build_optimizer(model, config)  # under FSDP built on the shards: its state is sharded too
    loss_fn = nn.CrossEntropyLoss()
    print_rank0(
        f"world_size={world_size} backend={dist.get_backend()} device={device.type} strategy={strategy} "
        f"batch={config.batch_size}/rank ({world_size * config.batch_size} per step) "
        f"steps/epoch={len(loader)}",
        flush=True,
    )
    bar = None
    if config.progress and rank == 0:  # one progress bar, not one per rank
        from tqdm.auto import tqdm

        bar = tqdm(total=config.epochs * len(loader), desc=strategy, unit="step")
    history: list[dict] = []
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats epoch 0's order
        model.train()
        start = time.perf_counter()
        loss_sum, samples = torch.zeros((), device=device), 0
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients; FSDP reduce-scatters them into shards
            optimizer.step()  # the same averaged gradient everywhere: the copies (or shards) stay consistent
            loss_sum += loss.detach() * len(targets)  # no .item() per step: it would wait for the GPU
            samples += len(targets)
            if bar is not None:
                bar.update(1)
        seconds = time.perf_counter() - start
        train_totals = all_reduce_metrics({"loss_sum": float(loss_sum), "samples": samples})  # sums over ranks
        val = evaluate_sharded(unwrap_model(model), val_set, device, rank, world_size)
        history.append(
            {
                "epoch": epoch + 1,
                "train_loss": train_totals["loss_sum"] / train_totals["samples"],
                "val_loss": val["loss"],
                "val_accuracy": val["accuracy"],
                "seconds": seconds,
                "samples_seen": int(train_totals["samples"]),
            }
        )
        print_rank0(
            f"epoch {epoch + 1}: train_loss={history[-1]['train_loss']:.4f} val_loss={val['loss']:.4f} "
            f"val_accuracy={val['accuracy']:.4f} ({seconds:.2f} s)",
            flush=True,
        )
    if bar is not None:
        bar.close()
    # A file a plain model loads: DDP's model.module (no "module." prefix), or FSDP's shards gathered on rank 0
    whole = (unwrap_model(model), optimizer) if strategy == "ddp" else gather_whole(model, optimizer, config, rank)
    if rank == 0 and config.out and whole is not None:  # one writer: N ranks writing one file would race
        path = save_checkpoint(
            Path(config.out) / "model.pt",
            *whole,
            epoch=config.epochs,
            step=config.epochs * len(loader),
            metric=history[-1]["val_accuracy"],
            extra={"config": asdict(config), "world_size": world_size, "strategy": strategy, "history": history},
        )
        record = {
            "world_size": world_size,
            "backend": dist.get_backend(),
            "strategy": strategy,
            "config": asdict(config),
        }
        Path(config.out, "history.json").write_text(json.dumps({**record, "history": history}, indent=1))
        print_rank0(f"saved {path}", flush=True)
    dist.barrier()  # nobody leaves before rank 0 has written its files
    return history


def train_one_process(
    config: TrainConfig,
    world_size: int,
    *,
    nudge: float = 0.0,
    threads: int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[list[dict], nn.Module]:
    """train_ddp's twin in this process, on `device`: batches of world_size * batch_size, each one every rank's batch.

    The batches come from GlobalBatchSampler (the ranks' DistributedSampler batches, joined), so with a mean loss
    each step's gradient is the one DDP averages. `nudge` scales the starting weights by (1 + nudge); `threads`
    sets torch's CPU threads for the run (restored after). Returns one row per epoch and the trained model (on
    the CPU).
    """
    check_int("world_size", world_size)
    train_set, val_set = train_validation_split(config.seed)  # the split every rank uses
    batches = GlobalBatchSampler(len(train_set), world_size, config.batch_size, seed=config.seed)
    loader, val_loader = DataLoader(train_set, batch_sampler=batches), DataLoader(val_set, batch_size=256)
    model = build_model(config)  # the same starting weights as every rank
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + nudge)
    model = model.to(device)
    optimizer = build_optimizer(model, config)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads or threads_before)
    history = []
    try:
        for epoch in range(config.epochs):
            batches.set_epoch(epoch)  # the order every rank's DistributedSampler uses in this epoch
            train = train_epoch(model, loader, optimizer, nn.CrossEntropyLoss(), device=device, progress=False)
            val = evaluate(model, val_loader, nn.CrossEntropyLoss(), device=device)
            history.append({"epoch": epoch + 1, "val_accuracy": val.accuracy, "seconds": train.seconds})
    finally:
        torch.set_num_threads(threads_before)
    return history, model.cpu()
