"""The replicas'-gradient exercise gives each kind of mistake its own hint."""

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers.exercises.multi_gpu import check_gradient_from_replicas
from helpers.grads import flat_grad


def plain_mean_over_replicas(model, inputs, targets, n_devices):
    grads = []
    for piece_inputs, piece_targets in zip(inputs.chunk(n_devices), targets.chunk(n_devices)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(piece_inputs), piece_targets).backward()
        grads.append(flat_grad(replica))
    return torch.stack(grads).mean(dim=0)  # right only when the pieces are equally large


def backward_on_the_model(model, inputs, targets, n_devices):
    total = 0
    for piece_inputs, piece_targets in zip(inputs.chunk(n_devices), targets.chunk(n_devices)):
        model.zero_grad()
        F.cross_entropy(model(piece_inputs), piece_targets).backward()  # the right numbers, left on model itself
        total = total + flat_grad(model) * len(piece_targets)
    return total / len(targets)


def per_parameter_tensors(model, inputs, targets, n_devices):
    totals = [torch.zeros_like(p) for p in model.parameters()]
    for piece_inputs, piece_targets in zip(inputs.chunk(n_devices), targets.chunk(n_devices)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(piece_inputs), piece_targets).backward()
        for total, p in zip(totals, replica.parameters()):
            total += p.grad * len(piece_targets) / len(targets)
    return totals  # one tensor per parameter, not one flat vector


def summed_losses(model, inputs, targets, n_devices):
    total = 0
    for piece_inputs, piece_targets in zip(inputs.chunk(n_devices), targets.chunk(n_devices)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(piece_inputs), piece_targets).backward()
        total = total + flat_grad(replica)  # summed, as DataParallel's backward does, but never averaged
    return total


def one_replica_for_all_pieces(model, inputs, targets, n_devices):
    replica, total = copy.deepcopy(model), 0
    for piece_inputs, piece_targets in zip(inputs.chunk(n_devices), targets.chunk(n_devices)):
        F.cross_entropy(replica(piece_inputs), piece_targets).backward()  # adds to the earlier pieces' .grad
        total = total + flat_grad(replica) * len(piece_targets)
    return total / len(targets)


def divided_by_the_devices(model, inputs, targets, n_devices):
    total = 0
    for piece_inputs, piece_targets in zip(inputs.chunk(n_devices), targets.chunk(n_devices)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(piece_inputs), piece_targets).backward()
        total = total + flat_grad(replica) * len(piece_targets)
    return total / n_devices  # weighted by rows, but divided by the replicas instead of the rows


def one_gradient_per_replica(model, inputs, targets, n_devices):  # the replicas' gradients, never combined
    grads = []
    for piece_inputs, piece_targets in zip(inputs.chunk(n_devices), targets.chunk(n_devices)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(piece_inputs), piece_targets).backward()
        grads.append(flat_grad(replica) * len(piece_targets) / len(targets))
    return grads


def first_piece_only(model, inputs, targets, n_devices):  # the gradient on GPU 0's piece, as if it were the batch
    replica = copy.deepcopy(model)
    F.cross_entropy(replica(inputs.chunk(n_devices)[0]), targets.chunk(n_devices)[0]).backward()
    return flat_grad(replica)


def pieces_of_n_rows(model, inputs, targets, n_devices):  # split(n): pieces of n rows each, not n pieces
    total = 0
    for piece_inputs, piece_targets in zip(inputs.split(n_devices), targets.split(n_devices)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(piece_inputs), piece_targets).backward()
        total = total + flat_grad(replica) * len(piece_targets)
    return total / len(targets)  # still the full-batch gradient: any cut, weighted by rows, gives it


def pieces_cut_by_tensor_split(model, inputs, targets, n_devices):  # [4, 3, 3] for 10 rows where chunk cuts [4, 4, 2]
    total = 0
    for piece_inputs, piece_targets in zip(inputs.tensor_split(n_devices), targets.tensor_split(n_devices)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(piece_inputs), piece_targets, reduction="sum").backward()
        total = total + flat_grad(replica)
    return total / len(targets)


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (plain_mean_over_replicas, "a plain mean over the replicas counts a short piece"),
    (backward_on_the_model, "`model` now holds gradients"),
    (per_parameter_tensors, "return one flat vector"),
    (summed_losses, "backpropagate each piece's mean cross_entropy on its own replica"),
    (one_replica_for_all_pieces, r"off by up to .* with 32 rows in pieces of \[16, 16\]: .*on its own replica"),
    (divided_by_the_devices, r"off by up to [0-9.]+e\+00 with 32 rows in pieces of \[16, 16\]"),
    (pieces_of_n_rows, r"with 32 rows on 2 devices the forward passes got \[2, 2, .*inputs.split\(2\) pieces of 2"),
    (one_gradient_per_replica, "return one flat vector .* got list"),
    (first_piece_only, r"the forward passes got \[16\] rows, but nn.DataParallel cuts the batch with torch.chunk into"),
    (pieces_cut_by_tensor_split, r"forward passes got \[4, 3, 3\] rows, but .* torch.chunk into \[4, 4, 2\]"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_gradient_from_replicas(wrong)


def summed_per_piece(model, inputs, targets, n_devices):
    """Each replica's summed loss, the total divided by the rows once: the same gradient, weighted implicitly."""
    total = 0
    for piece_inputs, piece_targets in zip(inputs.chunk(n_devices), targets.chunk(n_devices)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(piece_inputs), piece_targets, reduction="sum").backward()
        total = total + flat_grad(replica)
    return total / len(targets)


RIGHT = [summed_per_piece]


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_gradient_from_replicas.check(right).startswith("✓ gradient_from_replicas gave the full-batch gradient")
