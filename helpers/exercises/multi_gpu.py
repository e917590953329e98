"""Multi-GPU: the gradient a data-parallel step applies, from replicas that got unequal torch.chunk pieces of a batch
(as nn.DataParallel cuts it), equal to the gradient of the mean loss over the whole batch."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

from helpers.grads import flat_grad
from helpers.workers.common import gradient_batch, mlp
from helpers.workers.ddp import full_batch_gradient

from . import exercise

SEED = 0
CASES = ((2, 32), (2, 33), (3, 10), (4, 5))  # (devices, rows): even pieces, then [17, 16], [4, 4, 2], [2, 2, 1]


def reference_gradient_from_replicas(model, inputs, targets, n_devices):
    """The gradient of the mean loss over the batch, from one replica per torch.chunk piece."""
    total = 0
    for piece_inputs, piece_targets in zip(inputs.chunk(n_devices), targets.chunk(n_devices)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(piece_inputs), piece_targets).backward()
        total = total + flat_grad(replica) * len(piece_targets)  # a piece counts by its rows
    return total / len(targets)


def _pieces(rows: int, n_devices: int) -> list[int]:
    return [len(piece) for piece in torch.arange(rows).chunk(n_devices)]


@exercise("gradient_from_replicas", reference=reference_gradient_from_replicas)
def check_gradient_from_replicas(gradient_from_replicas: Callable) -> str:
    """On a seeded MLP and digits, the learner's gradient must equal one process's full-batch gradient, per case."""
    worst = 0.0
    for n_devices, rows in CASES:
        inputs, targets = gradient_batch(SEED, rows)
        model = mlp(SEED, (64,))
        seen: list[int] = []  # the rows each forward got: the hook travels into every copy.deepcopy(model)
        model.register_forward_pre_hook(lambda module, args, seen=seen: seen.append(len(args[0])))
        mine = gradient_from_replicas(model, inputs, targets, n_devices)
        expected = full_batch_gradient(SEED, inputs, targets)
        assert all(p.grad is None for p in model.parameters()), (
            "hint: `model` now holds gradients: call backward on each copy.deepcopy(model) replica, not on model"
        )
        assert isinstance(mine, torch.Tensor) and mine.shape == expected.shape, (
            f"hint: return one flat vector of {expected.numel()} numbers (flat_grad(replica) gives one per "
            f"replica), not one tensor per parameter; got {type(mine).__name__}"
        )
        pieces = _pieces(rows, n_devices)
        assert sorted(seen) == sorted(pieces), (
            f"hint: with {rows} rows on {n_devices} devices the forward passes got {seen} rows, but nn.DataParallel "
            f"cuts the batch with torch.chunk into {pieces}: inputs.chunk({n_devices}) makes {n_devices} pieces, "
            f"inputs.split({n_devices}) pieces of {n_devices} rows; run one replica per chunk"
        )
        assert torch.allclose(mine, expected, rtol=1e-4, atol=1e-6), (
            f"hint: off by up to {float((mine - expected).abs().max()):.1e} with {rows} rows in pieces of {pieces}"
            + (
                ": a plain mean over the replicas counts a short piece as much as a full one; weight each replica's "
                f"gradient by its rows, then divide by all {rows}"
                if len(set(pieces)) > 1
                else ": backpropagate each piece's mean cross_entropy on its own replica, then combine the gradients"
            )
        )
        worst = max(worst, float((mine - expected).abs().max()))
    shapes = ", ".join(str(_pieces(rows, n)) for n, rows in CASES[1:])
    return f"✓ gradient_from_replicas gave the full-batch gradient for pieces {shapes} (max diff {worst:.0e})"
