"""helpers.workers.fsdp: sharding each block and the root, local bytes, counted collectives, and (slow) the ranks of
notebook 09: shards of ⌈rows / world⌉ rows, about 1/world of the bytes each, and the weights DDP and one process reach."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from helpers import compat
from helpers.checkpoint import states_equal
from helpers.distributed import world_of_one
from helpers.memory import model_state_bytes
from helpers.processes import launch
from helpers.workers import fsdp as workers
from helpers.workers.common import gradient_batch

# FSDP2 on CPU ranks needs torch 2.7 (helpers.compat); on the floor torch these run where a GPU per rank exists
SHARDS_ON_CPU, NO_SHARDING_WHY = compat.fsdp2_runs_on("cpu")
needs_fsdp2_on_cpu = pytest.mark.skipif(not SHARDS_ON_CPU, reason=NO_SHARDING_WHY)


def test_mlp_is_seeded_and_has_the_lessons_size():
    model = workers.mlp(7, (128,))
    assert sum(p.numel() for p in model.parameters()) == 9610  # 64*128 + 128 + 128*10 + 10
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), workers.mlp(7, (128,)).parameters()))


@needs_fsdp2_on_cpu
def test_shard_model_wraps_every_linear_and_the_root_with_dtensor_parameters():
    with world_of_one(timeout_s=30):
        model = workers.shard_model(workers.mlp(0, (16, 8)))
        linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
        assert isinstance(model, FSDPModule) and len(linears) == 3
        assert all(isinstance(module, FSDPModule) for module in linears)
        for parameter in model.parameters():
            assert isinstance(parameter, DTensor) and parameter.placements == (Shard(0),)
            assert workers.local(parameter).shape == parameter.shape  # a world of one holds everything
        assert torch.equal(workers.local(torch.ones(2)), torch.ones(2))  # a plain tensor is its own "shard"


@needs_fsdp2_on_cpu
def test_shard_model_keeps_cpu_ranks_shards_on_the_cpu_even_where_an_accelerator_is_the_default(monkeypatch):
    """On a one-GPU machine FSDP2's default mesh is CUDA's, which gloo ranks cannot gather: every call gets a mesh
    of the model's own device (the cause of notebook 09's failure on an H100 with 2 ranks on gloo)."""
    calls = []
    real = workers.fully_shard
    monkeypatch.setattr(workers, "fully_shard", lambda module, **kwargs: calls.append(kwargs) or real(module, **kwargs))
    with world_of_one(timeout_s=30):
        model = workers.shard_model(workers.mlp(0, (16,)))
        assert all(call["mesh"].device_type == "cpu" for call in calls) and len(calls) == 3
        assert all(workers.local(p).device.type == "cpu" for p in model.parameters())


def test_held_bytes_of_a_plain_model_match_model_state_bytes():
    model = workers.mlp(0, (32,))
    optimizer = workers.adamw(model, 1e-3)
    workers.train_steps(model, optimizer, workers.step_batches(0, 1, 8))
    held, reference = workers.held_bytes(model, optimizer), model_state_bytes(model, optimizer)
    assert held["parameters"] == reference["parameters"] == held["gradients"]
    assert held["optimizer state"] == reference["optimizer_state"] == 2 * held["parameters"] + 4 * 4  # + step counters
    assert held["total"] == 4 * held["parameters"] + 16
    assert workers.held_bytes(workers.mlp(0, (32,)))["gradients"] == 0  # no gradients before backward


def test_collective_counter_notes_kind_and_full_buffer_bytes():
    with world_of_one(timeout_s=30), workers.CollectiveCounter() as counter:
        shard, whole = torch.ones(6), torch.empty(6)
        dist.all_gather_into_tensor(whole, shard)  # what FSDP2 calls for a block
        dist.reduce_scatter_tensor(torch.empty(6), torch.ones(6))
        dist.all_reduce(torch.ones(3))
        _ = torch.ones(3) + 1  # ordinary ops are not counted
    assert counter.calls == [("all-gather", 24), ("reduce-scatter", 24), ("all-reduce", 12)]


def test_counting_allreduce_hook_counts_the_bucket_and_keeps_ddp_gradients():
    batches = workers.step_batches(1, 1, 16)
    plain = workers.mlp(1, (32,))
    nn.functional.cross_entropy(plain(batches[0][0]), batches[0][1]).backward()
    with world_of_one(timeout_s=30):
        calls = []
        ddp = DistributedDataParallel(workers.mlp(1, (32,)))
        ddp.register_comm_hook(calls, workers.counting_allreduce_hook)
        nn.functional.cross_entropy(ddp(batches[0][0]), batches[0][1]).backward()
    assert calls == [("all-reduce", sum(p.nbytes for p in plain.parameters()))]  # one bucket: the whole model
    for mine, reference in zip(ddp.module.parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, reference.grad)


def test_counting_allreduce_hook_averages_over_a_world_of_two(monkeypatch):
    """In a world of one the division by the world size is invisible: two ranks' all-reduce, stood in for, must
    leave the mean of their gradients."""

    class Bucket:
        def __init__(self, values):
            self._buffer = torch.tensor(values)

        def buffer(self):
            return self._buffer

    other_rank = torch.tensor([4.0, 8.0])

    def all_reduce(buffer, async_op):  # the sum over both ranks, as gloo would leave it
        buffer.add_(other_rank / 2)  # the other rank divides by 2 before it sends, as this one does
        future = torch.futures.Future()
        future.set_result([buffer])
        return type("Work", (), {"get_future": lambda self: future})()

    monkeypatch.setattr(workers.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(workers.dist, "all_reduce", all_reduce)
    calls: list = []
    averaged = workers.counting_allreduce_hook(calls, Bucket([2.0, 4.0])).wait()
    assert torch.equal(averaged, torch.tensor([3.0, 6.0]))  # (2 + 4) / 2, (4 + 8) / 2
    assert calls == [("all-reduce", 8)]


def test_step_batches_are_seeded_and_never_repeat_a_sample():
    batches = workers.step_batches(3, 4, 10)
    assert [len(targets) for _, targets in batches] == [10] * 4 and batches[0][0].shape == (10, 1, 8, 8)
    inputs, targets = gradient_batch(3, 40)  # the first 40 of one seeded permutation of the training digits
    assert torch.equal(torch.cat([x for x, _ in batches]), inputs) and torch.equal(
        torch.cat([y for _, y in batches]), targets
    )
    assert not torch.equal(workers.step_batches(4, 4, 10)[0][0], batches[0][0])
    with pytest.raises(ValueError, match=r"samples must be an int in \[1, 1347\], got 10000"):
        workers.step_batches(0, 100, 100)


def test_train_steps_of_all_ranks_average_to_one_process_gradient():
    """Each rank's slice is an equal part of the global batch, so the mean of the ranks' gradients is one process's."""
    batches = workers.step_batches(2, 1, 12)
    whole = workers.mlp(2, (16,))
    workers.train_steps(whole, torch.optim.SGD(whole.parameters(), lr=0.0), batches)
    parts = []
    for rank in range(3):
        model = workers.mlp(2, (16,))
        workers.train_steps(model, torch.optim.SGD(model.parameters(), lr=0.0), batches, rank, 3)
        parts.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(torch.stack(parts).mean(0), torch.cat([p.grad.flatten() for p in whole.parameters()]))
    with pytest.raises(ValueError, match="lr must be a positive number"):
        workers.adamw(whole, 0)


