"""The my_rung exercise gives each kind of mistake its own hint."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from helpers.data import make_loader
from helpers.exercises.faster import check_my_rung
from helpers.loop import train_epoch


def plain_epoch(model, loader, optimizer, device, *, zero_grad=True):
    def epoch():
        model.train()
        for inputs, targets in loader:
            F.cross_entropy(model(inputs.to(device)), targets.to(device)).backward()
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad(set_to_none=True)

    return epoch


def returns_nothing(model, train_set, *, batch_size, lr, seed, device):
    make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed)


def never_steps(model, train_set, *, batch_size, lr, seed, device):
    loader = make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed)

    def epoch():
        for inputs, targets in loader:
            F.cross_entropy(model(inputs.to(device)), targets.to(device)).backward()

    return epoch


def trains_a_copy(model, train_set, *, batch_size, lr, seed, device):
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return plain_epoch(model, make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed), optimizer, device)


def trains_only_the_head(model, train_set, *, batch_size, lr, seed, device):
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=lr)
    return plain_epoch(model, make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed), optimizer, device)


def doubles_the_batch(model, train_set, *, batch_size, lr, seed, device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loader = make_loader(train_set, batch_size=2 * batch_size, shuffle=True, seed=seed)
    return plain_epoch(model, loader, optimizer, device)


def steps_every_micro_batch(model, train_set, *, batch_size, lr, seed, device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loader = make_loader(train_set, batch_size=batch_size // 2, shuffle=True, seed=seed)
    return plain_epoch(model, loader, optimizer, device)


def forgets_zero_grad(model, train_set, *, batch_size, lr, seed, device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loader = make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed)
    return plain_epoch(model, loader, optimizer, device, zero_grad=False)


def unseeded_order(model, train_set, *, batch_size, lr, seed, device):  # shuffled, from the global RNG
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return functools.partial(train_epoch, model, loader, optimizer, F.cross_entropy, device=device, progress=False)


def fixed_order(model, train_set, *, batch_size, lr, seed, device):  # the data in the same order every epoch
    loader = make_loader(train_set, batch_size=batch_size, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return functools.partial(train_epoch, model, loader, optimizer, F.cross_entropy, device=device, progress=False)


def returns_the_loader(model, train_set, *, batch_size, lr, seed, device):  # the data, where a function belongs
    return make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed)


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (returns_nothing, "must return a function that trains one epoch"),
    (never_steps, "ran no optimizer.step"),
    (trains_a_copy, "the model given did not change"),
    (trains_only_the_head, "parameter tensors did not change"),
    (doubles_the_batch, "optimizer steps; yours took"),
    (steps_every_micro_batch, "micro-batches must accumulate"),
    (forgets_zero_grad, "Zero the gradients after every step"),
    (unseeded_order, "two first epochs with seed=0 ended with different weights: the order of the data ignores"),
    (fixed_order, "the data comes in one fixed order; shuffle it"),
    (returns_the_loader, "must return a function that trains one epoch when called .*got DataLoader"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_my_rung(wrong)


def zeroing_before_the_step(model, train_set, *, batch_size, lr, seed, device):
    """The plain loop, zeroing (to zeros) before each backward, with the foreach AdamW: no faster, but right."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    loader = make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed)

    def epoch():
        model.train()
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(model(inputs.to(device)), targets.to(device)).backward()
            optimizer.step()

    return epoch


RIGHT = [zeroing_before_the_step]


@pytest.mark.slow  # trains 4 epochs twice: tens of seconds on a CPU
@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_my_rung.check(right).startswith("✓ my_rung: accuracy")
