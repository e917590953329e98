"""The shard-bytes exercise: the reference matches torch.chunk's shards, and each kind of mistake gets its own hint."""

import math

import pytest

from helpers.exercises.sharding import check_bytes_on_rank, reference_bytes_on_rank


def plain_share(shapes, world_size, rank):
    return 16 * sum(math.prod(shape) for shape in shapes) / world_size


def floor_rows(shapes, world_size, rank):
    return 16 * sum(shape[0] // world_size * math.prod(shape[1:]) for shape in shapes)


def ceil_rows_everywhere(shapes, world_size, rank):
    return 16 * sum(-(-shape[0] // world_size) * math.prod(shape[1:]) for shape in shapes)


def balanced_rows(shapes, world_size, rank):
    rows = [shape[0] // world_size + (rank < shape[0] % world_size) for shape in shapes]  # tensor_split's cut
    return 16 * sum(r * math.prod(shape[1:]) for r, shape in zip(rows, shapes))


def negative_past_the_end(shapes, world_size, rank):
    held = 0
    for shape in shapes:
        per_rank = -(-shape[0] // world_size)
        held += min(per_rank, shape[0] - rank * per_rank) * math.prod(shape[1:])  # no max(0, ...)
    return 16 * held


def elements_not_bytes(shapes, world_size, rank):
    return reference_bytes_on_rank(shapes, world_size, rank) // 16


def parameters_only(shapes, world_size, rank):
    return reference_bytes_on_rank(shapes, world_size, rank) // 4  # float32, but no gradient or AdamW moments


def last_rank_like_the_first(shapes, world_size, rank):
    return reference_bytes_on_rank(shapes, world_size, 0 if rank == world_size - 1 else rank)  # the tail forgotten


def as_text(shapes, world_size, rank):
    return str(reference_bytes_on_rank(shapes, world_size, rank))


def test_the_reference_matches_the_lessons_model():
    assert [reference_bytes_on_rank([(128, 64), (128,), (10, 128), (10,)], 2, r) for r in (0, 1)] == [16 * 4805] * 2
    assert reference_bytes_on_rank([(5, 8)], 4, 3) == 0  # torch.chunk made 3 chunks: the 4th rank holds nothing


def whole_model(shapes, world_size, rank):  # DDP's bytes: every rank holds all of it
    return 16 * sum(math.prod(shape) for shape in shapes)


def cut_along_the_last_dim(shapes, world_size, rank):  # the columns cut, where FSDP2 cuts dim 0
    held = 0
    for shape in shapes:
        per_rank = -(-shape[-1] // world_size)
        held += max(0, min(per_rank, shape[-1] - rank * per_rank)) * math.prod(shape[:-1])
    return 16 * held


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (plain_share, "a plain share, rows / world_size"),
    (floor_rows, "rows // world_size leaves the remainder rows to nobody"),
    (ceil_rows_everywhere, "the chunks run out"),
    (balanced_rows, "tensor_split balances the rows"),
    (negative_past_the_end, "never a negative number"),
    (elements_not_bytes, "16 bytes per element"),
    (parameters_only, "16 bytes per element"),
    (as_text, "return a number of bytes"),
    (last_rank_like_the_first, r"world_size=3, rank=2: expected 47808, got 52976. .*the chunks run out"),
    (whole_model, "that is the whole model's state, what every rank holds under DDP"),
    (cut_along_the_last_dim, "the shards were cut along the last dimension"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_bytes_on_rank(wrong)


def in_numpy_s_integers(shapes, world_size, rank):
    import numpy as np

    return np.int64(reference_bytes_on_rank(shapes, world_size, rank))


def by_chunk_bounds(shapes, world_size, rank):
    held = 0
    for rows, *rest in shapes:
        per_rank = math.ceil(rows / world_size)
        first, last = min(rows, rank * per_rank), min(rows, (rank + 1) * per_rank)
        held += (last - first) * math.prod(rest)
    return 4 * 4 * held


RIGHT = [in_numpy_s_integers, by_chunk_bounds]


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_bytes_on_rank.check(right).startswith("✓ bytes_on_rank matched torch.chunk's shards")
