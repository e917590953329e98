"""The AMP-step exercise gives each kind of mistake its own hint."""

import pytest
import torch
import torch.nn.functional as F

from helpers.exercises.mixed_precision import check_amp_step, weights_after_three_steps


def step_inside_autocast(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_without_zero_grad(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def step_clipping_scaled_gradients(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # before unscale_: clips the scaled gradients
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (step_inside_autocast, "ran inside autocast"),
        (step_without_zero_grad, "with bf16 .no scaling. the weights differ"),
        (step_clipping_scaled_gradients, "bf16 matches but fp16 does not"),
    ],
)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_amp_step(wrong)


def test_weights_after_three_steps_start_from_the_seed_and_note_a_step_inside_autocast():
    """The notebook compares its own steps with train_epoch through it, on its device and with its seed."""
    first, inside = weights_after_three_steps(None, "bf16", seed=1)
    again, _ = weights_after_three_steps(None, "bf16", "cpu", seed=1)
    other, _ = weights_after_three_steps(None, "bf16", seed=2)
    assert torch.equal(first, again) and not torch.equal(first, other) and not inside
    assert weights_after_three_steps(step_inside_autocast, "fp16", seed=1)[1]
