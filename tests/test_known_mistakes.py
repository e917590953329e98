"""One test per plausible mistake in the helpers, each of which slipped past the other tests: every test here
was run against the helper with that mistake planted, and failed."""

import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from helpers.data import make_loader, seed_worker
from helpers.grads import batch_gradient
from helpers.loop import evaluate, train_epoch
from helpers.models import MLP


def _uneven_data(samples: int = 10) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 64, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def test_train_epoch_puts_the_model_in_train_mode():
    """Mistake: train_epoch without model.train(), so a model left in eval mode trains without dropout."""
    model = MLP(dropout=0.5).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    train_epoch(
        model, make_loader(_uneven_data(), batch_size=4), optimizer, F.cross_entropy, device="cpu", progress=False
    )
    assert model.training


def test_the_epoch_loss_is_weighted_by_samples_not_a_mean_of_batch_means():
    """Mistake: the epoch's loss as the mean of the batch means (4, 4 and 2 samples here)."""
    torch.manual_seed(0)
    model, data = MLP(), _uneven_data(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put: every batch sees the same model
    result = train_epoch(
        model, make_loader(data, batch_size=4), optimizer, F.cross_entropy, device="cpu", progress=False
    )
    with torch.no_grad():
        whole = F.cross_entropy(model(data.tensors[0]), data.tensors[1]).item()
        batch_means = [F.cross_entropy(model(x), y).item() for x, y in make_loader(data, batch_size=4)]
    assert result.loss == pytest.approx(whole, rel=1e-6)
    assert abs(np.mean(batch_means) - whole) > 1e-4  # the mistake would give a different number


def test_evaluate_leaves_a_model_in_eval_mode_in_eval_mode():
    """Mistake: evaluate ends with model.train() instead of restoring the mode it found."""
    model = MLP().eval()
    evaluate(model, make_loader(_uneven_data(), batch_size=4), F.cross_entropy, device="cpu")
    assert not model.training


def test_a_checkpoint_is_flushed_and_synced_before_it_is_renamed(tmp_path, monkeypatch):
    """Mistake: the temporary file renamed over the checkpoint before its bytes reached the disk."""
    from helpers import checkpoint

    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: calls.append(("fsync", fd)) or real_fsync(fd))
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: calls.append(("replace", str(b))) or real_replace(a, b))
    target = tmp_path / "model.pt"
    checkpoint.save_checkpoint(target, nn.Linear(2, 2), epoch=0, step=0)
    names = [name for name, _ in calls]
    assert names[:2] == ["fsync", "replace"], calls  # the file's own fsync, then the rename (then the folder's)
    assert calls[1][1] == str(target)


def test_batch_gradient_starts_from_clean_gradients():
    """Mistake: batch_gradient adds to whatever .grad held from before."""
    torch.manual_seed(0)
    model, (inputs, targets) = MLP(), _uneven_data(10).tensors
    clean = batch_gradient(model, F.cross_entropy, inputs, targets).clone()
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 5.0)  # left over from some earlier backward
    assert torch.equal(batch_gradient(model, F.cross_entropy, inputs, targets), clean)


def test_all_reduce_metrics_divides_by_the_world_size_to_average(monkeypatch):
    """Mistake: average=True returning the sum."""
    import torch.distributed as dist

    from helpers.distributed import all_reduce_metrics

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None: tensor.mul_(4))  # four ranks with equal values
    assert all_reduce_metrics({"loss": 2.0}, average=True) == {"loss": 2.0}
    assert all_reduce_metrics({"loss": 2.0}) == {"loss": 8.0}


def test_median_ratio_is_the_median_of_per_round_ratios_not_a_ratio_of_medians():
    """Mistake: median(a) / median(b), which pairs rounds that did not run together."""
    from helpers.timing import median_ratio

    assert median_ratio([1.0, 10.0, 100.0], [1.0, 1.0, 1000.0]) == pytest.approx(1.0)  # ratios 1, 10, 0.1


def test_seed_worker_seeds_numpy_and_random_from_the_workers_torch_seed():
    """Mistake: seeding with the worker id, so every run (any seed) draws the same numbers in worker 0."""
    draws = {}
    for torch_seed in (1000, 2000, 1000):
        torch.manual_seed(torch_seed)  # a worker's torch seed is base_seed + worker_id
        seed_worker(0)
        draws.setdefault(torch_seed, []).append((np.random.randint(2**31), random.randrange(2**31)))
    assert draws[1000][0] == draws[1000][1]  # the same torch seed: the same numbers
    assert draws[1000][0][0] != draws[2000][0][0] and draws[1000][0][1] != draws[2000][0][1]
