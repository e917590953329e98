"""Many processes (notebook 07): write `shard_indices(n, rank, world_size, seed, epoch)`, the indices rank `rank`
trains on in epoch `epoch`, as `DistributedSampler` draws them: one shuffled order for every rank, padded, strided."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from . import exercise


def reference_shard_indices(n: int, rank: int, world_size: int, seed: int, epoch: int) -> list[int]:
    """What DistributedSampler(range(n), world_size, rank, seed=seed) yields after set_epoch(epoch)."""
    generator = torch.Generator().manual_seed(seed + epoch)  # its own generator: the global one is left alone
    order = torch.randperm(n, generator=generator).tolist()  # the same order on every rank
    total = math.ceil(n / world_size) * world_size  # every rank gets as many
    padded = (order * math.ceil(total / n))[:total]  # padded with the order's first indices, again if need be
    return padded[rank:total:world_size]  # rank r: positions r, r + world_size, ...


def _expected(n: int, rank: int, world_size: int, seed: int, epoch: int) -> list[int]:
    indices: Any = range(n)  # the sampler needs only the data's length
    sampler: DistributedSampler = DistributedSampler(indices, num_replicas=world_size, rank=rank, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def _shards(shard_indices: Callable[..., Any], n: int, world_size: int, seed: int, epoch: int) -> list[list[int]]:
    shards = []
    for rank in range(world_size):
        before = torch.get_rng_state()
        got = shard_indices(n, rank, world_size, seed, epoch)
        if not torch.equal(before, torch.get_rng_state()):
            torch.set_rng_state(before)
            raise AssertionError(
                "hint: shard_indices changed the global random state (torch.manual_seed or a draw without a "
                "generator): every later random number of the program would change with it; draw the order with "
                "its own torch.Generator().manual_seed(seed + epoch)"
            )
        try:
            shards.append([int(index) for index in got])
        except TypeError:
            raise AssertionError(
                f"hint: shard_indices returned {type(got).__name__}, not a list of indices: return a list of ints "
                "(a tensor's .tolist())"
            ) from None
    return shards


def _check_case(shard_indices: Callable[..., Any], n: int, world_size: int, seed: int) -> None:
    case = f"n={n}, world_size={world_size}, seed={seed}"
    expected = {epoch: [_expected(n, r, world_size, seed, epoch) for r in range(world_size)] for epoch in (0, 1)}
    got = {epoch: _shards(shard_indices, n, world_size, seed, epoch) for epoch in (0, 1)}
    per_rank = math.ceil(n / world_size)
    for epoch in (0, 1):
        lengths = [len(shard) for shard in got[epoch]]
        assert lengths == [per_rank] * world_size, (
            f"hint: {case}, epoch {epoch}: the ranks got {lengths} indices, not {per_rank} each: every rank must "
            f"run as many steps, so pad the order to ceil(n / world_size) * world_size = {per_rank * world_size} "
            "indices before cutting it"
        )
    if got[0] == got[1] and expected[0] != expected[1]:
        raise AssertionError(
            f"hint: {case}: epochs 0 and 1 gave the same shards: the shuffle is seeded with seed + epoch, so each "
            "epoch (set_epoch) draws a new order"
        )
    for epoch in (0, 1):
        want = expected[epoch]
        if got[epoch] == want:
            continue
        padded = [want[i % world_size][i // world_size] for i in range(per_rank * world_size)]  # the whole order
        blocks = [padded[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]
        if got[epoch] == blocks:
            raise AssertionError(
                f"hint: {case}, epoch {epoch}: you cut the order into consecutive blocks; DistributedSampler "
                "strides: rank r takes positions r, r + world_size, r + 2 * world_size, ... of the padded order"
            )
        real = [
            (r, i) for r in range(world_size) for i in range(per_rank) if r + i * world_size < n
        ]  # positions that hold the order itself, not padding
        if all(got[epoch][r][i] == want[r][i] for r, i in real):
            raise AssertionError(
                f"hint: {case}, epoch {epoch}: the shuffled order is right, the padding is not: DistributedSampler "
                "pads with the first indices of the shuffled order (repeated whole if it must pad more than n)"
            )
        rank = next(r for r in range(world_size) if got[epoch][r] != want[r])
        raise AssertionError(
            f"hint: {case}, epoch {epoch}, rank {rank}: got {got[epoch][rank][:6]}..., DistributedSampler yields "
            f"{want[rank][:6]}...: draw the order with torch.randperm(n, generator=g) where g = "
            "torch.Generator().manual_seed(seed + epoch), the same on every rank"
        )


@exercise("shard_indices", reference=reference_shard_indices)
def check_shard_indices(shard_indices: Callable[..., Any]) -> str:
    """Against DistributedSampler itself: even and uneven splits, more ranks than samples, two seeds, two epochs."""
    cases = [(12, 2, 0), (13, 3, 0), (1347, 4, 7), (3, 5, 1), (2, 5, 2), (10, 4, 3)]
    for n, world_size, seed in cases:
        _check_case(shard_indices, n, world_size, seed)
    return f"✓ shard_indices matched DistributedSampler on every rank of {len(cases)} cases, two epochs each"
