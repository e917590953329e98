"""The my_attempt_store exercise (the store a restarted group meets in) refuses each kind of mistake with its hint."""

import os
import time
import uuid

import pytest
import torch.distributed as dist

from helpers.distributed import attempt_store
from helpers.exercises import ExerciseNotDone
from helpers.exercises.surviving import check_my_attempt_store, reference_my_attempt_store


def prefixed(prefix_of):
    """An answer that puts the prefix `prefix_of(store, rank, world_size, restart_count)` before every key."""
    return lambda store, rank, size, restart: dist.PrefixStore(prefix_of(store, rank, size, restart), store)


def counted(key_of, divide=True):
    """An answer that counts the ranks in under `key_of(restart, size)`, with or without the world size."""

    def answer(store, rank, size, restart):
        joined = store.add(key_of(restart, size), 1) - 1
        return dist.PrefixStore(f"{key_of(restart, size)}/{joined // size if divide else joined}/", store)

    return answer


NAMED_WRONG = {
    "the store as it is": (lambda store, rank, size, restart: store, "a key an earlier attempt left"),
    "the restart count alone": (prefixed(lambda s, r, n, c: f"{c}/"), "restart count alone repeats"),
    "restart count and world size": (prefixed(lambda s, r, n, c: f"{c}/{n}/"), "restart count alone repeats"),
    "the rank": (prefixed(lambda s, r, n, c: f"rank{r}/"), "cannot read the address rank 1 wrote"),
    "a random name": (prefixed(lambda s, r, n, c: f"{uuid.uuid4()}/"), "cannot read the address"),
    "the clock": (prefixed(lambda s, r, n, c: f"{time.perf_counter_ns()}/"), "cannot read the address"),
    "the process id": (prefixed(lambda s, r, n, c: f"{os.getpid()}/"), "a key an earlier attempt left"),
    "joins not divided by the world size": (counted(lambda c, n: f"{c}/{n}", divide=False), "cannot read"),
    "joins counted per restart only": (counted(lambda c, n: f"{c}"), "ignores the world size once the group grows"),
    "joins counted over the whole job": (counted(lambda c, n: "all"), "ignores the world size once the group grows"),
    "no store returned": (lambda store, rank, size, restart: None, "returned NoneType: return a store"),
    "a prefix that is not a string": (prefixed(lambda s, r, n, c: c), "raised TypeError"),
}
WRONG = list(NAMED_WRONG.values())


def by_tuple_key(store, rank, size, restart):
    """Right, written otherwise: one counter per (restart, size), the prefix spelled differently."""
    joined = store.add(f"joins-r{restart}-w{size}", 1)
    return dist.PrefixStore(f"r{restart}-w{size}-a{(joined - 1) // size}:", store)


RIGHT = [by_tuple_key, lambda store, rank, size, restart: attempt_store(store, size, restart)]


@pytest.mark.parametrize("wrong, hint", WRONG, ids=list(NAMED_WRONG))
def test_each_wrong_answer_is_refused_with_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        check_my_attempt_store.check(wrong)


@pytest.mark.parametrize("right", RIGHT, ids=["a counter per restart and size", "helpers.distributed"])
def test_right_answers_written_otherwise_pass(right):
    check_my_attempt_store.check(right)


def test_the_reference_passes_with_its_line(capsys):
    check_my_attempt_store(reference_my_attempt_store)
    assert capsys.readouterr().out.startswith("✓ my_attempt_store gave 4 attempts")


def test_the_stub_says_it_is_still_the_stub(monkeypatch):
    monkeypatch.delenv("COURSE_EXERCISES", raising=False)

    def my_attempt_store(store, rank, world_size, restart_count):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="still the stub"):
        check_my_attempt_store(my_attempt_store)


@pytest.mark.parametrize(
    "size, restart, match",
    [(0, 0, "world_size must be a positive int"), (2, -1, "restart_count must be an int >= 0")],
)
def test_the_library_refuses_a_bad_world_size_or_restart_count(size, restart, match):
    with pytest.raises(ValueError, match=match):
        attempt_store(dist.HashStore(), size, restart)
