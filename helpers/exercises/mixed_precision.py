"""Mixed precision: write the AMP training step (forward and loss under autocast; scaled backward, unscale_,
clip, step and update outside it)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from helpers.data import DigitsDataset
from helpers.loop import PRECISIONS, train_epoch
from helpers.models import MLP

from . import exercise

OVERFLOW = 1e6  # the overflow case multiplies the second batch by this: beyond float16's largest number, 65,504


def reference_amp_step(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    """One mixed-precision training step: autocast forward and loss; scaled backward, unscale_, clip, step, update."""
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def weights_after_three_steps(
    step: Callable | None, amp: str, device: torch.device | str = "cpu", *, seed: int = 0, overflow: bool = False
) -> tuple[torch.Tensor, bool]:
    """Weights after 3 steps of `step` (train_epoch when None) on digits, and whether a step ran in autocast.

    `step(model, optimizer, scaler, inputs, targets, dtype, max_norm)` trains an MLP 64-32-10 (SGD, momentum 0.9)
    on the first three batches of 32 training digits, clipping to 0.1; every call starts from the same weights.
    With `overflow` the second batch is multiplied by 1e6: in float16 its forward overflows, its gradients are
    inf or NaN, and a GradScaler skips that step (and halves its scale).
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    model = MLP(64, (32,), 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    digits = DigitsDataset("train")
    batches = [(digits.images[i : i + 32].to(device), digits.targets[i : i + 32].to(device)) for i in (0, 32, 64)]
    if overflow:
        batches[1] = (batches[1][0] * OVERFLOW, batches[1][1])
    in_autocast = []
    optimizer.register_step_pre_hook(lambda *_: in_autocast.append(torch.is_autocast_enabled(device.type)))
    if step is None:
        train_epoch(
            model, batches, optimizer, F.cross_entropy, device=device, amp=amp, max_grad_norm=0.1, progress=False
        )
    else:
        scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
        for inputs, targets in batches:
            step(model, optimizer, scaler, inputs, targets, PRECISIONS[amp], 0.1)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), any(in_autocast)


