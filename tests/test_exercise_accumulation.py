"""The accumulation-step exercise gives each kind of mistake its own hint."""

import pytest
import torch.nn.functional as F

from helpers.exercises.accumulation import check_accumulation_step


def divided_by_k(model, optimizer, micro_batches):
    for inputs, targets in micro_batches:
        (F.cross_entropy(model(inputs), targets) / len(micro_batches)).backward()  # wrong for a shorter last one
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def no_zero_grad_after_the_step(model, optimizer, micro_batches):
    samples = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (F.cross_entropy(model(inputs), targets) * len(targets) / samples).backward()
    optimizer.step()


def zero_grad_before_instead_of_after(model, optimizer, micro_batches):
    optimizer.zero_grad(set_to_none=True)  # right steps, but the last call's gradients stay pending
    samples = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (F.cross_entropy(model(inputs), targets) * len(targets) / samples).backward()
    optimizer.step()


def step_per_micro_batch(model, optimizer, micro_batches):
    samples = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (F.cross_entropy(model(inputs), targets) * len(targets) / samples).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def losses_summed_before_one_backward(model, optimizer, micro_batches):
    samples = sum(len(targets) for _, targets in micro_batches)
    total = sum(F.cross_entropy(model(inputs), targets) * len(targets) / samples for inputs, targets in micro_batches)
    total.backward()  # the right gradient, but every micro-batch's graph alive until here
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (divided_by_k, "dividing each loss by k is right only when"),
        (no_zero_grad_after_the_step, "the first step was right, the second is off"),
        (zero_grad_before_instead_of_after, "gradients were pending after a call"),
        (step_per_micro_batch, "optimizer.step.. ran 8 times in two calls"),
        (losses_summed_before_one_backward, "the saved-tensor peak was"),
    ],
)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: {hint}"):
        check_accumulation_step(wrong)
