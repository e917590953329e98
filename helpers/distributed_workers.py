"""What each rank runs in notebook 05 (multi-GPU), and the notebook's experiment.

Spawned processes import their function by name, so rank code lives in this module, never in a
notebook. Every worker is called as worker(rank, world_size, *args) by helpers.distributed.launch,
with the default process group already set up, and returns plain values or tensors.
"""
from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from .data import DigitsDataset
from .distributed import GlobalBatchSampler, all_reduce_metrics, rank_device, run_torchrun
from .cli.train_ddp import TrainConfig, build_model, build_optimizer
from .knobs import int_range, log_float

FAILURE_MODES = ("raise", "exit", "hang")

SPEC = {  # the knobs of run_experiment
    "world_size": int_range(2, 4, 1, "ranks (processes)"),
    "batch_per_rank": int_range(8, 128, 8, "batch per rank"),
    "epochs": int_range(1, 20, 1, "epochs"),
    "lr": log_float(1e-3, 0.5, "learning rate"),
    "seed": int_range(0, 10000, 1, "seed"),
    "timeout_s": int_range(30, 600, 10, "timeout (s)"),
}


def _device() -> torch.device:
    return rank_device(dist.get_backend(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))


# ---------------------------------------------------------------- who is who, and the init methods

def describe_rank(rank: int, world_size: int) -> dict:
    """This rank's view of the group, and the sum of all rank numbers computed with one all_reduce."""
    total = torch.tensor([float(rank)], device=_device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "pid": os.getpid(), "local_rank": int(os.environ.get("LOCAL_RANK", -1)), "device": str(_device()),
            "torch_threads": torch.get_num_threads(), "sum_of_ranks": float(total.item())}


# ---------------------------------------------------------------- point-to-point and collectives

def payload_for(seed: int, destination: int) -> torch.Tensor:
    """The tensor rank 0 sends to `destination`: 4 seeded random numbers, so the receiver can be checked."""
    generator = torch.Generator().manual_seed(seed * 1000 + destination)
    return torch.randn(4, generator=generator)


def contribution_of(seed: int, rank: int) -> torch.Tensor:
    """What `rank` puts into the all_reduce: 4 seeded random numbers of its own."""
    generator = torch.Generator().manual_seed(seed * 1000 + 500 + rank)
    return torch.randn(4, generator=generator)


def send_recv_worker(rank: int, world_size: int, seed: int) -> dict:
    """Point-to-point: rank 0 sends each other rank its own tensor with dist.send; they dist.recv it."""
    device = _device()
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
    reduced = mine.clone().to(_device())
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)  # in place, on every rank
    metric = all_reduce_metrics({"value": float(mine.sum())}, average=True)
    return {"rank": rank, "contribution": mine, "reduced": reduced, "mean_of_sums": metric["value"]}


def communication_worker(rank: int, world_size: int, seed: int) -> dict:
    """send_recv_worker, then all_reduce_worker, in one run (one process start-up instead of two)."""
    return {"send_recv": send_recv_worker(rank, world_size, seed),
            "all_reduce": all_reduce_worker(rank, world_size, seed)}


def sampler_worker(rank: int, world_size: int, dataset_size: int, seed: int) -> dict:
    """The indices DistributedSampler gives this rank: epoch 0, epoch 0 again without set_epoch, epoch 1."""
    sampler = DistributedSampler(range(dataset_size), shuffle=True, seed=seed)  # rank, world from the group
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
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu()
                      for p in model.parameters()])