def test_the_lesson_workers_shard_and_step_with_the_functions_notebook_07_gives_them(tmp_path):
    """Notebook 09's cell passes its own shard_model and train_steps: every model the workers build goes through them
    (here a `shard` that leaves the model whole, so this runs on any torch, in a world of one)."""
    options, steps = [], []

    def shard(model, **kwargs):
        options.append(kwargs)
        return model

    def train(model, optimizer, batches, rank=0, world_size=1):
        steps.append(len(batches))
        return workers.train_steps(model, optimizer, batches, rank, world_size)

    with world_of_one(timeout_s=60):
        result = workers.lesson_worker(0, 1, 0, (8,), 2, 4, 1e-2, [((8,), 4)], str(tmp_path), shard=shard, train=train)
        load = workers.load_worker(0, 1, 0, (8,), 1e-2, str(tmp_path), shard=shard)
    # parity (FSDP), mixed precision (with its policy), memory (one shape), the save, the load: five models
    assert len(options) == 5 and [sorted(kwargs) for kwargs in options].count(["mp_policy"]) == 1
    assert steps == [1, 1, 1, 1, 1, 2]  # DDP and FSDP: 1 step counted, then the rest; mixed precision; the save's 2
    assert len(result["losses"]) == 2 and states_equal(load["loaded"], result["saved"])


