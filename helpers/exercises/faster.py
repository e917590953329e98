"""Faster training: add a rung of your own to the ladder, `my_rung(model, train_set, *, batch_size, lr, seed,
device)`, returning a function that trains `model` for one epoch with the speed-ups you chose. The check makes
sure it still trains correctly (every parameter updated, one optimizer step per `batch_size` images, accuracy
within a tolerance of the plain loop's) and measures its throughput against the plain loop's, in the same rounds."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from helpers.data import DigitsDataset, make_loader
from helpers.devices import pick_device
from helpers.loop import evaluate, train_epoch
from helpers.models import SmallCNN
from helpers.rig import measure

from . import exercise

BATCH_SIZE, LR, SEED, CHANNELS = 64, 3e-3, 0, 8
EPOCHS = 4  # each rung trains this many epochs: one alone, then EPOCHS - 1 timed rounds
ACCURACY_TOLERANCE = 0.05  # how far below the plain loop's test accuracy a rung may end


def reference_my_rung(model, train_set, *, batch_size, lr, seed, device):
    """One rung: the plain loop with a fused AdamW (one kernel updates every parameter)."""
    loader = make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def epoch():
        model.train()
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return epoch


def plain_rung(model, train_set, *, batch_size, lr, seed, device) -> Callable[[], object]:
    """The ladder's first rung, the one every other is measured against: the plain loop with AdamW's defaults."""
    loader = make_loader(train_set, batch_size=batch_size, shuffle=True, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return functools.partial(train_epoch, model, loader, optimizer, F.cross_entropy, device=device, progress=False)


@functools.cache
def _digits() -> tuple[DigitsDataset, DigitsDataset]:
    return DigitsDataset("train", size=28), DigitsDataset("test", size=28)


def _fresh_model(device: torch.device) -> SmallCNN:
    """The same untrained CNN every call; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return SmallCNN(channels=CHANNELS).to(device)


def _one_epoch_counting_steps(epoch: Callable[[], object]) -> int:
    """Run epoch() once; return how many optimizer steps it took (any optimizer, fused or compiled too)."""
    steps = []
    handle = register_optimizer_step_post_hook(lambda *_: steps.append(1))
    try:
        epoch()
    finally:
        handle.remove()
    return len(steps)


def _first_epoch(my_rung: Callable, train_set: DigitsDataset, seed: int, device: torch.device) -> list[torch.Tensor]:
    """A fresh model's parameters after my_rung's first epoch with this seed."""
    model = _fresh_model(device)
    my_rung(model, train_set, batch_size=BATCH_SIZE, lr=LR, seed=seed, device=device)()
    return [p.detach() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal up to the run-to-run noise of a GPU's kernels (a different order of the data moves far more)."""
    return all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(a, b))


def _check_order(my_rung: Callable, first: list[torch.Tensor], train_set: DigitsDataset, device: torch.device) -> None:
    """The data order is shuffled, and drawn from `seed`: the same seed again gives the same first epoch, another
    seed another one (the model starts the same every time, so only the order can differ)."""
    assert _same(first, _first_epoch(my_rung, train_set, SEED, device)), (
        f"hint: two first epochs with seed={SEED} ended with different weights: the order of the data ignores "
        "`seed`; draw it from the seed, make_loader(train_set, ..., shuffle=True, seed=seed) (or a DataLoader "
        "with generator=torch.Generator().manual_seed(seed))"
    )
    assert not _same(first, _first_epoch(my_rung, train_set, SEED + 1, device)), (
        f"hint: first epochs with seed={SEED} and seed={SEED + 1} ended with the same weights: the data comes in "
        "one fixed order; shuffle it (shuffle=True), from the seed"
    )


@exercise("my_rung", reference=reference_my_rung)
def check_my_rung(my_rung: Callable) -> str:
    """my_rung's epoch must update every parameter of the model given, step once per BATCH_SIZE images, visit the
    data in an order shuffled from `seed`, and end within ACCURACY_TOLERANCE of the plain loop's test accuracy; its
    throughput is measured against the plain loop."""
    device = pick_device()
    train_set, test_set = _digits()
    model = _fresh_model(device)
    epoch = my_rung(model, train_set, batch_size=BATCH_SIZE, lr=LR, seed=SEED, device=device)
    assert callable(epoch), (
        f"hint: my_rung must return a function that trains one epoch when called (def epoch(): ...; return epoch), "
        f"got {type(epoch).__name__}"
    )
    before = [p.detach().clone() for p in model.parameters()]
    steps = _one_epoch_counting_steps(epoch)
    changed = [not torch.equal(old, p.detach()) for old, p in zip(before, model.parameters())]
    assert steps > 0, (
        "hint: one epoch ran no optimizer.step(): after backward(), call optimizer.step() (or scaler.step)"
    )
    assert any(changed), (
        "hint: the optimizer stepped, but the model given did not change: build the optimizer over this very model's "
        "parameters (torch.compile(model) shares them; copy.deepcopy(model) or a new model trains in its place)"
    )
    assert all(changed), (
        f"hint: {changed.count(False)} of the model's {len(changed)} parameter tensors did not change: give the "
        "optimizer all of model.parameters() and let every one of them get a gradient"
    )
    fewest, most = len(train_set) // BATCH_SIZE, math.ceil(len(train_set) / BATCH_SIZE)
    assert 0.75 * fewest <= steps <= most, (
        f"hint: an epoch of {len(train_set)} images in batches of {BATCH_SIZE} takes {fewest} or {most} optimizer "
        f"steps; yours took {steps}. Keep {BATCH_SIZE} images per step: a bigger batch makes fewer, larger steps; "
        "micro-batches must accumulate their gradients and step once per batch_size images"
    )
    _check_order(my_rung, [p.detach().clone() for p in model.parameters()], train_set, device)
    plain_model = _fresh_model(device)
    plain = plain_rung(plain_model, train_set, batch_size=BATCH_SIZE, lr=LR, seed=SEED, device=device)
    plain()  # the plain loop's first epoch too, so both rungs have trained as long in every timed round
    timing = measure({"plain": plain, "yours": epoch}, device=device, repeat=EPOCHS - 1, warmup=0, unit="epoch")
    test_loader = make_loader(test_set, batch_size=256)
    mine, theirs = (evaluate(m, test_loader, F.cross_entropy, device=device).accuracy for m in (model, plain_model))
    assert mine >= theirs - ACCURACY_TOLERANCE, (
        f"hint: after {EPOCHS} epochs your rung reached test accuracy {mine:.3f}, the plain loop {theirs:.3f}: a "
        "speed-up must not change what is learned. Zero the gradients after every step "
        "(optimizer.zero_grad(set_to_none=True)), keep only forward and loss under autocast, and keep lr"
    )
    low, high = timing.ratio_spread("yours")
    return (
        f"✓ my_rung: accuracy {mine:.3f} (plain {theirs:.3f}), x{1 / timing.time_ratio('yours'):.2f} the plain "
        f"loop's speed (middle half {1 / high:.2f}-{1 / low:.2f})"
    )
