"""The gradient-clipping exercise gives each kind of mistake its own hint."""

import pytest
import torch

from helpers.exercises.update import check_clip_by_global_norm_


def clips_each_tensor_on_its_own(parameters, max_norm):
    norms = []
    for p in parameters:
        if p.grad is not None:
            norm = p.grad.norm()
            p.grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
            norms.append(norm)
    return torch.stack(norms).norm()


def forgets_the_epsilon(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.cat([g.flatten() for g in grads]).norm()
    for g in grads:
        g.mul_(torch.clamp(max_norm / total, max=1.0))
    return total


def clips_when_already_under(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.cat([g.flatten() for g in grads]).norm()
    for g in grads:
        g.mul_(max_norm / (total + 1e-6))  # scales up a small gradient too
    return total


def scales_a_copy(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.cat([g.flatten() for g in grads]).norm()
    for g in grads:
        g = g * torch.clamp(max_norm / (total + 1e-6), max=1.0)  # a new tensor, bound to a local name
    return total


def replaces_the_gradients(parameters, max_norm):
    parameters = [p for p in parameters if p.grad is not None]
    total = torch.cat([p.grad.flatten() for p in parameters]).norm()
    for p in parameters:
        p.grad = p.grad * torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total


def walks_the_parameters_twice(parameters, max_norm):
    total = torch.cat([p.grad.flatten() for p in parameters if p.grad is not None]).norm()
    for p in parameters:  # a generator is empty by now
        if p.grad is not None:
            p.grad.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def forgets_frozen_parameters(parameters, max_norm):
    grads = [p.grad for p in parameters]
    total = torch.cat([g.flatten() for g in grads]).norm()
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def sums_the_norms(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = sum(g.norm() for g in grads)  # not the norm of all gradients together
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def forgets_the_square_root(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = sum((g**2).sum() for g in grads)
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def returns_the_norm_after_clipping(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.cat([g.flatten() for g in grads]).norm()
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return torch.cat([g.flatten() for g in grads]).norm()  # measured again, after the scaling


def scales_the_parameters(parameters, max_norm):
    parameters = [p for p in parameters if p.grad is not None]
    total = torch.cat([p.grad.flatten() for p in parameters]).norm()
    for p in parameters:
        p.data.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))  # the weights, not their gradients
    return total


def clamps_each_value(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.cat([g.flatten() for g in grads]).norm()
    for g in grads:
        g.clamp_(-max_norm, max_norm)  # clip_grad_value_, not clipping by norm
    return total


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (clips_each_tensor_on_its_own, "each tensor was clipped to max_norm on its own"),
    (forgets_the_epsilon, "divide by total_norm . 1e-6"),
    (clips_when_already_under, "already under max_norm"),
    (scales_a_copy, "the gradients did not change"),
    (replaces_the_gradients, "p.grad was replaced by a new tensor"),
    (walks_the_parameters_twice, "a generator that runs out after one pass"),
    (forgets_frozen_parameters, "a frozen parameter has p.grad None"),
    (sums_the_norms, "the sum of the tensors' norms"),
    (forgets_the_square_root, "the squared norm: take its square root"),
    (returns_the_norm_after_clipping, "the norm after clipping: measure the total norm before scaling"),
    (scales_the_parameters, "the parameters themselves changed"),
    (clamps_each_value, "that is clip_grad_value_"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_clip_by_global_norm_(wrong)


def scales_only_when_over(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    if total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total.item()


def by_clip_grad_norm_(parameters, max_norm):
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


RIGHT = [scales_only_when_over, by_clip_grad_norm_]


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_clip_by_global_norm_.check(right).startswith("✓ clip_by_global_norm_ agreed with clip_grad_norm_")
