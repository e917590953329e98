"""Sharded data parallel: the bytes of model state one rank holds under FSDP2 with AdamW, from the parameters' shapes
alone; checked against the shards torch.chunk cuts (FSDP2 cuts dim 0 the same way), empty shards included."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch

from . import exercise

BYTES_PER_ELEMENT = 4 * 4  # float32, held four times: parameter, gradient, AdamW's exp_avg and exp_avg_sq
COURSE_MLP = [(128, 64), (128,), (10, 128), (10,)]  # the lesson's 9,610-parameter MLP
CASES = [  # (shapes, world size): even halves, uneven thirds, a short last chunk, chunks for fewer ranks than asked
    (COURSE_MLP, 2),
    (COURSE_MLP, 3),
    ([(10, 128), (10,)], 4),
    ([(5, 8), (6,), (64, 3, 3)], 4),
    ([(6, 2), (1,)], 8),
]


def reference_bytes_on_rank(shapes, world_size, rank):
    """Bytes of parameters, gradients and AdamW moments (float32) that `rank` holds when FSDP2 shards `shapes`."""
    held = 0
    for shape in shapes:
        rows = shape[0]
        rows_per_rank = -(-rows // world_size)  # torch.chunk: ceil(rows / world_size) for each rank in turn
        mine = max(0, min(rows_per_rank, rows - rank * rows_per_rank))  # the last ranks: what is left, maybe none
        held += mine * math.prod(shape[1:])
    return BYTES_PER_ELEMENT * held


def _by_torch_chunk(shapes: Sequence[tuple[int, ...]], world_size: int, rank: int) -> int:
    """The truth: torch.chunk on tensors of these shapes (on the meta device: shapes only, no memory)."""
    held = 0
    for shape in shapes:
        chunks = torch.empty(shape, device="meta").chunk(world_size)
        held += chunks[rank].numel() if rank < len(chunks) else 0
    return BYTES_PER_ELEMENT * held


def _split(shapes: Sequence[tuple[int, ...]], world_size: int, rank: int, rows_of: Callable[[int], float]) -> float:
    return BYTES_PER_ELEMENT * sum(rows_of(shape[0]) * math.prod(shape[1:]) for shape in shapes)


def _mistakes(shapes: Sequence[tuple[int, ...]], world_size: int, rank: int) -> dict[str, float]:
    """What typical wrong answers return for this case, each with its hint."""
    return {
        "a plain share, rows / world_size, is not what a rank holds: FSDP2 cuts whole rows of dim 0 as torch.chunk "
        "does, ceil(rows / world_size) for each rank in turn, so the last ranks get what is left": _split(
            shapes, world_size, rank, lambda rows: rows / world_size
        ),
        "rows // world_size leaves the remainder rows to nobody: torch.chunk gives each rank ceil(rows / world_size) "
        "rows, and the last ranks what is left": _split(shapes, world_size, rank, lambda rows: rows // world_size),
        "every rank got ceil(rows / world_size) rows, but the chunks run out: the last ranks hold what is left, "
        "possibly nothing": _split(shapes, world_size, rank, lambda rows: -(-rows // world_size)),
        "tensor_split balances the rows (3, 3, 2, 2); torch.chunk, which FSDP2 uses, gives ceil(rows / world_size) "
        "to each rank in turn (3, 3, 3, 1)": _split(
            shapes, world_size, rank, lambda rows: len(torch.arange(rows).tensor_split(world_size)[rank])
        ),
        "a rank past the last chunk holds 0 rows, never a negative number": _split(
            shapes, world_size, rank, lambda rows: min(-(-rows // world_size), rows - rank * -(-rows // world_size))
        ),
        "that is the whole model's state, what every rank holds under DDP: FSDP2 leaves each rank only its "
        "shard of every parameter": _split(shapes, world_size, rank, lambda rows: rows),
        "the shards were cut along the last dimension: FSDP2 cuts dim 0, the rows, as torch.chunk(world_size) "
        "does": _along_the_last_dim(shapes, world_size, rank),
    }


def _along_the_last_dim(shapes: Sequence[tuple[int, ...]], world_size: int, rank: int) -> float:
    """The bytes of a rank whose shards were cut along each shape's last dimension instead of its first."""
    held = 0
    for shape in shapes:
        pieces = torch.arange(shape[-1]).chunk(world_size)
        held += (len(pieces[rank]) if rank < len(pieces) else 0) * math.prod(shape[:-1])
    return BYTES_PER_ELEMENT * held


@exercise("bytes_on_rank", reference=reference_bytes_on_rank)
def check_bytes_on_rank(bytes_on_rank: Callable) -> str:
    """For every case and rank, the learner's bytes must equal those of torch.chunk's shards, 16 bytes per element."""
    for shapes, world_size in CASES:
        for rank in range(world_size):
            expected = _by_torch_chunk(shapes, world_size, rank)
            mine = bytes_on_rank(shapes, world_size, rank)
            assert isinstance(mine, numbers.Real) and not isinstance(mine, bool), (
                f"hint: return a number of bytes (an int), got {type(mine).__name__}"
            )
            case = f"shapes {shapes}, world_size={world_size}, rank={rank}: expected {expected}, got {mine}"
            if mine == expected:
                continue
            assert mine * BYTES_PER_ELEMENT != expected and mine * 4 != expected, (
                f"hint: {case}. Each element of a shard is 4 bytes (float32), held 4 times (the parameter, its "
                "gradient, AdamW's exp_avg and exp_avg_sq): 16 bytes per element"
            )
            for hint, wrong in _mistakes(shapes, world_size, rank).items():
                assert not math.isclose(mine, wrong), f"hint: {case}. {hint}"
            raise AssertionError(
                f"hint: {case}. Per shape: rows_per_rank = ceil(rows / world_size); rank r holds rows "
                "[r * rows_per_rank, (r + 1) * rows_per_rank) cut to the rows there are, times the other dims"
            )
    *others, largest = sorted({world for _, world in CASES})
    listed = ", ".join(map(str, others))
    return f"✓ bytes_on_rank matched torch.chunk's shards for {listed} and {largest} ranks, empty shards included"
