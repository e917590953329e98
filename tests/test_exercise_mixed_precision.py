"""The AMP-step exercise gives each kind of mistake its own hint."""

import pytest
import torch
import torch.nn.functional as F

from helpers.exercises.mixed_precision import check_amp_step, reference_amp_step, weights_after_three_steps


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


def step_calling_optimizer_step(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    """Right but for `optimizer.step()` in place of `scaler.step(optimizer)`: it steps on inf/NaN gradients too."""
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_without_update(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def step_without_clipping(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_without_scaling_the_loss(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_unscaling_after_clipping(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.unscale_(optimizer)  # too late: clip saw the scaled gradients
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_with_backward_inside_autocast(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    """Backward inside the block, the optimizer step outside it: the documentation advises against it, but the
    weights come out the same, and the check (which compares weights and where the step ran) lets it pass."""
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_zeroing_first(model, optimizer, scaler, inputs, targets, dtype, max_norm):
    optimizer.zero_grad()  # before the step instead of after it, and to zeros rather than None: the same weights
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def step_without_autocast(model, optimizer, scaler, inputs, targets, dtype, max_norm):  # all float32
    loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_in_float16_always(model, optimizer, scaler, inputs, targets, dtype, max_norm):  # the dtype given, ignored
    with torch.autocast(inputs.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (step_inside_autocast, "ran inside autocast"),
    (step_without_zero_grad, "with bf16 .no scaling. the weights differ.*zero_grad"),
    (step_clipping_scaled_gradients, "bf16 matches but fp16 does not.*clipped while still scaled"),
    (step_calling_optimizer_step, "overflowed .*became NaN: optimizer.step.. stepped anyway.*scaler.step"),
    (step_without_update, "refused a second step: call scaler.update"),
    (step_without_clipping, "with bf16 .no scaling. the weights differ.*unclipped step"),
    (step_without_scaling_the_loss, "bf16 matches but fp16 does not: the loss was not scaled"),
    (step_unscaling_after_clipping, "bf16 matches but fp16 does not.*unscale_.optimizer. BEFORE clipping"),
    (step_without_autocast, "with bf16 .no scaling. the weights differ.*they equal a float32 step's"),
    (step_in_float16_always, "with bf16 .no scaling. the weights differ.*they equal a step under float16 autocast"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_amp_step(wrong)


RIGHT = [step_with_backward_inside_autocast, step_zeroing_first]


@pytest.mark.parametrize("right", [reference_amp_step, *RIGHT])
def test_right_steps_pass_the_check(right):
    assert check_amp_step.check(right).startswith("✓ my_amp_step gave train_epoch's weights")


def test_only_the_overflow_case_tells_optimizer_step_from_scaler_step():
    """Without an inf/NaN gradient GradScaler.step is optimizer.step after unscale_: the case with one is needed."""
    for amp in ("bf16", "fp16"):
        mine, _ = weights_after_three_steps(step_calling_optimizer_step, amp)
        assert torch.equal(mine, weights_after_three_steps(None, amp)[0])
    direct, _ = weights_after_three_steps(step_calling_optimizer_step, "fp16", overflow=True)
    skipped, _ = weights_after_three_steps(None, "fp16", overflow=True)
    assert direct.isnan().any() and skipped.isfinite().all()


def test_the_overflow_case_skips_one_step_and_halves_the_scale():
    """train_epoch's GradScaler skips the overflowing second batch: the weights are those of batches 1 and 3."""
    from helpers.exercises.mixed_precision import OVERFLOW

    scales = []

    def recording(model, optimizer, scaler, inputs, targets, dtype, max_norm):
        reference_amp_step(model, optimizer, scaler, inputs, targets, dtype, max_norm)
        scales.append(scaler.get_scale())

    with_overflow, _ = weights_after_three_steps(recording, "fp16", overflow=True)
    assert scales == [2.0**16, 2.0**15, 2.0**15] and torch.finfo(torch.float16).max < OVERFLOW
    assert torch.equal(with_overflow, weights_after_three_steps(None, "fp16", overflow=True)[0])
    assert not torch.equal(with_overflow, weights_after_three_steps(None, "fp16")[0])


def test_weights_after_three_steps_start_from_the_seed_and_note_a_step_inside_autocast():
    """The notebook compares its own steps with train_epoch through it, on its device and with its seed."""
    first, inside = weights_after_three_steps(None, "bf16", seed=1)
    again, _ = weights_after_three_steps(None, "bf16", "cpu", seed=1)
    other, _ = weights_after_three_steps(None, "bf16", seed=2)
    assert torch.equal(first, again) and not torch.equal(first, other) and not inside
    assert weights_after_three_steps(step_inside_autocast, "fp16", seed=1)[1]
