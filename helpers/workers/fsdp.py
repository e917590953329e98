"""What the ranks of notebook 09 run around the lesson: FSDP2 (`fully_shard`) beside DDP, their collectives
counted, and distributed checkpoints.

The lesson itself, how a model is sharded and the training step, is a cell of notebook 09 that writes the module
the ranks import (`lesson_fsdp.py`); its workers call the ones here with its own `shard` and `train` functions,
so an edit in that cell changes what the ranks compute. `shard_model` and `train_steps` below are the same two
functions for everything else: the defaults of these workers, the tests, and the training run of
`torchrun -m helpers.cli.train_ddp --strategy fsdp` (helpers.workers.training).

helpers.processes.launch calls each worker as worker(rank, world_size, *args) with the default process
group already set up. `lesson_worker` runs the step under DDP and FSDP on the same batches, counts what each
step sends, and saves a distributed checkpoint (torch.distributed.checkpoint) that `load_worker` and
`load_checkpoint_here` read back into any number of processes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.checks import check_int, check_positive_number
from helpers.compat import fsdp2_runs_on
from helpers.memory import saved_tensors_meter

from .common import ddp_device_ids, gradient_batch, local_device, mlp

# The collectives FSDP2 and DDP issue, as the dispatcher names them, and what the lesson calls them.
COLLECTIVES = {"_allgather_base_": "all-gather", "_reduce_scatter_base_": "reduce-scatter", "allreduce_": "all-reduce"}


def shard_model(model: nn.Module, *, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """fully_shard every Linear (a block: one all-gather and one reduce-scatter of its own), then the root."""
    return shard_blocks(model, [module for module in model.modules() if isinstance(module, nn.Linear)], mp_policy)


def shard_blocks(
    model: nn.Module, blocks: Iterable[nn.Module], mp_policy: MixedPrecisionPolicy | None = None
) -> nn.Module:
    """fully_shard each of `blocks` (each then gathers and scatters on its own), then the root, which keeps the
    rest in one unit: a GPT's tied embedding and output matrix must stay together, so its blocks are the units.

    Refuses, with the torch release it needs, a model on a device this torch's FSDP2 cannot shard (helpers.compat)."""
    device = next(model.parameters()).device
    runs, why = fsdp2_runs_on(device.type)
    if not runs:
        raise RuntimeError(why)
    # The ranks' mesh on the model's own device: FSDP2's default is the accelerator's, so on a machine with one GPU
    # it would move the shards of CPU ranks (gloo) to CUDA, where gloo cannot gather them.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for block in list(blocks):
        fully_shard(block, **options)
    fully_shard(model, **options)  # the root: whatever is left, and the hooks that start the first all-gather
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards only), and their total."""
    params = list(model.parameters())
    sizes = {
        "parameters": sum(local(p).nbytes for p in params),
        "gradients": sum(local(p.grad).nbytes for p in params if p.grad is not None),
        "optimizer state": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            sizes["optimizer state"] += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor))
    sizes["total"] = sum(sizes.values())
    return sizes


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU: DTensors gathered from all ranks (a collective: every rank calls it)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for name, p in model.named_parameters()
    }


class CollectiveCounter(TorchDispatchMode):
    """Notes every all-gather, reduce-scatter and all-reduce that passes the dispatcher, with its full buffer's bytes.

    `calls` holds (kind, bytes), where bytes is the size of the unsharded buffer (an all-gather's output, a
    reduce-scatter's input). In a ring, each rank sends (world - 1) / world of that, and receives as much.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = COLLECTIVES.get(func._schema.name.split("::")[-1]) if func.namespace == "c10d" else None
        if kind is not None:
            tensors = [t for t in _flat(args) if isinstance(t, torch.Tensor)]
            self.calls.append((kind, max(t.nbytes for t in tensors)))
        return func(*args, **(kwargs or {}))


def _flat(values: Iterable[Any]) -> list[Any]:
    flat = []
    for value in values:
        flat.extend(_flat(value) if isinstance(value, (list, tuple)) else [value])
    return flat


def counting_allreduce_hook(calls, bucket):  # DDP refuses a hook whose annotations are not its own types
    """A DDP communication hook: note ("all-reduce", bytes) in `calls` for each bucket, then average it as DDP does."""
    buffer = bucket.buffer()
    calls.append(("all-reduce", buffer.nbytes))
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def step_batches(seed: int, steps: int, samples_per_step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of digits (images, labels), drawn without repetition by `seed` (as gradient_batch)."""
    check_int("steps", steps)
    check_int("samples_per_step", samples_per_step)
    inputs, targets = gradient_batch(seed, steps * samples_per_step)
    return list(zip(inputs.split(samples_per_step), targets.split(samples_per_step), strict=True))


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    rank: int = 0,
    world_size: int = 1,
) -> list[float]:
    """The ordinary training step on this rank's equal slice of each global batch; returns the local losses."""
    losses = []
    device = next(model.parameters()).device
    for inputs, targets in batches:
        mine = slice(rank * len(targets) // world_size, (rank + 1) * len(targets) // world_size)
        loss = nn.functional.cross_entropy(model(inputs[mine].to(device)), targets[mine].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces here; FSDP reduce-scatters each block's gradients here
        optimizer.step()  # FSDP: each rank updates only its shard (and keeps only its shard of AdamW's state)
        losses.append(float(loss.detach()))
    return losses


def adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The lesson's optimizer: AdamW (two state tensors per parameter, so sharding them matters)."""
    check_positive_number("lr", lr)
    return torch.optim.AdamW(model.parameters(), lr=lr)


Shard = Callable[..., nn.Module]  # shard_model's signature: (model, *, mp_policy=None) -> the sharded model
Train = Callable[..., list[float]]  # train_steps' signature: (model, optimizer, batches, rank, world_size) -> losses


def parity_worker(
    rank: int,
    world_size: int,
    seed: int,
    hidden: Sequence[int],
    steps: int,
    batch_per_rank: int,
    lr: float,
    *,
    shard: Shard = shard_model,
    train: Train = train_steps,
) -> dict:
    """DDP and FSDP from the same weights, the same steps on the same batches: shards, bytes, collectives, weights.

    `shard` shards the FSDP model, `train` takes the steps of both (notebook 09 passes its own)."""
    device = local_device()
    batches = step_batches(seed, steps, world_size * batch_per_rank)
    ddp_calls: list = []
    ddp = DistributedDataParallel(mlp(seed, hidden).to(device), device_ids=ddp_device_ids(device))
    ddp.register_comm_hook(ddp_calls, counting_allreduce_hook)
    ddp_optimizer = adamw(ddp, lr)
    train(ddp, ddp_optimizer, batches[:1], rank, world_size)
    first_step_ddp = list(ddp_calls)
    train(ddp, ddp_optimizer, batches[1:], rank, world_size)

    fsdp = shard(mlp(seed, hidden).to(device))
    shards = {name: (tuple(p.shape), tuple(local(p).shape)) for name, p in fsdp.named_parameters()}
    fsdp_optimizer = adamw(fsdp, lr)
    with CollectiveCounter() as counter:
        losses = train(fsdp, fsdp_optimizer, batches[:1], rank, world_size)
    losses += train(fsdp, fsdp_optimizer, batches[1:], rank, world_size)
    return {
        "rank": rank,
        "shards": shards,
        "state_dict": {
            name: (type(value).__name__, tuple(local(value).shape)) for name, value in fsdp.state_dict().items()
        },
        "fsdp_bytes": held_bytes(fsdp, fsdp_optimizer),
        "ddp_bytes": held_bytes(ddp.module, ddp_optimizer),
        "fsdp_calls": counter.calls,
        "ddp_calls": first_step_ddp,
        "losses": losses,
        "fsdp_weights": full_weights(fsdp),
        "ddp_weights": full_weights(ddp.module),
    }


def mixed_precision_worker(
    rank: int,
    world_size: int,
    seed: int,
    hidden: Sequence[int],
    batch_per_rank: int,
    *,
    shard: Shard = shard_model,
    train: Train = train_steps,
) -> dict:
    """One step under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): the dtypes, the bytes gathered."""
    device = local_device()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(mlp(seed, hidden).to(device), mp_policy=policy)
    optimizer = adamw(model, 1e-3)
    seen: dict[str, torch.dtype] = {}
    block = next(module for module in model.modules() if isinstance(module, nn.Linear))
    block.register_forward_pre_hook(lambda module, args: seen.update(weight=module.weight.dtype, inputs=args[0].dtype))
    with CollectiveCounter() as counter:
        train(model, optimizer, step_batches(seed, 1, world_size * batch_per_rank), rank, world_size)
    gradient = block.weight.grad
    assert gradient is not None  # the step leaves the last step's gradients in place
    return {
        "computed in": {"weight": seen["weight"], "inputs": seen["inputs"]},
        "stored as": {"parameter shard": local(block.weight).dtype, "gradient shard": local(gradient).dtype},
        "calls": counter.calls,
    }


def memory_worker(
    rank: int, world_size: int, shapes: Sequence[tuple[Sequence[int], int]], *, shard: Shard = shard_model
) -> list[dict]:
    """Per rank, for each (hidden widths, batch per rank): model state held under DDP and FSDP, and activations."""
    device = local_device()
    rows = []
    for hidden, batch in shapes:
        inputs, targets = torch.randn(batch, 64, device=device), torch.randint(0, 10, (batch,), device=device)
        row: dict[str, Any] = {"hidden": list(hidden), "batch": batch}
        for strategy in ("ddp", "fsdp"):
            model = mlp(0, hidden).to(device)  # the state a DDP rank keeps: whole tensors (the wrapper adds none)
            model = shard(model) if strategy == "fsdp" else model
            optimizer = adamw(model, 1e-3)
            with saved_tensors_meter() as meter:  # what autograd keeps for backward: this rank's activations
                loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            row[f"{strategy} state"], row[f"{strategy} activations"] = (
                held_bytes(model, optimizer)["total"],
                meter.bytes,
            )
        row["params"] = sum(p.numel() for p in model.parameters())
        rows.append(row)
    return rows


def save_worker(
    rank: int,
    world_size: int,
    seed: int,
    hidden: Sequence[int],
    steps: int,
    batch_per_rank: int,
    lr: float,
    path: str,
    *,
    shard: Shard = shard_model,
    train: Train = train_steps,
) -> dict:
    """Train a sharded MLP `steps` steps, save it with torch.distributed.checkpoint into `path`; return its state whole."""
    model, optimizer = trained_fsdp(seed, hidden, steps, batch_per_rank, lr, rank, world_size, shard=shard, train=train)
    save_sharded(model, optimizer, path)
    return full_state(model, optimizer)


def lesson_worker(
    rank: int,
    world_size: int,
    seed: int,
    hidden: Sequence[int],
    steps: int,
    batch_per_rank: int,
    lr: float,
    shapes: Sequence[tuple[Sequence[int], int]],
    path: str,
    *,
    shard: Shard = shard_model,
    train: Train = train_steps,
) -> dict:
    """parity_worker, mixed_precision_worker, memory_worker and save_worker in one launch (one start-up, not four),
    every model sharded by `shard` and trained by `train`."""
    return {
        **parity_worker(rank, world_size, seed, hidden, steps, batch_per_rank, lr, shard=shard, train=train),
        "mixed_precision": mixed_precision_worker(
            rank, world_size, seed, hidden, batch_per_rank, shard=shard, train=train
        ),
        "memory": memory_worker(rank, world_size, shapes, shard=shard),
        "saved": save_worker(rank, world_size, seed, hidden, steps, batch_per_rank, lr, path, shard=shard, train=train),
    }


# ---------------------------------------------------------------- distributed checkpoints (torch.distributed.checkpoint)


def trained_fsdp(
    seed: int,
    hidden: Sequence[int],
    steps: int,
    batch_per_rank: int,
    lr: float,
    rank: int,
    world_size: int,
    *,
    shard: Shard = shard_model,
    train: Train = train_steps,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded MLP and its AdamW after `steps` steps (the batches of parity_worker)."""
    model = shard(mlp(seed, hidden).to(local_device()))
    optimizer = adamw(model, lr)
    train(model, optimizer, step_batches(seed, steps, world_size * batch_per_rank), rank, world_size)
    return model, optimizer


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Every rank writes its own shards of model and optimizer (and rank 0 the metadata) into folder `path`."""
    model_state, optimizer_state = get_state_dict(model, optimizer)  # keys by parameter name, values sharded
    with _one_process_is_intended():
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Read a save_sharded folder into this model and optimizer, however many ranks wrote it and however many read."""
    if not Path(path, ".metadata").is_file():
        raise FileNotFoundError(
            f"no distributed checkpoint in {path}: its .metadata file (written by rank 0) is missing"
        )
    model_state, optimizer_state = get_state_dict(model, optimizer)  # the layout to fill: each rank's own shards
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    with _one_process_is_intended():
        dcp.load(state, checkpoint_id=str(path))  # each rank reads the bytes of its own shards, in place
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Without a process group DCP reads and writes as a single process, and warns that it assumes so: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a single process")
        yield


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Model and optimizer state whole, on the CPU, keyed by parameter name (a collective under FSDP)."""
    options = StateDictOptions(full_state_dict=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    whole = {"model": model_state, "optimizer": optimizer_state}
    return _to_cpu(whole)


class WholeModel(nn.Module):
    """An FSDP-sharded model as a one-file checkpoint (helpers.checkpoint) sees it: its state dict whole, keyed as
    the plain model's, and loaded back into each rank's shards. `gather()` is a collective: every rank calls it
    before a save (rank 0 writes) or a load (each rank reads the file, then keeps its own shards)."""

    sharded: nn.Module

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "sharded", model)  # not a submodule: its parameters stay out of this view's
        self.gathered: dict[str, Any] | None = None

    def gather(self) -> None:
        """Every rank: all-gather the shards; each rank then holds the whole state dict."""
        self.gathered = get_model_state_dict(self.sharded, options=StateDictOptions(full_state_dict=True))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        if self.gathered is None:
            raise RuntimeError("WholeModel.state_dict: call gather() on every rank first (it is a collective)")
        return self.gathered

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Every rank: keep its own shards of the whole `state_dict`."""
        set_model_state_dict(self.sharded, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))
        self.gathered = None


class WholeOptimizer:
    """The optimizer of an FSDP-sharded model, seen whole as WholeModel sees the model (keys by parameter name)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.gathered: dict[str, Any] | None = None

    def gather(self) -> None:
        """Every rank: all-gather the optimizer state's shards."""
        options = StateDictOptions(full_state_dict=True)
        self.gathered = get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def state_dict(self) -> dict[str, Any]:
        if self.gathered is None:
            raise RuntimeError("WholeOptimizer.state_dict: call gather() on every rank first (it is a collective)")
        return self.gathered

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Every rank: keep its own shards of the whole optimizer state."""
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state_dict, options=options)
        self.gathered = None


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value


def load_worker(
    rank: int, world_size: int, seed: int, hidden: Sequence[int], lr: float, path: str, *, shard: Shard = shard_model
) -> dict:
    """A fresh model sharded by `shard` (other weights, no optimizer state) loads the folder; returns its state whole."""
    model = shard(mlp(seed + 1, hidden).to(local_device()))
    optimizer = adamw(model, lr)
    before = full_weights(model)
    load_sharded(model, optimizer, path)
    return {"before": before, "loaded": full_state(model, optimizer)}


def load_checkpoint_here(seed: int, hidden: Sequence[int], lr: float, path: str | Path) -> tuple[nn.Module, dict]:
    """The same folder loaded into one process, no process group: a plain MLP and AdamW; returns model, state."""
    model = mlp(seed + 1, hidden)
    optimizer = adamw(model, lr)
    load_sharded(model, optimizer, path)
    return model, full_state(model, optimizer)
