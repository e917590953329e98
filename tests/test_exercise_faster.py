"""The my_rung exercise gives each kind of mistake its own hint."""

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers.data import make_loader
from helpers.exercises.faster import check_my_rung


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


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (returns_nothing, "must return a function that trains one epoch"),
        (never_steps, "ran no optimizer.step"),
        (trains_a_copy, "the model given did not change"),
        (trains_only_the_head, "parameter tensors did not change"),
        (doubles_the_batch, "optimizer steps; yours took"),
        (steps_every_micro_batch, "micro-batches must accumulate"),
        (forgets_zero_grad, "Zero the gradients after every step"),
    ],
)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_my_rung(wrong)
