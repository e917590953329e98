"""The checkpointed-forward exercise gives each kind of mistake its own hint."""

import pytest
import torch
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


def forward_under_no_grad(stack, x, every):
    with torch.no_grad():  # to save memory, as for evaluation: but then nothing trains
        for start in range(0, len(stack), 2 * every):
            x = checkpoint(stack[start : start + 2 * every], x, use_reentrant=False)
    return x


def forward_detached_between_groups(stack, x, every):
    for start in range(0, len(stack), 2 * every):
        x = checkpoint(stack[start : start + 2 * every], x, use_reentrant=False).detach().requires_grad_()
    return x


def forward_not_checkpointed(stack, x, every):
    return stack(x)


def forward_one_checkpoint_for_the_stack(stack, x, every):
    return checkpoint(stack, x, use_reentrant=False)


def forward_returning_every_group(stack, x, every):  # each group's output, where the caller wants the last
    outputs = []
    for start in range(0, len(stack), 2 * every):
        x = checkpoint(stack[start : start + 2 * every], x, use_reentrant=False)
        outputs.append(x)
    return outputs


def forward_one_block_too_many_per_group(stack, x, every):  # groups of every + 1 blocks: fewer, larger groups
    for start in range(0, len(stack), 2 * (every + 1)):
        x = checkpoint(stack[start : start + 2 * (every + 1)], x, use_reentrant=False)
    return x


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (forward_reentrant, "the output needs no gradient: with use_reentrant=True"),
    (forward_grouped_by_modules, "a block is two modules"),
    (forward_every_block, "you checkpointed every block"),
    (forward_without_the_short_last_group, "the output differs from a plain run"),
    (forward_under_no_grad, r"the output needs no gradient: the forward ran without autograd \(torch.no_grad"),
    (forward_detached_between_groups, "the graph was cut between groups"),
    (forward_not_checkpointed, "as many as a plain run: nothing was checkpointed"),
    (forward_one_checkpoint_for_the_stack, "one checkpoint over the whole stack keeps 1 activation"),
    (forward_returning_every_group, r"return the stack's output, a tensor of shape \(4, 16\); got list"),
    (forward_one_block_too_many_per_group, "10 blocks in groups of 3 are 4 groups and keep 4 activations"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_checkpointed_forward(wrong)


def forward_over_a_list_of_modules(stack, x, every):
    modules = list(stack)

    def run(inputs, group):
        for module in group:
            inputs = module(inputs)
        return inputs

    for start in range(0, len(modules), 2 * every):
        x = checkpoint(run, x, modules[start : start + 2 * every], use_reentrant=False)
    return x


RIGHT = [forward_over_a_list_of_modules]


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_checkpointed_forward.check(right).startswith("✓ checkpointed_forward: plain gradients")
