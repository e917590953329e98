"""The shard_indices() exercise gives each kind of mistake its own hint, checked against DistributedSampler."""

import math

import pytest
import torch
from torch.utils.data import DistributedSampler

from helpers.exercises.processes import check_shard_indices


def _order(n, seed, epoch):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def without_padding(n, rank, world_size, seed, epoch):  # the last ranks get one step fewer
    return _order(n, seed, epoch)[rank::world_size]


def in_blocks(n, rank, world_size, seed, epoch):  # consecutive blocks instead of strides
    per_rank = math.ceil(n / world_size)
    order = _order(n, seed, epoch)
    padded = (order * math.ceil(per_rank * world_size / n))[: per_rank * world_size]
    return padded[rank * per_rank : (rank + 1) * per_rank]


def ignores_the_epoch(n, rank, world_size, seed, epoch):  # every epoch repeats epoch 0's order
    total = math.ceil(n / world_size) * world_size
    order = _order(n, seed, 0)
    return (order * math.ceil(total / n))[:total][rank::world_size]


def with_the_global_generator(n, rank, world_size, seed, epoch):  # right numbers, the program's RNG reseeded
    torch.manual_seed(seed + epoch)
    total = math.ceil(n / world_size) * world_size
    order = torch.randperm(n).tolist()
    return (order * math.ceil(total / n))[:total][rank::world_size]


def pads_with_the_last(n, rank, world_size, seed, epoch):  # padding from the end of the order
    total = math.ceil(n / world_size) * world_size
    order = _order(n, seed, epoch)
    return (order + [order[-1]] * (total - n))[rank::world_size]


def pads_once(n, rank, world_size, seed, epoch):  # order + order[:padding]: short when padding > n
    total = math.ceil(n / world_size) * world_size
    order = _order(n, seed, epoch)
    return (order + order[: total - n])[rank::world_size]


def seeded_by_rank(n, rank, world_size, seed, epoch):  # a different order on every rank: shards overlap
    total = math.ceil(n / world_size) * world_size
    order = _order(n, seed + rank, epoch)
    return (order * math.ceil(total / n))[:total][rank::world_size]


def ignores_the_seed(n, rank, world_size, seed, epoch):  # the order drawn from the epoch alone
    total = math.ceil(n / world_size) * world_size
    order = _order(n, 0, epoch)
    return (order * math.ceil(total / n))[:total][rank::world_size]


def drops_the_rest(n, rank, world_size, seed, epoch):  # drop_last's cut: even shards, the last samples never seen
    total = n // world_size * world_size
    return _order(n, seed, epoch)[:total][rank::world_size]


def forgets_to_return(n, rank, world_size, seed, epoch):  # the shard computed, then dropped
    total = math.ceil(n / world_size) * world_size
    _ = (_order(n, seed, epoch) * math.ceil(total / n))[:total][rank::world_size]


def as_a_tensor(n, rank, world_size, seed, epoch):  # right, returned as a tensor: accepted
    generator = torch.Generator().manual_seed(seed + epoch)
    total = math.ceil(n / world_size) * world_size
    order = torch.randperm(n, generator=generator).repeat(math.ceil(total / n))[:total]
    return order[rank::world_size]


def through_the_sampler(n, rank, world_size, seed, epoch):  # the library's own answer
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (without_padding, r"n=13, world_size=3, seed=0, epoch 0: the ranks got \[5, 4, 4\] indices, not 5 each"),
    (in_blocks, "consecutive blocks"),
    (ignores_the_epoch, "epochs 0 and 1 gave the same shards"),
    (with_the_global_generator, "changed the global random state"),
    (pads_with_the_last, "the shuffled order is right, the padding is not"),
    (pads_once, r"n=2, world_size=5.*the ranks got \[1, 1, 1, 1, 0\] indices"),
    (seeded_by_rank, r"rank 1: got .* DistributedSampler yields"),
    (ignores_the_seed, r"n=1347, world_size=4, seed=7, epoch 0, rank 0: got .*manual_seed\(seed \+ epoch\)"),
    (drops_the_rest, r"n=13, world_size=3, seed=0, epoch 0: the ranks got \[4, 4, 4\] indices, not 5 each"),
    (forgets_to_return, "returned NoneType, not a list of indices"),
]
RIGHT = [as_a_tensor, through_the_sampler]


@pytest.mark.parametrize("wrong, hint", WRONG, ids=lambda v: getattr(v, "__name__", "hint"))
def test_each_mistake_gets_its_hint(wrong, hint):
    state = torch.get_rng_state()
    with pytest.raises(AssertionError, match=hint):
        check_shard_indices.check(wrong)
    assert torch.equal(state, torch.get_rng_state()), "the check puts the global random state back"


@pytest.mark.parametrize("right", RIGHT, ids=lambda v: v.__name__)
def test_other_right_answers_pass(right):
    assert check_shard_indices.check(right).startswith("✓ ")
