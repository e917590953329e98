"""Train the course MLP on the digits with DistributedDataParallel, one process per device; run it with torchrun.

One machine, 2 processes (CPU with gloo here; 2 GPUs with nccl, picked automatically):

    torchrun --standalone --nproc_per_node=2 -m helpers.cli.train_ddp --epochs 5 --out runs/ddp

Several machines, here 2 nodes with 4 GPUs each. Either a fixed rank per node (static rendezvous;
run on every node, with --node_rank=0 on the node at MASTER_ADDR and --node_rank=1 on the other):

    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \\
        -m helpers.cli.train_ddp --epochs 5
    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 \\
        -m helpers.cli.train_ddp --epochs 5

or the same command on every node, ranks handed out when the nodes meet (c10d rendezvous, which
also allows elastic ranges such as --nnodes=1:4 and restarts with --max_restarts):

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_id=digits42 --rdzv_backend=c10d \\
        --rdzv_endpoint=10.0.0.1:29400 -m helpers.cli.train_ddp --epochs 5

torchrun gives every process RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the script
reads them through init_process_group("env://"). Run without torchrun it trains as a world of one.
Only rank 0 logs and writes the checkpoint (the bare model's state_dict, without DDP's `module.`
prefix) and a history.json with one row of metrics per epoch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

from helpers.checkpoint import save_checkpoint, unwrap_model
from helpers.data import DigitsDataset
from helpers.distributed import (all_reduce_metrics, default_backend, find_free_port, print_rank0, setup_process_group,
                          teardown_process_group)
from helpers.models import MLP


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
        for name in ("epochs", "batch_size", "seed"):
            value = getattr(self, name)
            minimum = 0 if name == "seed" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if not isinstance(self.momentum, (int, float)) or not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if not self.hidden or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.hidden):
            raise ValueError(f"hidden must be a non-empty tuple of positive ints, got {self.hidden!r}")


def build_model(config: TrainConfig) -> nn.Module:
    """The course MLP, initialised from config.seed (so every rank starts from the same weights)."""
    torch.manual_seed(config.seed)
    return MLP(64, config.hidden, 10)


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD with momentum, built after the model is on its device."""
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)


def evaluate_sharded(model: nn.Module, dataset, device: torch.device, rank: int, world_size: int) -> dict:
    """Each rank scores every world_size-th test sample (no padding, no overlap); the sums are all-reduced."""
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
    return {"loss": totals["loss_sum"] / totals["samples"], "accuracy": totals["correct"] / totals["samples"],
            "samples": int(totals["samples"])}


def train(config: TrainConfig) -> list[dict]:
    """Run DDP training in this process (one rank of a torchrun job); return the history (on every rank)."""
    if "RANK" in os.environ:  # started by torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        rank, world_size, init_method = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://"
    else:  # started with plain python: a world of one, on a free local port
        rank, world_size, init_method = 0, 1, f"tcp://127.0.0.1:{find_free_port()}"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = config.backend or default_backend(local_world)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # ranks share the cores
    device = setup_process_group(rank, world_size, backend=backend, init_method=init_method,
                                 timeout_s=config.timeout_s)
    try:
        return _train(config, rank, world_size, device)
    finally:
        teardown_process_group()
        torch.set_num_threads(threads_before)


def _train(config: TrainConfig, rank: int, world_size: int, device: torch.device) -> list[dict]:
    train_set, test_set = DigitsDataset("train"), DigitsDataset("test")
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed)
    loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler)
    model = build_model(config).to(device)
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = build_optimizer(model, config)
    loss_fn = nn.CrossEntropyLoss()
    print_rank0(f"world_size={world_size} backend={dist.get_backend()} device={device.type} "
                f"batch={config.batch_size}/rank ({world_size * config.batch_size} per step) "
                f"steps/epoch={len(loader)}", flush=True)

    bar = None
    if config.progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.epochs * len(loader), desc="ddp", unit="step")
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
            loss.backward()  # DDP all-reduces (averages) the gradients during this call
            optimizer.step()
            loss_sum += loss.detach() * len(targets)  # no .item() per step: it would wait for the GPU
            samples += len(targets)
            if bar is not None:
                bar.update(1)
        seconds = time.perf_counter() - start
        train_totals = all_reduce_metrics({"loss_sum": float(loss_sum), "samples": samples})
        test = evaluate_sharded(unwrap_model(model), test_set, device, rank, world_size)
        row = {"epoch": epoch + 1, "train_loss": train_totals["loss_sum"] / train_totals["samples"],
               "test_loss": test["loss"], "test_accuracy": test["accuracy"], "seconds": seconds,
               "samples_seen": int(train_totals["samples"])}
        history.append(row)
        print_rank0(f"epoch {row['epoch']}: train_loss={row['train_loss']:.4f} test_loss={row['test_loss']:.4f} "
                    f"test_accuracy={row['test_accuracy']:.4f} ({seconds:.2f} s)", flush=True)
    if bar is not None:
        bar.close()
    if rank == 0 and config.out:  # one writer: N ranks writing one file would race
        out = Path(config.out)
        # unwrap_model(model) is model.module: its keys have no "module." prefix, so the file loads
        # into a plain model, with or without DDP.
        path = save_checkpoint(out / "model.pt", unwrap_model(model), optimizer, epoch=config.epochs,
                               step=config.epochs * len(loader), metric=history[-1]["test_accuracy"],
                               extra={"config": asdict(config), "world_size": world_size, "history": history})
        (out / "history.json").write_text(json.dumps(
            {"world_size": world_size, "backend": dist.get_backend(), "config": asdict(config),
             "history": history}, indent=1))
        print_rank0(f"saved {path}", flush=True)
    dist.barrier()  # nobody leaves before rank 0 has written its files
    return history


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Command-line arguments to a TrainConfig."""
    parser = argparse.ArgumentParser(prog="torchrun --standalone --nproc_per_node=2 -m helpers.cli.train_ddp",
                                     description="Train the course MLP on the digits with DDP.")
    defaults = TrainConfig()
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="per rank")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--momentum", type=float, default=defaults.momentum)
    parser.add_argument("--hidden", type=int, nargs="+", default=list(defaults.hidden))
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", default=None, help="folder for model.pt and history.json (rank 0 writes them)")
    parser.add_argument("--backend", choices=["gloo", "nccl", "mpi"], default=None,
                        help="default: nccl with a GPU per local rank, else gloo")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s,
                        help="how long a collective may wait for the other ranks")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    try:
        return TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                           hidden=tuple(args.hidden), seed=args.seed, out=args.out, backend=args.backend,
                           timeout_s=args.timeout_s, progress=args.progress)
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse the arguments and train."""
    train(parse_args(argv))


if __name__ == "__main__":
    main()
    # The run is over: the process group is destroyed and the files are written and closed. Leave
    # without the interpreter's shutdown, where PyTorch's C++ destructors now and then abort a rank
    # that finished cleanly ("terminate called without an active exception", exit code -6), which
    # torchrun would then report as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
