"""The checkpointed-forward exercise gives each kind of mistake its own hint."""

import pytest
from torch.utils.checkpoint import checkpoint

from helpers.exercises.checkpointing import check_checkpointed_forward


def forward_reentrant(stack, x, every):
    for start in range(0, len(stack), 2 * every):
        x = checkpoint(stack[start : start + 2 * every], x, use_reentrant=True)  # x is data: no gradient flows
    return x


def forward_grouped_by_modules(stack, x, every):
    for start in range(0, len(stack), every):  # `every` modules, not `every` blocks of two modules
        x = checkpoint(stack[start : start + every], x, use_reentrant=False)
    return x


def forward_every_block(stack, x, every):
    for start in range(0, len(stack), 2):  # one checkpoint per Linear+ReLU block
        x = checkpoint(stack[start : start + 2], x, use_reentrant=False)
    return x


def forward_without_the_short_last_group(stack, x, every):
    for start in range(0, len(stack) - len(stack) % (2 * every), 2 * every):
        x = checkpoint(stack[start : start + 2 * every], x, use_reentrant=False)
    return x


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (forward_reentrant, "the output needs no gradient: with use_reentrant=True"),
        (forward_grouped_by_modules, "a block is two modules"),
        (forward_every_block, "you checkpointed every block"),
        (forward_without_the_short_last_group, "the output differs from a plain run"),
    ],
)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_checkpointed_forward(wrong)