def _step_with(model, optimizer, scaler, inputs, targets, dtype, max_norm, *, mistake: str) -> None:
    """The reference step with one known `mistake`, to name the learner's when their weights equal its weights."""
    used = torch.float16 if mistake == "float16 always" else dtype
    enabled = mistake != "no autocast"
    with torch.autocast(inputs.device.type, dtype=used, enabled=enabled):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    if mistake == "clipped while scaled":
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.unscale_(optimizer)
    if mistake not in ("no clipping", "clipped while scaled"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    if mistake != "no zero_grad":
        optimizer.zero_grad(set_to_none=True)


# Each known mistake: the precision where it first shows, and what its hint says after the hint's first part.
_MISTAKES = {
    "no autocast": (
        "bf16",
        "they equal a float32 step's: the forward and the loss ran without autocast; put them under "
        "torch.autocast(inputs.device.type, dtype=dtype)",
    ),
    "float16 always": (
        "bf16",
        "they equal a step under float16 autocast: use the dtype the step is given, "
        "torch.autocast(inputs.device.type, dtype=dtype), not a fixed one",
    ),
    "no clipping": (
        "bf16",
        "they equal an unclipped step's: clip_grad_norm_(model.parameters(), max_norm) after backward",
    ),
    "no zero_grad": (
        "bf16",
        "old gradients were added to new ones: optimizer.zero_grad(set_to_none=True) after the step",
    ),
    "clipped while scaled": (
        "fp16",
        "the gradients were clipped while still scaled: scaler.unscale_(optimizer) BEFORE clipping",
    ),
}
_FIRST_PART = {
    "bf16": "hint: with bf16 (no scaling) the weights differ from train_epoch's: ",
    "fp16": "hint: bf16 matches but fp16 does not: ",
}
_IN_GENERAL = {  # what follows the first part when the weights match no known mistake's
    "bf16": (
        "forward and loss under torch.autocast(inputs.device.type, dtype=dtype); then backward, "
        "clip_grad_norm_(model.parameters(), max_norm), optimizer step, and zero_grad(set_to_none=True) so no "
        "gradient leaks into the next step"
    ),
    "fp16": (
        "scaler.scale(loss).backward(), then scaler.unscale_(optimizer) BEFORE clipping, then "
        "scaler.step(optimizer) and scaler.update()"
    ),
}
_NOT_SCALED = "the loss was not scaled: scaler.scale(loss).backward(), not loss.backward()"
_NO_UPDATE = (
    "hint: the GradScaler refused a second step: call scaler.update() once after every scaler.step(optimizer), so "
    "that each step starts afresh and the scale follows the overflows"
)
# What GradScaler raises when a step begins before update() ended the last one (torch 2.6 to 2.14 alike).
_SCALER_REFUSALS = ("since the last update()", "unscale_() is being called after step()")
_OPTIMIZER_STEP = (
    "hint: on the float16 batch that overflowed (inf/NaN gradients) the weights became {what}: optimizer.step() "
    "stepped anyway. Call scaler.step(optimizer) instead: it skips a step whose gradients are not finite"
)
_OVERFLOW_DIFFERS = (
    "hint: fp16 matches until a batch overflows (inf/NaN gradients): there train_epoch's GradScaler skipped the "
    "step and halved the scale. Call scaler.step(optimizer), then scaler.update(), on every step"
)


def _weights(step: Callable | None, amp: str, *, overflow: bool = False) -> tuple[torch.Tensor, bool]:
    """weights_after_three_steps on the CPU; GradScaler's refusals (a step before update(), unscale_ before scale) as hints."""
    try:
        return weights_after_three_steps(step, amp, overflow=overflow)
    except RuntimeError as error:
        if any(refusal in str(error) for refusal in _SCALER_REFUSALS):
            raise AssertionError(_NO_UPDATE) from error
        raise
    except AssertionError as error:  # GradScaler's own: "Attempted unscale_ but _scale is None. ..."
        if "_scale is None" in str(error):
            raise AssertionError(_FIRST_PART["fp16"] + _NOT_SCALED) from error
        raise


def _what_went_wrong(mine: torch.Tensor, amp: str) -> str:
    """What the hint says after its first part: the known mistake whose weights in `amp` equal `mine`, if any."""
    for mistake, (shows_in, says) in _MISTAKES.items():
        if shows_in == amp and torch.equal(mine, _weights(functools.partial(_step_with, mistake=mistake), amp)[0]):
            return says
    return _IN_GENERAL[amp]


@exercise("my_amp_step", reference=reference_amp_step)
def check_amp_step(my_amp_step: Callable) -> str:
    """3 steps of my_amp_step on the CPU in bf16 and fp16, and in fp16 with an overflowing batch, must give
    train_epoch(amp=..., max_grad_norm=0.1)'s weights bit for bit."""
    for amp in ("bf16", "fp16"):
        (mine, inside), (helper, _) = _weights(my_amp_step, amp), weights_after_three_steps(None, amp)
        assert not inside, (
            "hint: optimizer.step() ran inside autocast: close the `with torch.autocast(...)` block after the loss"
        )
        if not torch.equal(mine, helper):
            raise AssertionError(_FIRST_PART[amp] + _what_went_wrong(mine, amp))
    mine, helper = (_weights(step, "fp16", overflow=True)[0] for step in (my_amp_step, None))
    if not mine.isfinite().all():
        raise AssertionError(_OPTIMIZER_STEP.format(what="NaN" if mine.isnan().any() else "inf"))
    assert torch.equal(mine, helper), _OVERFLOW_DIFFERS
    return "✓ my_amp_step gave train_epoch's weights bit for bit in bf16 and fp16, and skipped the step that overflowed"