@pytest.mark.slow
@needs_fsdp2_on_cpu
def test_three_ranks_shard_rows_like_torch_chunk_and_end_where_ddp_and_one_process_end(tmp_path):
    world, seed, hidden, steps, batch, lr = 3, 5, (128,), 3, 8, 1e-2
    shapes = [((128,), 8), ((256, 256), 4), ((128,), 1024)]
    args = (seed, hidden, steps, batch, lr, shapes, str(tmp_path))
    ranks = launch(workers.lesson_worker, world, args=args, timeout_s=240)
    full = workers.mlp(seed, hidden)
    for rank, result in enumerate(ranks):
        for name, parameter in full.named_parameters():
            shape, local_shape = result["shards"][name]
            chunks = parameter.chunk(world)  # FSDP2 cuts dim 0 as torch.chunk does (a missing chunk: 0 rows)
            rows = len(chunks[rank]) if rank < len(chunks) else 0
            assert shape == tuple(parameter.shape) and local_shape == (rows, *parameter.shape[1:])
        local_numel = sum(math.prod(local_shape) for _, local_shape in result["shards"].values())
        assert result["fsdp_bytes"]["parameters"] == 4 * local_numel
        assert result["fsdp_bytes"]["optimizer state"] == 2 * 4 * local_numel + 4 * 4  # two moments, four step counters
        assert result["ddp_bytes"]["parameters"] == 4 * 9610
    assert sum(result["fsdp_bytes"]["parameters"] for result in ranks) == 4 * 9610  # the shards add up to the model

    one_process = workers.mlp(seed, hidden)
    workers.train_steps(one_process, workers.adamw(one_process, lr), workers.step_batches(seed, steps, world * batch))
    for name, value in one_process.named_parameters():
        for result in ranks:
            torch.testing.assert_close(result["fsdp_weights"][name], result["ddp_weights"][name], rtol=0, atol=lr / 100)
            torch.testing.assert_close(result["fsdp_weights"][name], value.detach(), rtol=0, atol=lr / 100)

    calls = ranks[0]["fsdp_calls"]
    padded = [4 * -(-p.shape[0] // world) * world * p[0].numel() for p in full.parameters()]  # whole shards only
    blocks = [padded[0] + padded[1], padded[2] + padded[3]]
    assert sorted(size for kind, size in calls if kind == "all-gather") == sorted(2 * blocks)  # forward + backward
    assert sorted(size for kind, size in calls if kind == "reduce-scatter") == sorted(blocks)
    assert ranks[0]["ddp_calls"] == [("all-reduce", 4 * 9610)]

    precision = ranks[0]["mixed_precision"]
    assert precision["computed in"] == {"weight": torch.bfloat16, "inputs": torch.bfloat16}
    assert precision["stored as"] == {"parameter shard": torch.float32, "gradient shard": torch.float32}
    gathered = sum(size for kind, size in precision["calls"] if kind == "all-gather")
    assert 2 * gathered == sum(size for kind, size in calls if kind == "all-gather")  # bfloat16: half the bytes

    small, wide, big_batch = ranks[0]["memory"]
    assert wide["params"] == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    for row in (small, wide, big_batch):
        assert row["ddp activations"] == row["fsdp activations"] > 0  # sharding leaves activations alone
        assert row["fsdp state"] < 1.05 * row["ddp state"] / world  # a third of the state (rank 0: a row more)
    assert (
        big_batch["ddp activations"] > 3 * big_batch["ddp state"] and wide["ddp state"] > 10 * wide["ddp activations"]
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
    ]


@pytest.mark.skipif(SHARDS_ON_CPU, reason="this torch shards on the CPU: the refusal is for torch < 2.7")
def test_shard_model_refuses_cpu_tensors_on_a_torch_that_cannot_shard_them_naming_the_release():
    with pytest.raises(RuntimeError, match=r"needs torch 2\.7 or newer; this is torch "):
        workers.shard_model(workers.mlp(0, (16,)))
