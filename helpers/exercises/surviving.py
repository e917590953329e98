"""Surviving failures: write `my_attempt_store(store, rank, world_size, restart_count)`, the store a rank of a
restarted group meets the others in, as helpers.distributed.attempt_store does under torchrun.

torchrun keeps one key-value store through every restart and every change of members. The learner's function gets
that store and returns the one this rank should use (a `torch.distributed.PrefixStore` around it, say): every rank
of one attempt must see what the others write there, and no rank may see a key an earlier attempt wrote. The check
plays a job's attempts on an in-process `HashStore`, the ranks of each attempt calling the function one after the
other: a first group of 2, a restart, a re-formed group with the same restart count (a node joined), and a group
grown to 3.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from . import exercise

# (restart_count, world_size, why torchrun starts this attempt), in the order a job goes through them
ATTEMPTS = [
    (0, 2, "the first group of 2 ranks"),
    (1, 2, "the group restarted after a rank died (restart count 1)"),
    (1, 2, "the group re-formed with the same restart count (a node joined: torchrun does not count that)"),
    (1, 3, "the group grown to 3 ranks, restart count still 1"),
]


def reference_my_attempt_store(store: dist.Store, rank: int, world_size: int, restart_count: int) -> dist.Store:
    """Count this rank in under its restart count and world size; ranks 1..world_size of the count share a prefix."""
    del rank  # every rank of an attempt gets the same prefix, whichever rank it is
    group = f"attempts/{restart_count}/{world_size}"
    attempt = (store.add(f"{group}/joined", 1) - 1) // world_size
    return dist.PrefixStore(f"{group}/{attempt}/", store)


def _stores_of(my_attempt_store: Callable, shared: dist.Store, world_size: int, restart_count: int, why: str) -> list:
    stores = []
    for rank in range(world_size):
        try:
            mine = my_attempt_store(shared, rank, world_size, restart_count)
        except NotImplementedError:
            raise
        except Exception as error:
            raise AssertionError(
                f"hint: my_attempt_store(store, rank={rank}, world_size={world_size}, restart_count={restart_count}) "
                f"raised {type(error).__name__}: {error}"
            ) from None
        assert isinstance(mine, dist.Store), (
            f"hint: for {why}, my_attempt_store returned {type(mine).__name__}: return a store, such as "
            "torch.distributed.PrefixStore(prefix, store)"
        )
        stores.append(mine)
    return stores


@exercise("my_attempt_store", reference=reference_my_attempt_store)
def check_my_attempt_store(my_attempt_store: Callable) -> str:
    """Through ATTEMPTS on one HashStore: each rank writes its address; every rank of the attempt must read every
    other's, and none may find an address that a rank of an earlier attempt wrote."""
    shared = dist.HashStore()
    for attempt, (restart_count, world_size, why) in enumerate(ATTEMPTS):
        stores = _stores_of(my_attempt_store, shared, world_size, restart_count, why)
        for rank, store in enumerate(stores):
            stale = [other for other in range(3) if store.check([f"address/{other}"])]
            assert not stale, (
                f"hint: in {why}, rank {rank} finds the address of rank {stale[0]} before that rank wrote one: a key "
                "an earlier attempt left in torchrun's store. Each attempt needs a prefix no earlier one used"
                + (
                    "; the restart count alone repeats when torchrun re-forms the group without a restart"
                    if attempt == 2
                    else ""
                )
                + (
                    "; so does a count of joins that ignores the world size once the group grows"
                    if attempt == 3
                    else ""
                )
            )
        for rank, store in enumerate(stores):
            store.set(f"address/{rank}", f"127.0.0.1:{29500 + 10 * attempt + rank}")
        for rank, store in enumerate(stores):
            for other in range(world_size):
                assert store.check([f"address/{other}"]), (
                    f"hint: in {why}, rank {rank} cannot read the address rank {other} wrote: every rank of an "
                    "attempt must get the same prefix (not one by rank, time or a random name: ranks do not share "
                    "those). Count the ranks in with store.add, and give ranks 1..world_size one prefix"
                )
    return (
        f"✓ my_attempt_store gave {len(ATTEMPTS)} attempts (a restart, a re-formed group, 3 ranks) fresh, shared keys"
    )
