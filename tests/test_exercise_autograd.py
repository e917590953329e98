"""The input_gradient() exercise gives each kind of mistake its own hint."""

import pytest
import torch
import torch.nn.functional as F

from helpers.exercises.autograd import check_input_gradient


def with_backward(model, x, target):  # fills every parameter's .grad on the way
    inputs = x.detach().requires_grad_()
    F.cross_entropy(model(inputs), target, reduction="sum").backward()
    return inputs.grad


def backward_then_zero_grad(model, x, target):  # throws the caller's gradients away
    inputs = x.detach().requires_grad_()
    F.cross_entropy(model(inputs), target, reduction="sum").backward()
    model.zero_grad()
    return inputs.grad


def on_the_callers_x(model, x, target):  # switches requires_grad on the caller's tensor
    x.requires_grad_()
    return torch.autograd.grad(F.cross_entropy(model(x), target, reduction="sum"), x)[0]


def without_enable_grad(model, x, target):  # right, until someone calls it inside no_grad
    inputs = x.detach().requires_grad_()
    return torch.autograd.grad(F.cross_entropy(model(inputs), target, reduction="sum"), inputs)[0]


def of_the_mean(model, x, target):  # the default reduction: each gradient shrinks with the batch
    inputs = x.detach().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(F.cross_entropy(model(inputs), target), inputs)[0]


def with_create_graph(model, x, target):  # the result keeps a graph the caller never asked for
    inputs = x.detach().requires_grad_()
    with torch.enable_grad():
        loss = F.cross_entropy(model(inputs), target, reduction="sum")
        return torch.autograd.grad(loss, inputs, create_graph=True)[0]


def of_the_output(model, x, target):  # differentiates with respect to the logits, not the input
    with torch.enable_grad():
        logits = model(x.detach()).detach().requires_grad_()
        return torch.autograd.grad(F.cross_entropy(logits, target, reduction="sum"), logits)[0]


def without_the_softmax(model, x, target):  # the gradient of the target's logit alone
    inputs = x.detach().requires_grad_()
    with torch.enable_grad():
        picked = -model(inputs).gather(1, target.unsqueeze(1)).sum()
        return torch.autograd.grad(picked, inputs)[0]


def freezes_the_model(model, x, target):  # no parameter .grad touched, because none is asked for again
    model.requires_grad_(False)
    inputs = x.detach().requires_grad_()
    with torch.enable_grad():
        F.cross_entropy(model(inputs), target, reduction="sum").backward()
    return inputs.grad


def grad_mode_on_for_good(model, x, target):  # set_grad_enabled called as a function, never switched back
    torch.set_grad_enabled(True)
    inputs = x.detach().requires_grad_()
    return torch.autograd.grad(F.cross_entropy(model(inputs), target, reduction="sum"), inputs)[0]


def leaves_it_in_eval_mode(model, x, target):  # eval() for a "clean" gradient, and the caller's mode is lost
    model.eval()
    inputs = x.detach().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(F.cross_entropy(model(inputs), target, reduction="sum"), inputs)[0]


def returns_a_tuple(model, x, target):  # autograd.grad's tuple, not its one tensor
    inputs = x.detach().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(F.cross_entropy(model(inputs), target, reduction="sum"), inputs)


def with_torch_func(model, x, target):  # a function transform: it ignores the caller's no_grad
    gradient = torch.func.grad(lambda inputs: F.cross_entropy(model(inputs), target, reduction="sum"))
    return gradient(x).detach()  # detached: the result depends on the parameters too


def sample_by_sample(model, x, target):  # slower, and right
    rows = []
    with torch.enable_grad():
        for sample, label in zip(x, target):
            inputs = sample.detach().unsqueeze(0).requires_grad_()
            loss = F.cross_entropy(model(inputs), label.unsqueeze(0))
            rows.append(torch.autograd.grad(loss, inputs)[0][0])
    return torch.stack(rows)


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (with_backward, r"model's 0.weight.grad changed .*now other values"),
    (backward_then_zero_grad, r"0.weight.grad changed .*now None"),
    (on_the_callers_x, "the caller's x now has requires_grad=True"),
    (without_enable_grad, r"inside torch.no_grad\(\).*torch.enable_grad"),
    (of_the_mean, "gradient of the mean loss"),
    (with_create_graph, "still requires grad"),
    (of_the_output, r"shape \(1, 3\), not x's \(1, 5\)"),
    (without_the_softmax, "differs from each sample's gradient"),
    (freezes_the_model, r"came back frozen \(0.weight.requires_grad is False\)"),
    (grad_mode_on_for_good, "grad mode was still on after the call, inside the caller's no_grad"),
    (leaves_it_in_eval_mode, "was in train mode and came back in eval mode"),
    (returns_a_tuple, "it returned tuple, not a tensor"),
]
RIGHT = [with_torch_func, sample_by_sample]


@pytest.mark.parametrize("wrong, hint", WRONG, ids=lambda v: getattr(v, "__name__", "hint"))
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        check_input_gradient.check(wrong)


@pytest.mark.parametrize("right", RIGHT, ids=lambda v: v.__name__)
def test_other_right_answers_pass(right):
    assert check_input_gradient.check(right).startswith("✓ ")


def test_the_check_leaves_the_grad_mode_on():
    check_input_gradient.check(check_input_gradient.reference)
    assert torch.is_grad_enabled()