def gradient_batch(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`samples` digits (images, labels) drawn without repetition from the training split by `seed`."""
    dataset = DigitsDataset("train")
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= len(dataset):
        raise ValueError(f"samples must be an int in [1, {len(dataset)}], got {samples!r}")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:samples]
    return dataset.images[order], dataset.targets[order]


def gradient_model(seed: int) -> nn.Module:
    """The model whose gradients the checks compare (same weights for the same seed, in any process)."""
    return build_model(TrainConfig(seed=seed))


def full_batch_gradient(seed: int, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The single-process reference: the gradient of the mean loss over the whole batch."""
    model = gradient_model(seed)
    nn.functional.cross_entropy(model(inputs), targets).backward()
    return flat_gradient(model)


def gradients_worker(rank: int, world_size: int, seed: int, batch_size: int) -> dict:
    """One rank's gradients: hand-averaged, from DDP, and under no_sync then after a synchronising step.

    The global batch is gradient_batch(seed, 2 * world_size * batch_size). Micro-batch 0 of rank r is
    rows [r*B, (r+1)*B); micro-batch 1 is the same slice of the second half.
    """
    device = _device()
    inputs, targets = gradient_batch(seed, 2 * world_size * batch_size)
    inputs, targets = inputs.to(device), targets.to(device)
    half = world_size * batch_size
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    second = slice(half + rank * batch_size, half + (rank + 1) * batch_size)
    loss_fn = nn.CrossEntropyLoss()
    model = gradient_model(seed).to(device)  # same seed: the same starting weights on every rank

    by_hand = copy.deepcopy(model)
    loss_fn(by_hand(inputs[mine]), targets[mine]).backward()
    local = flat_gradient(by_hand)  # this rank's own gradient, before any communication
    average_gradients(by_hand)

    ddp = DistributedDataParallel(copy.deepcopy(model), device_ids=[device.index] if device.type == "cuda" else None)
    loss_fn(ddp(inputs[mine]), targets[mine]).backward()  # DDP averages during backward

    accumulating = DistributedDataParallel(copy.deepcopy(model),
                                           device_ids=[device.index] if device.type == "cuda" else None)
    with accumulating.no_sync():  # micro-batch 1 of 2: gradients stay local
        (loss_fn(accumulating(inputs[mine]), targets[mine]) / 2).backward()
    under_no_sync = flat_gradient(accumulating.module)
    (loss_fn(accumulating(inputs[second]), targets[second]) / 2).backward()  # micro-batch 2: all-reduce now
    return {"rank": rank, "local": local, "by_hand": flat_gradient(by_hand), "ddp": flat_gradient(ddp.module),
            "under_no_sync": under_no_sync, "after_sync": flat_gradient(accumulating.module)}


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


# ---------------------------------------------------------------- the experiment

class ExperimentResult(dict):
    """run_experiment's results: a dict, shown as one line (a knob panel would otherwise print every weight)."""

    def __repr__(self) -> str:
        ddp, single = self["ddp"][-1], self["single"][-1]
        return (f"ExperimentResult(DDP test accuracy {ddp['test_accuracy']:.4f}, one process "
                f"{single['test_accuracy']:.4f}, weights {self['max_weight_difference']:.1e} apart; "
                f"keys {sorted(self)})")


def train_single_process(config: TrainConfig, world_size: int) -> tuple[list[dict], nn.Module]:
    """One process, batch world_size * batch_size, following exactly the batches a DDP run would see."""
    from .loop import evaluate, train_epoch

    train_set, test_set = DigitsDataset("train"), DigitsDataset("test")
    batches = GlobalBatchSampler(len(train_set), world_size, config.batch_size, seed=config.seed)
    loader = DataLoader(train_set, batch_sampler=batches)
    test_loader = DataLoader(test_set, batch_size=256)
    model = build_model(config)
    optimizer = build_optimizer(model, config)
    loss_fn = nn.CrossEntropyLoss()
    history = []
    for epoch in range(config.epochs):
        batches.set_epoch(epoch)
        train = train_epoch(model, loader, optimizer, loss_fn, device="cpu", progress=False)
        test = evaluate(model, test_loader, loss_fn, device="cpu")
        history.append({"epoch": epoch + 1, "train_loss": train["loss"], "test_loss": test["loss"],
                        "test_accuracy": test["accuracy"], "seconds": train["seconds"]})
    return history, model


def run_experiment(world_size: int = 2, batch_per_rank: int = 32, epochs: int = 3, lr: float = 0.05,
                   seed: int = 0, *, timeout_s: float = 300.0, show: bool = True) -> dict:
    """Train with DDP under torchrun, and as one process on the same global batches; compare the two.

    Also trains one process with batch `batch_per_rank` (the per-rank batch, not the effective one) to
    show that the effective batch is what must match. The one-process runs use one torch thread, as
    each rank does. Returns the histories, the largest weight difference between the DDP and
    single-process models, rank 0's checkpointed weights, and torchrun's output and wall time.
    """
    config = TrainConfig(epochs=epochs, batch_size=batch_per_rank, lr=lr, seed=seed, progress=False)
    with tempfile.TemporaryDirectory(prefix="ddp-run-") as out:
        start = time.perf_counter()
        output = run_torchrun("helpers.cli.train_ddp", [
            "--epochs", epochs, "--batch-size", batch_per_rank, "--lr", lr, "--seed", seed,
            "--hidden", *config.hidden, "--out", out, "--no-progress",
            "--timeout-s", timeout_s], nproc_per_node=world_size, timeout_s=timeout_s)
        torchrun_seconds = time.perf_counter() - start
        ddp = json.loads(Path(out, "history.json").read_text())
        # weights_only=True: tensors and plain values only; map_location: a GPU run's file loads on the CPU
        ddp_weights = torch.load(Path(out, "model.pt"), map_location="cpu", weights_only=True)["model"]
    start_weights = {name: value.clone() for name, value in build_model(config).state_dict().items()}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank: tiny ops on busy cores run faster on one thread
    try:
        same_batches, model = train_single_process(config, world_size)
        per_rank_batch, _ = train_single_process(config, 1)
    finally:
        torch.set_num_threads(threads_before)
    weight_gap = max(float((ddp_weights[name] - value).abs().max()) for name, value in model.state_dict().items())
    weight_change = max(float((start_weights[name] - value).abs().max()) for name, value in model.state_dict().items())
    result = ExperimentResult(
        ddp=ddp["history"], single=same_batches, single_small_batch=per_rank_batch, max_weight_difference=weight_gap,
        max_weight_change=weight_change, torchrun_output=output, torchrun_seconds=torchrun_seconds,
        world_size=world_size, batch_per_rank=batch_per_rank, backend=ddp["backend"], checkpoint=ddp_weights)
    if show:
        show_experiment(result)
    return result


def show_experiment(result: dict) -> None:
    """Print the side-by-side table and plot test accuracy per epoch for the three runs."""
    import matplotlib.pyplot as plt

    from .plots import line_chart

    world_size, batch = result["world_size"], result["batch_per_rank"]
    names = {"ddp": f"DDP ({result['backend']}) {world_size} ranks x {batch}",
             "single": f"1 process x {world_size * batch}, same batches",
             "single_small_batch": f"1 process x {batch}"}
    header = f"{'epoch':>5} | " + " | ".join(f"{name:>34}" for name in names.values())
    print("test accuracy (seconds of training in that epoch)")
    print(header)
    print("-" * len(header))
    for index, row in enumerate(result["ddp"]):
        cells = [f"{result[key][index]['test_accuracy']:.4f} ({result[key][index]['seconds']:.2f} s)"
                 for key in names]
        print(f"{row['epoch']:>5} | " + " | ".join(f"{cell:>34}" for cell in cells))
    print(f"largest weight difference, DDP vs 1 process on the same batches: {result['max_weight_difference']:.2e} "
          f"(largest change of a weight during training: {result['max_weight_change']:.2e})")
    training = sum(row["seconds"] for row in result["ddp"])
    print(f"torchrun run: {result['torchrun_seconds']:.1f} s wall, of which {training:.2f} s training on rank 0 "
          "(the rest: starting Python and torch in every process, rendezvous, loading data, evaluating)")
    epochs = [row["epoch"] for row in result["ddp"]]
    line_chart(epochs, {name: [row["test_accuracy"] for row in result[key]] for key, name in names.items()},
               xlabel="epoch", ylabel="test accuracy", title="DDP and its single-process twin")
    plt.show()


def parallelism_diagram():
    """A picture of one training step under DataParallel and under DDP, lane by lane."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    colours = {"compute": "tab:blue", "copy": "tab:orange", "comm": "tab:green", "host": "tab:gray"}
    lanes = {
        "DataParallel: 1 process, threads": [
            ("GPU 0", [(0, 1.0, "scatter batch", "copy"), (1.0, 1.0, "copy weights", "copy"),
                       (2.0, 1.5, "forward", "compute"), (3.5, 1.0, "gather out", "copy"),
                       (4.5, 0.8, "loss", "compute"), (5.3, 1.5, "backward", "compute"),
                       (6.8, 1.0, "sum grads", "copy"), (7.8, 0.7, "step", "compute")]),
            ("GPU 1", [(2.0, 1.5, "forward", "compute"), (5.3, 1.5, "backward", "compute")]),
        ],
        "DistributedDataParallel: 1 process per GPU": [
            (f"rank {rank} / GPU {rank}", [(0, 0.9, "own batch", "host"), (0.9, 1.5, "forward", "compute"),
                                           (2.4, 0.6, "loss", "compute"), (3.0, 1.8, "backward", "compute"),
                                           (3.5, 1.6, "all-reduce", "comm"), (5.1, 0.7, "step", "compute")])
            for rank in (0, 1)
        ],
    }
    figure, axes = plt.subplots(2, 1, figsize=(9, 3.8), sharex=True)
    for ax, (title, rows) in zip(axes, lanes.items()):
        for y, (lane, boxes) in enumerate(reversed(rows)):
            for start, width, label, kind in boxes:
                # the all-reduce runs under the backward pass (same time, its own band)
                if kind == "comm":
                    bottom, height = y - 0.38, 0.3
                elif lane.startswith("rank"):  # leave room below for the all-reduce band
                    bottom, height = y - 0.05, 0.4
                else:
                    bottom, height = y - 0.3, 0.6
                ax.add_patch(FancyBboxPatch((start + 0.03, bottom), width - 0.06, height,
                                            boxstyle="round,pad=0.0,rounding_size=0.06", color=colours[kind],
                                            alpha=0.85))
                ax.text(start + width / 2, bottom + height / 2, label, ha="center", va="center", fontsize=7.5,
                        color="white")
        ax.set_yticks(range(len(rows)), [lane for lane, _ in reversed(rows)])
        ax.set_ylim(-0.5, len(rows) - 0.5)
        ax.set_title(title, fontsize=10, loc="left")
        ax.spines[["top", "right"]].set_visible(False)
    axes[-1].set_xlim(0, 8.6)
    axes[-1].set_xlabel("time within one training step (schematic)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.85) for c in colours.values()]
    figure.legend(handles, ["compute", "copy through GPU 0", "all-reduce (overlaps backward)", "data loading"],
                  loc="lower center", ncol=4, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    return figure
