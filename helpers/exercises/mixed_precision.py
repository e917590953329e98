"""Mixed precision: write the AMP training step (forward and loss under autocast; scaled backward, unscale_,
clip, step and update outside it)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from helpers.data import DigitsDataset
from helpers.loop import PRECISIONS, train_epoch
from helpers.models import MLP

from . import exercise


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
    step: Callable | None, amp: str, device: torch.device | str = "cpu", *, seed: int = 0
) -> tuple[torch.Tensor, bool]:
    """Weights after 3 steps of `step` (train_epoch when None) on digits, and whether a step ran in autocast.

    `step(model, optimizer, scaler, inputs, targets, dtype, max_norm)` trains an MLP 64-32-10 (SGD, momentum 0.9)
    on the first three batches of 32 training digits, clipping to 0.1; every call starts from the same weights.
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    model = MLP(64, (32,), 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    digits = DigitsDataset("train")
    batches = [(digits.images[i : i + 32].to(device), digits.targets[i : i + 32].to(device)) for i in (0, 32, 64)]
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


@exercise("my_amp_step", reference=reference_amp_step)
def check_amp_step(my_amp_step: Callable) -> str:
    """3 steps of my_amp_step on the CPU in bf16 and fp16 must give train_epoch(amp=..., max_grad_norm=0.1)'s weights."""
    same = {}
    for amp in ("bf16", "fp16"):
        (mine, inside), (helper, _) = weights_after_three_steps(my_amp_step, amp), weights_after_three_steps(None, amp)
        assert not inside, (
            "hint: optimizer.step() ran inside autocast: close the `with torch.autocast(...)` block after the loss"
        )
        same[amp] = torch.equal(mine, helper)
    assert same["bf16"], (
        "hint: with bf16 (no scaling) the weights differ from train_epoch's: forward and loss under "
        "torch.autocast(inputs.device.type, dtype=dtype); then backward, clip_grad_norm_(model.parameters(), max_norm), "
        "optimizer step, and zero_grad(set_to_none=True) so no gradient leaks into the next step"
    )
    assert same["fp16"], (
        "hint: bf16 matches but fp16 does not: scaler.scale(loss).backward(), then scaler.unscale_(optimizer) BEFORE "
        "clipping, then scaler.step(optimizer) and scaler.update()"
    )
    return "✓ my_amp_step gave train_epoch's weights bit for bit after 3 steps, in bf16 and in fp16 with a GradScaler"
