"""The accumulation-step exercise gives each kind of mistake its own hint."""

import pytest
import torch
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


def zero_grad_before_each_micro_batch(model, optimizer, micro_batches):
    samples = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        optimizer.zero_grad()  # as in the plain loop: wipes the micro-batches before this one
        (F.cross_entropy(model(inputs), targets) * len(targets) / samples).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def losses_not_scaled(model, optimizer, micro_batches):
    for inputs, targets in micro_batches:
        F.cross_entropy(model(inputs), targets).backward()  # four mean losses added up
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def divided_by_the_nominal_batch(model, optimizer, micro_batches):
    for inputs, targets in micro_batches:
        (F.cross_entropy(model(inputs), targets) * len(targets) / 16).backward()  # 16: one micro-batch, not all
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def one_pass_over_all_the_samples(model, optimizer, micro_batches):
    inputs, targets = (torch.cat(parts) for parts in zip(*micro_batches))
    F.cross_entropy(model(inputs), targets).backward()  # the batch's gradient, every activation at once
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def never_steps(model, optimizer, micro_batches):  # gradients accumulated, then thrown away
    samples = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (F.cross_entropy(model(inputs), targets, reduction="sum") / samples).backward()
    optimizer.zero_grad(set_to_none=True)


def first_micro_batch_only(model, optimizer, micro_batches):  # the others never reach backward
    inputs, targets = micro_batches[0]
    F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (divided_by_k, "dividing each loss by k is right only when"),
    (no_zero_grad_after_the_step, "the first step was right, the second is off"),
    (zero_grad_before_instead_of_after, "gradients were pending after a call"),
    (step_per_micro_batch, "optimizer.step.. ran 8 times in two calls"),
    (losses_summed_before_one_backward, "the saved-tensor peak was"),
    (zero_grad_before_each_micro_batch, "only the last micro-batch's gradient reached optimizer.step"),
    (losses_not_scaled, "the micro-batches' mean losses were added up as they are"),
    (divided_by_the_nominal_batch, "the gradient points the right way but is 3.44x as long"),
    (one_pass_over_all_the_samples, "the saved-tensor peak was .*one forward pass over all the samples"),
    (never_steps, r"optimizer.step\(\) ran 0 times in two calls"),
    (first_micro_batch_only, "the first step's gradient is not the one-batch gradient"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: {hint}"):
        check_accumulation_step(wrong)


def summed_losses_over_all_samples(model, optimizer, micro_batches):
    samples = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (F.cross_entropy(model(inputs), targets, reduction="sum") / samples).backward()
    optimizer.step()
    model.zero_grad()  # set_to_none=True by default, as optimizer.zero_grad()


RIGHT = [summed_losses_over_all_samples]


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_accumulation_step.check(right).startswith("✓ accumulation_step, micro-batches [16, 16, 16, 7]")
