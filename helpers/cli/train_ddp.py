"""Train the course MLP on the digits with DistributedDataParallel (or FSDP2), one process per device; run it with torchrun.

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

`--strategy fsdp` shards the model, its gradients and its optimizer state over the ranks instead
(`fully_shard`, notebook 09); every command above takes it, e.g. on one machine:

    torchrun --standalone --nproc_per_node=2 -m helpers.cli.train_ddp --strategy fsdp --epochs 5 --out runs/fsdp

torchrun gives every process RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the script
reads them through init_process_group("env://"). Run without torchrun it trains as a world of one.
The training itself is helpers.workers.training.train_ddp, the step notebook 08 writes in a cell and checks against
this run (with --strategy
fsdp the same loop on a model sharded by helpers.workers.fsdp.shard_model): only rank 0 logs and writes the checkpoint (the
bare model's state_dict, without DDP's `module.` prefix; under FSDP the whole model, gathered from
the shards) and a history.json with one row of metrics per epoch. Either file loads into a plain MLP.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from helpers.compat import fsdp2_runs_on
from helpers.distributed import (
    default_backend,
    find_free_port,
    finish_run,
    rank_device,
    setup_process_group,
    teardown_process_group,
)
from helpers.workers.common import STRATEGIES, TrainConfig
from helpers.workers.training import train_ddp


def check_out_folder(config: TrainConfig, world_size: int, *, overwrite: bool = False) -> None:
    """Refuse to write over another run: when config.out holds a history.json of a run with other settings (or
    another number of ranks), a ValueError names each and both values, unless `overwrite`."""
    record = Path(config.out, "history.json") if config.out else None
    if overwrite or record is None or not record.is_file():
        return
    saved = json.loads(record.read_text())
    asked = {**config.shaping(), "world_size": world_size}
    was = {**{name: saved["config"].get(name) for name in config.shaping()}, "world_size": saved.get("world_size")}
    differing = [
        f"{name}: the folder's {was[name]!r}, asked {value!r}" for name, value in asked.items() if was[name] != value
    ]
    if differing:
        raise ValueError(
            f"--out {config.out} holds a run with other settings ({'; '.join(differing)}): "
            "pass --overwrite to replace it, or choose another --out"
        )


def train(config: TrainConfig, *, overwrite: bool = False) -> list[dict]:
    """Join the process group torchrun describes (or a world of one), run train_ddp, leave the group (a rank of
    several leaves it with its process: see finish_run). A folder config.out that holds another run's files is
    refused unless `overwrite` (check_out_folder)."""
    if "RANK" in os.environ:  # started by torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        rank, world_size, init_method = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://"
    else:  # started with plain python: a world of one, on a free local port
        rank, world_size, init_method = 0, 1, f"tcp://127.0.0.1:{find_free_port()}"
    check_out_folder(config, world_size, overwrite=overwrite)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = config.backend or default_backend(local_world)
    runs, why = fsdp2_runs_on(rank_device(backend, 0).type)
    if config.strategy == "fsdp" and not runs:  # before any process joins: a clear error, not one deep inside FSDP2
        raise ValueError(f"strategy='fsdp' on {backend} ranks: {why}")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # ranks share the cores
    device = setup_process_group(rank, world_size, backend=backend, init_method=init_method, timeout_s=config.timeout_s)
    try:
        history = train_ddp(config, rank, world_size, device)
    except BaseException:
        teardown_process_group()  # no barrier: a rank that failed would keep the others waiting there
        raise
    finally:
        torch.set_num_threads(threads_before)
    finish_run()  # every rank finished: a world of one leaves its group, a rank of several with its process
    return history


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, bool]:
    """Command-line arguments to a TrainConfig, and whether --overwrite was given."""
    parser = argparse.ArgumentParser(
        prog="torchrun --standalone --nproc_per_node=2 -m helpers.cli.train_ddp",
        description="Train the course MLP on the digits with DDP or FSDP2.",
    )
    parser.add_argument(
        "--strategy",
        choices=list(STRATEGIES),
        default="ddp",
        help="ddp: a whole model per rank; fsdp: parameters, gradients and optimizer state sharded (fully_shard)",
    )
    defaults = TrainConfig()
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="per rank")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--momentum", type=float, default=defaults.momentum)
    parser.add_argument("--hidden", type=int, nargs="+", default=list(defaults.hidden))
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", default=None, help="folder for model.pt and history.json (rank 0 writes them)")
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl", "mpi"],
        default=None,
        help="default: nccl with a GPU per local rank, else gloo",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=defaults.timeout_s, help="how long a collective may wait for the other ranks"
    )
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--overwrite", action="store_true", help="replace a run with other settings in --out")
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            momentum=args.momentum,
            hidden=tuple(args.hidden),
            seed=args.seed,
            strategy=args.strategy,
            out=args.out,
            backend=args.backend,
            timeout_s=args.timeout_s,
            progress=args.progress,
        )
    except ValueError as error:
        parser.error(str(error))
    return config, args.overwrite


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse the arguments and train."""
    config, overwrite = parse_args(argv)
    try:
        train(config, overwrite=overwrite)
    except ValueError as error:  # a folder holding another run, or FSDP2 where this torch cannot shard
        sys.exit(f"train_ddp: error: {error}")


if __name__ == "__main__":
    main()
    # The run is over: every rank passed the final barrier, and the files are written and closed. Leave
    # without destroy_process_group (see finish_run) and without the interpreter's shutdown, where PyTorch's C++ destructors now and then abort a rank
    # that finished cleanly ("terminate called without an active exception", exit code -6), which
    # torchrun would then report as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
