"""What every rank of notebooks 07, 08 and 09 and the torchrun script share: this rank's device, the seeded course MLP,
the digits a step uses, and the training run's settings. The modules that notebooks 08 and 09 write from a cell
(`lesson_ddp.py`, `lesson_fsdp.py`) import from here too.

helpers.workers.ddp (the ranks of notebooks 07 and 08), helpers.workers.fsdp (notebook 09's) and helpers.workers.training (the
training run of `torchrun -m helpers.cli.train_ddp`) import from here, and never from each other's level up:
common <- ddp, fsdp <- training.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Subset, random_split

from helpers.checks import check_choice, check_int, check_positive_number, check_range
from helpers.data import DigitsDataset
from helpers.distributed import rank_device
from helpers.models import MLP

STRATEGIES = ("ddp", "fsdp")  # a whole copy of the model per rank (DDP), or a shard per rank (FSDP2, notebook 09)


def local_device() -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK) under nccl, the CPU under gloo."""
    return rank_device(dist.get_backend(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))


def ddp_device_ids(device: torch.device) -> list[int] | None:
    """DistributedDataParallel's device_ids for a module on `device`."""
    return [device.index] if device.type == "cuda" else None  # DDP wants its GPU named, and no ids on the CPU


def mlp(seed: int, hidden: Sequence[int]) -> nn.Module:
    """The course MLP (64 inputs, 10 classes) with these hidden widths, initialised from `seed`: the same weights on
    every rank that passes the same seed."""
    torch.manual_seed(seed)  # torch takes any 64-bit seed
    return MLP(64, tuple(hidden), 10)


def gradient_batch(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`samples` digits (images, labels) drawn without repetition from the training split by `seed`."""
    dataset = DigitsDataset("train")
    check_int("samples", samples, maximum=len(dataset))
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:samples]
    return dataset.images[order], dataset.targets[order]


def train_validation_split(seed: int) -> list[Subset]:
    """The training digits split 80 / 20 into training and validation subsets, the same split for the same seed."""
    return random_split(DigitsDataset("train"), [0.8, 0.2], generator=torch.Generator().manual_seed(seed))


@dataclass
class TrainConfig:
    """What a run needs; batch_size is per rank, so the effective batch is world_size * batch_size. `strategy`
    'ddp' keeps a whole model per rank, 'fsdp' shards it (FSDP2)."""

    epochs: int = 3
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    hidden: tuple[int, ...] = (64,)
    seed: int = 0
    strategy: str = "ddp"
    out: str | None = None
    backend: str | None = None
    timeout_s: float = 120.0
    progress: bool = True

    def __post_init__(self) -> None:
        check_int("epochs", self.epochs)
        check_int("batch_size", self.batch_size)
        check_int("seed", self.seed, minimum=0)
        check_positive_number("lr", self.lr)
        check_range("momentum", self.momentum, 0, 1, high_open=True)
        check_choice("strategy", self.strategy, STRATEGIES)
        if not self.hidden or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.hidden):
            raise ValueError(f"hidden must be a non-empty tuple of positive ints, got {self.hidden!r}")

    def shaping(self) -> dict:
        """The settings that shape the run's result (not where it is written or how it reports)."""
        return {"epochs": self.epochs, "batch_size": self.batch_size, "lr": self.lr, "momentum": self.momentum,
                "hidden": list(self.hidden), "seed": self.seed, "strategy": self.strategy}  # fmt: skip


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD with momentum, built after the model is on its device (and, under FSDP, sharded)."""
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
