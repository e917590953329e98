"""The training run of `torchrun -m helpers.cli.train_ddp`: one rank's loop under DDP or FSDP2 (`train_ddp`), its
one-process twin on the very batches the ranks see together (`train_one_process`), validation sharded over the
ranks without padding, and the sharded model gathered into one plain file at the end.

Notebook 08 writes the same DDP loop in a cell (the module `lesson_ddp.py` its ranks import) and checks that it
ends at the weights `train_ddp` reaches; this module adds logging, a progress bar, FSDP and the checkpoint files.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

from helpers.checkpoint import save_checkpoint, unwrap_model
from helpers.checks import check_int
from helpers.distributed import GlobalBatchSampler, all_reduce_metrics, print_rank0
from helpers.loop import evaluate, train_epoch
from helpers.progress import progress_bar

from .common import TrainConfig, build_optimizer, ddp_device_ids, mlp, train_validation_split
from .fsdp import shard_model


def evaluate_sharded(model: nn.Module, dataset, device: torch.device, rank: int, world_size: int) -> dict:
    """Each rank scores every world_size-th sample (no padding, no overlap); the sums are all-reduced.

    Under FSDP every forward all-gathers, so every rank must run as many batches: the shards differ by at most one
    sample, one batch of 256 each for the validation split on 2 ranks or more."""
    shard = Subset(dataset, range(rank, len(dataset), world_size))
    mine = evaluate(model, DataLoader(shard, batch_size=256), nn.functional.cross_entropy, device=device)
    correct = int(mine.confusion_matrix.trace())  # exact counts, summed over the ranks below
    totals = all_reduce_metrics({"loss_sum": mine.loss * mine.samples, "correct": correct, "samples": mine.samples})
    return {"loss": totals["loss_sum"] / totals["samples"], "accuracy": totals["correct"] / totals["samples"]}


def rank_setup(config: TrainConfig, rank: int, world_size: int, device: torch.device) -> tuple:
    """This rank's part of a run: its shard of the training data (sampler and loader), the validation split, the
    model (a whole copy under DDP, this rank's shards under FSDP) and its optimizer."""
    train_set, val_set = train_validation_split(config.seed)  # the same split on every rank
    sampler: DistributedSampler[int] = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed
    )
    loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler)  # this rank's shard only
    model = mlp(config.seed, config.hidden).to(device)  # same seed on every rank (and DDP broadcasts rank 0's)
    if config.strategy == "ddp":  # a whole copy per rank; its gradients are averaged in backward()
        model = DistributedDataParallel(model, device_ids=ddp_device_ids(device))
    else:  # FSDP: each rank keeps its shards
        model = shard_model(model)
    optimizer = build_optimizer(model, config)  # under FSDP built on the shards: its state is sharded too
    return model, optimizer, sampler, loader, val_set


def train_ddp(config: TrainConfig, rank: int, world_size: int, device: torch.device) -> list[dict]:
    """One rank's training run, in a process group already set up; returns the history (on every rank).

    `config.strategy` 'ddp' wraps the model in DistributedDataParallel; 'fsdp' shards it with fully_shard
    (helpers.workers.fsdp.shard_model). The loop is the same: only what backward() communicates differs.
    """
    model, optimizer, sampler, loader, val_set = rank_setup(config, rank, world_size, device)
    loss_fn = nn.CrossEntropyLoss()
    print_rank0(
        f"world_size={world_size} backend={dist.get_backend()} device={device.type} strategy={config.strategy} "
        f"batch={config.batch_size}/rank ({world_size * config.batch_size} per step) steps/epoch={len(loader)}",
        flush=True,
    )
    bar = progress_bar(total=config.epochs * len(loader), desc=config.strategy, unit="step",
                       enabled=config.progress and rank == 0)  # fmt: skip  # one bar, not one per rank
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
            bar.update(1)
        seconds = time.perf_counter() - start
        train = all_reduce_metrics({"loss_sum": float(loss_sum), "samples": samples})  # sums over ranks
        val = evaluate_sharded(unwrap_model(model), val_set, device, rank, world_size)
        history.append({"epoch": epoch + 1, "train_loss": train["loss_sum"] / train["samples"], "val_loss": val["loss"],
                        "val_accuracy": val["accuracy"], "seconds": seconds, "samples_seen": int(train["samples"])})  # fmt: skip
        print_rank0(f"epoch {epoch + 1}: train_loss={history[-1]['train_loss']:.4f} val_loss={val['loss']:.4f} "
                    f"val_accuracy={val['accuracy']:.4f} ({seconds:.2f} s)", flush=True)  # fmt: skip
    bar.close()
    save_run(model, optimizer, config, rank, world_size, history, steps=config.epochs * len(loader))
    return history


def save_run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    rank: int,
    world_size: int,
    history: list[dict],
    *,
    steps: int,
) -> None:
    """Rank 0 writes model.pt (a file a plain model loads) and history.json into config.out; every rank calls it."""
    # DDP's model.module (no "module." prefix), or FSDP's shards gathered on rank 0 (a collective: all ranks)
    whole = (
        (unwrap_model(model), optimizer) if config.strategy == "ddp" else gather_whole(model, optimizer, config, rank)
    )
    if rank == 0 and config.out and whole is not None:  # one writer: N ranks writing one file would race
        record = {"world_size": world_size, "backend": dist.get_backend(), "strategy": config.strategy}
        path = save_checkpoint(
            Path(config.out) / "model.pt",
            *whole,
            epoch=config.epochs,
            step=steps,
            metric=history[-1]["val_accuracy"],
            extra={**record, "config": asdict(config), "history": history},
        )
        Path(config.out, "history.json").write_text(
            json.dumps({**record, "config": asdict(config), "history": history}, indent=1)
        )
        print_rank0(f"saved {path}", flush=True)
    dist.barrier()  # nobody leaves before rank 0 has written its files


def gather_whole(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, rank: int
) -> tuple[nn.Module, torch.optim.Optimizer] | None:
    """The sharded model and optimizer gathered into a plain model and optimizer on rank 0 (None elsewhere).

    Every rank must call it (gathering is a collective); the result loads into a plain MLP like a DDP run's file."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if rank != 0:
        return None
    plain = mlp(config.seed, config.hidden)
    plain.load_state_dict(model_state)
    plain_optimizer = build_optimizer(plain, config)
    set_optimizer_state_dict(plain, plain_optimizer, optimizer_state)
    return plain, plain_optimizer


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
    model = mlp(config.seed, config.hidden)  # the same starting weights as every rank
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
