"""The capstone (a small GPT): write the training script's optimizer step by hand, `my_train_step(run, batches)`,
the same step as helpers.cli.train_gpt.train_step (written faster if you like), and time it against train_step.

The check builds tiny runs of the script on the lesson's corpus (the standard library's source), on the CPU with one
thread, and compares three steps of yours with three of train_step from the same seed: in fp32 with 2 micro-batches
and clipping, in bf16, and without clipping. A step may be written otherwise (compiled, reordered) and round
elsewhere: TOLERANCES says how far from train_step's it may be."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from helpers.checkpoint import capture_rng_state, restore_rng_state
from helpers.cli.train_gpt import Config, Run, build, gradient_sync, precision_context, train_step
from helpers.devices import num_threads
from helpers.loop import has_pending_gradients
from helpers.rig import measure

from . import exercise

STEPS = 3  # optimizer steps of each case
# How far from train_step's your step may be, relatively: the loss, the gradient the optimizer gets, and the update it
# makes (new weights minus old). A step written otherwise (a torch.compile'd model, one backward of the summed
# losses, one forward of all the micro-batches) rounds elsewhere: measured at most 2e-7, 7e-7 and 3e-5 in fp32, and
# 1e-5, 2e-3 and 2e-2 in bf16 (Adam's first steps move each weight by about lr whatever its gradient's size, so a
# gradient near 0 that flips sign moves the update). The mistakes the hints name are off by 0.4 or more (bf16's
# forward in float32, off by 3e-3 in the gradient, is told by matching a float32 step instead).
TOLERANCES = {"fp32": (1e-5, 1e-4, 1e-3), "bf16": (1e-3, 5e-2, 1e-1)}
# A GPT of 2 layers, width 32, context 32, on the lesson's corpus: the standard library's source, read as bytes
TINY = dict(block_size=32, n_layer=2, n_head=2, n_embd=32, batch_size=4, steps=20, warmup=2)
CASES = {  # what each case shows, and its switches
    "fp32 with 2 micro-batches": dict(accumulation=2, grad_clip=1.0, precision="fp32"),
    "bf16": dict(accumulation=1, grad_clip=1.0, precision="bf16"),
    "fp32 without clipping": dict(accumulation=2, grad_clip=0.0, precision="fp32"),
}
TIMED_ROUNDS = 10  # interleaved rounds of one step each, after 2 rounds of warm-up


def reference_my_train_step(run, batches):
    """One optimizer step of `run`: config.accumulation micro-batches from `batches`; returns the mean loss."""
    config, device = run.config, run.device
    total = torch.zeros((), device=device)
    for micro in range(config.accumulation):
        inputs, targets = next(batches)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with gradient_sync(run, sync=micro == config.accumulation - 1):  # DDP: average on the last only
            with precision_context(run):  # autocast for bf16 and fp16
                logits = run.model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / config.accumulation
            run.scaler.scale(loss).backward()  # scaled in fp16; as it is otherwise
        total += loss.detach()
    if config.grad_clip:  # 0: no clipping
        run.scaler.unscale_(run.optimizer)
        nn.utils.clip_grad_norm_(run.model.parameters(), config.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return total


def _config(case: str, **changes: Any) -> Config:
    switches = {**TINY, **CASES[case], **changes}
    return Config(progress=False, sample_tokens=0, **switches)


class _CountedBatches:
    """The run's batches, counting how many were drawn."""

    def __init__(self, batches: Iterator) -> None:
        self.batches, self.drawn = batches, 0

    def __iter__(self) -> _CountedBatches:
        return self

    def __next__(self) -> Any:
        self.drawn += 1
        return next(self.batches)


@dataclass
class _Steps:
    """What STEPS calls of a step function did to a fresh run, call by call."""

    run: Run
    batches: _CountedBatches
    returned: list[Any] = field(default_factory=list)
    drawn: list[int] = field(default_factory=list)  # batches drawn
    stepped: list[int] = field(default_factory=list)  # steps of run.optimizer
    scheduled: list[int] = field(default_factory=list)  # steps of run.scheduler
    pending: list[bool] = field(default_factory=list)  # gradients left in .grad after the call
    used: list[torch.Tensor] = field(default_factory=list)  # the gradient each run.optimizer step used
    weights: list[torch.Tensor] = field(default_factory=list)  # before the first call, then after each


def _flat(tensors: Iterator[torch.Tensor | None], like: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([(t if t is not None else torch.zeros_like(p)).detach().flatten() for t, p in zip(tensors, like)])


def _call(step: Callable, run: Run, batches: _CountedBatches) -> Any:
    """step(run, batches), a mistake it raises turned into a hint."""
    try:
        return step(run, batches)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as error:
        raise AssertionError(
            f"hint: my_train_step(run, batches) raised {type(error).__name__}: {str(error)[:200]}. It gets run, a "
            "helpers.cli.train_gpt.Run (run.model, run.optimizer, run.scheduler, run.scaler, run.config, "
            "run.device), and batches, an iterator: next(batches) gives one micro-batch (inputs, targets)"
        ) from error


def _steps(step: Callable, case: str, **changes: Any) -> _Steps:
    """STEPS calls of `step` on a fresh run of `case` (with `changes` to its config), from its first batch, recorded."""
    run = build(_config(case, **changes), torch.device("cpu"))  # seeded with config.seed: the same weights every time
    record = _Steps(run, _CountedBatches(run.batches(0)))
    parameters = [p for group in run.optimizer.param_groups for p in group["params"]]
    steps: list[int] = []
    used = run.optimizer.register_step_pre_hook(
        lambda *_: record.used.append(_flat((p.grad for p in parameters), parameters))
    )
    counted = register_optimizer_step_post_hook(lambda optimizer, *_: steps.append(optimizer is run.optimizer))
    record.weights.append(_flat(iter(parameters), parameters))  # torch.cat: a copy
    try:
        for _ in range(STEPS):
            drawn, stepped, scheduled = record.batches.drawn, sum(steps), run.scheduler.last_epoch
            record.returned.append(_call(step, run, record.batches))
            record.drawn.append(record.batches.drawn - drawn)
            record.stepped.append(sum(steps) - stepped)
            record.scheduled.append(run.scheduler.last_epoch - scheduled)
            record.pending.append(has_pending_gradients(run.module))
            record.weights.append(_flat(iter(parameters), parameters))
    finally:
        used.remove()
        counted.remove()
    return record


def _last_micro_batch_only(run: Run, batches: Iterator) -> torch.Tensor:
    """train_step with the gradients zeroed before each micro-batch: only the last one's reaches the step."""
    total = torch.zeros(())
    for _ in range(run.config.accumulation):
        run.optimizer.zero_grad(set_to_none=True)
        inputs, targets = next(batches)
        with precision_context(run):
            loss = F.cross_entropy(run.model(inputs).flatten(0, 1).float(), targets.flatten()) / run.config.accumulation
        loss.backward()
        total += loss.detach()
    if run.config.grad_clip:
        nn.utils.clip_grad_norm_(run.model.parameters(), run.config.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return total


def _first_micro_batch_losses(case: str) -> list[float]:
    """The loss of each micro-batch of the first step, under the run's precision."""
    run = build(_config(case), torch.device("cpu"))
    batches, losses = run.batches(0), []
    with torch.no_grad():
        for _ in range(run.config.accumulation):
            inputs, targets = next(batches)
            with precision_context(run):
                losses.append(float(F.cross_entropy(run.model(inputs).flatten(0, 1).float(), targets.flatten())))
    return losses


def _check_calls(mine: _Steps, case: str) -> None:
    """Each call drew `accumulation` batches, stepped the optimizer and the schedule once, returned a detached
    0-d tensor and left no gradients behind."""
    accumulation = mine.run.config.accumulation
    for drawn in mine.drawn:
        assert drawn >= accumulation, (
            f"hint: in {case}, one call drew {drawn} batch(es) with config.accumulation = {accumulation}: use "
            f"every micro-batch of the step, one next(batches) each: for micro in range(run.config.accumulation)"
        )
        assert drawn == accumulation, (
            f"hint: in {case}, one call drew {drawn} batches, {drawn - accumulation} more than config.accumulation "
            f"= {accumulation}: a batch drawn too many is lost to the next step (zip(batches, range(k)) draws one "
            "before it sees the range end); draw exactly accumulation, one next(batches) per micro-batch"
        )
    for stepped in mine.stepped:
        assert stepped > 0, (
            "hint: run.optimizer did not step: after the micro-batches' backward(), call "
            "run.scaler.step(run.optimizer) then run.scaler.update()"
        )
        assert stepped == 1, (
            f"hint: run.optimizer stepped {stepped} times in one call: once per micro-batch. Add up the micro-batches' "
            "gradients (backward() on each) and step once, after the last"
        )
    for returned in mine.returned:
        got = "None" if returned is None else type(returned).__name__
        assert isinstance(returned, torch.Tensor), (
            f"hint: my_train_step returned {got}: return the step's mean loss as a 0-d tensor, "
            "the sum of the micro-batches' loss.detach() (each loss divided by accumulation). Not .item(): on a GPU "
            "that makes the CPU wait for every step"
        )
        assert not returned.requires_grad, (
            "hint: the loss returned still holds its graph (requires_grad=True), and with it every micro-batch's "
            "activations until the caller lets go: add up loss.detach(), not loss"
        )
        assert returned.dim() == 0, (
            f"hint: the loss returned has shape {list(returned.shape)}: return one number, a 0-d tensor (the sum of "
            "the micro-batches' detached losses, each divided by accumulation)"
        )
    for pending in mine.pending:
        assert not pending, (
            "hint: gradients were left in .grad after the step, to be added to the next step's: call "
            "run.optimizer.zero_grad(set_to_none=True) after run.scaler.step(run.optimizer)"
        )
    for scheduled in mine.scheduled:
        assert scheduled == 1, (
            f"hint: the learning-rate schedule moved {scheduled} step(s) in one call: call run.scheduler.step() "
            "once per optimizer step, after it"
        )


def _off(mine: torch.Tensor | float, theirs: torch.Tensor | float) -> float:
    """How far `mine` is from `theirs`, relatively: |mine - theirs| / |theirs| (norms for tensors)."""
    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
        return float((mine - theirs).norm() / theirs.norm().clamp_min(1e-30))
    return abs(float(mine) - float(theirs)) / max(abs(float(theirs)), 1e-30)


def _loss_hint(mine: float, theirs: float, case: str) -> str:
    """The hint for a first step whose loss is not train_step's: which known mistake it matches."""
    config = _config(case)
    accumulation, tolerance = config.accumulation, TOLERANCES[config.precision][0]
    last = _first_micro_batch_losses(case)[-1]
    if accumulation > 1 and _off(mine, accumulation * theirs) <= tolerance:
        return (
            f"the loss returned, {mine:.6f}, is {accumulation} (accumulation) times train_step's {theirs:.6f}: the "
            "sum of the micro-batches' losses, not their mean. Divide each micro-batch's loss by "
            "run.config.accumulation before backward() and before adding it up"
        )
    if accumulation > 1 and min(_off(mine, last), _off(mine, last / accumulation)) <= tolerance:
        return (
            f"the loss returned, {mine:.6f}, is the last micro-batch's only: return the mean over the step, the sum "
            f"of every micro-batch's loss.detach() / accumulation (train_step's: {theirs:.6f})"
        )
    return (
        f"in {case} the first step's loss is {mine:.6f}, train_step's {theirs:.6f}: for each micro-batch, "
        "F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / accumulation under "
        "precision_context(run); return their sum, detached"
    )


def _parallel(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same direction (whatever the lengths)."""
    return float(F.cosine_similarity(a, b, dim=0)) > 1 - 1e-5


def _gradient_hint(mine: torch.Tensor, theirs: torch.Tensor, case: str, step: int) -> str:
    """The hint for gradients that reached the optimizer's step unlike train_step's: which known mistake."""
    config = _config(case)
    first = f"in {case} the gradients that reached step {step}'s optimizer.step()"
    if not mine.any():
        if not config.grad_clip:
            return (
                f"{first} were all zero: clip_grad_norm_ with max_norm 0 zeroes them. grad_clip = 0 means no "
                "clipping: clip only `if run.config.grad_clip:`"
            )
        return f"{first} were all zero: zero_grad() goes after the optimizer's step, not between backward and step"
    ratio = float(mine.norm() / theirs.norm())
    if _parallel(mine, theirs):
        if not config.grad_clip and ratio < 1:
            return (
                f"{first} were clipped ({ratio:.2f}x train_step's length), but config.grad_clip is 0: no clipping. "
                "Clip only `if run.config.grad_clip:`, to max_norm=run.config.grad_clip"
            )
        if config.accumulation > 1 and abs(ratio - config.accumulation) < 1e-3:
            return (
                f"{first} are {config.accumulation} (accumulation) times train_step's: divide each micro-batch's "
                "loss by run.config.accumulation before backward(), so they add up to the mean's gradient"
            )
        if config.grad_clip and float(mine.norm()) > config.grad_clip * (1 + 1e-4):
            return (
                f"{first} have norm {float(mine.norm()):.3f}, above grad_clip = {config.grad_clip}: not clipped. "
                "After the last backward: run.scaler.unscale_(run.optimizer), then "
                "nn.utils.clip_grad_norm_(run.model.parameters(), run.config.grad_clip)"
            )
        return f"{first} point train_step's way but are {ratio:.2f}x as long: divide each loss by accumulation only"
    if step == 1 and config.accumulation > 1:
        last_only = _steps(_last_micro_batch_only, case).used[0]
        if _off(mine, last_only) <= TOLERANCES[config.precision][1]:
            return (
                f"{first} are the last micro-batch's only: a zero_grad() between micro-batches wipes what the "
                "earlier backward() calls added; zero the gradients once, after the optimizer's step"
            )
    return (
        f"{first} are not train_step's: backward() on each micro-batch's loss / accumulation, then (if "
        "config.grad_clip) unscale_ and clip_grad_norm_, then the optimizer's step"
    )


def _check_autocast(mine: _Steps, theirs: _Steps, case: str) -> None:
    """In a case in bf16, a step whose gradient is a float32 forward's (to float32's precision) forgot autocast.
    (Its loss and gradient are too close to bf16's to be told by the bf16 tolerances, made for compiled steps.)"""
    precision = mine.run.config.precision
    fp32_gradient = TOLERANCES["fp32"][1]
    if precision == "fp32" or not mine.used or not _off(mine.used[0], theirs.used[0]) > fp32_gradient:
        return  # NaN: not a float32 step's
    in_fp32 = _steps(train_step, case, precision="fp32")
    assert not _off(mine.used[0], in_fp32.used[0]) <= fp32_gradient, (
        f"hint: in {case} your step computed what a float32 step computes: run the model and the loss under "
        f"precision_context(run) (helpers.cli.train_gpt), which autocasts to {precision} here"
    )


def _compare(mine: _Steps, theirs: _Steps, case: str) -> float:
    """Step by step, the loss, the gradient the optimizer got and its update of the weights must be train_step's
    (within the precision's TOLERANCES); the largest relative difference of the updates, the ✓ line's diff."""
    loss_tolerance, gradient_tolerance, update_tolerance = TOLERANCES[mine.run.config.precision]
    _check_autocast(mine, theirs, case)
    largest = 0.0
    for index in range(STEPS):
        step = index + 1
        my_loss, their_loss = float(mine.returned[index]), float(theirs.returned[index])
        if not _off(my_loss, their_loss) <= loss_tolerance:  # NaN too
            if index == 0:
                raise AssertionError(f"hint: {_loss_hint(my_loss, their_loss, case)}")
            raise AssertionError(
                f"hint: in {case} the losses matched train_step's until step {step}: {my_loss:.6f}, train_step's "
                f"{their_loss:.6f}. Return the mean loss of this step's micro-batches, each drawn once"
            )
        my_gradient, their_gradient = mine.used[index], theirs.used[index]
        if not _off(my_gradient, their_gradient) <= gradient_tolerance:
            raise AssertionError(f"hint: {_gradient_hint(my_gradient, their_gradient, case, step)}")
        my_update = mine.weights[step] - mine.weights[index]
        their_update = theirs.weights[step] - theirs.weights[index]
        off = _off(my_update, their_update)
        assert off <= update_tolerance, (
            f"hint: in {case} the optimizer got train_step's gradients at step {step}, but its update of the "
            f"weights is {off:.1e} off (relatively): step run.optimizer through run.scaler.step(run.optimizer), "
            "then run.scaler.update(), zero_grad, and run.scheduler.step() last (each step takes the learning "
            "rate the schedule gave before it)"
        )
        largest = max(largest, off)
    return largest


@exercise("my_train_step", reference=reference_my_train_step)
def check_my_train_step(my_train_step: Callable) -> str:
    """In each case of CASES, STEPS calls of my_train_step on a fresh tiny run must draw `accumulation` batches,
    step the optimizer and the schedule once, return the detached mean loss, leave no gradients, and give
    train_step's losses, gradients and updates (within TOLERANCES); then one step of each is timed, not judged."""
    state = capture_rng_state()  # build() seeds python, numpy and torch: the notebook's RNG is put back after
    try:
        with num_threads(1):
            largest, timed = 0.0, None
            for case in CASES:
                mine, theirs = _steps(my_train_step, case), _steps(train_step, case)
                _check_calls(mine, case)
                largest = max(largest, _compare(mine, theirs, case))
                timed = timed or (mine, theirs)
            assert timed is not None
            yours, plain = timed
            timing = measure(
                {
                    "train_step": lambda: train_step(plain.run, plain.batches),
                    "yours": lambda: _call(my_train_step, yours.run, yours.batches),
                },
                device="cpu",
                repeat=TIMED_ROUNDS,
            )
    finally:
        restore_rng_state(state)
    found = timing.verdict("yours")
    speed = f"{1 / timing.time_ratio('yours'):.2f}x as fast" if found else "speed not told apart"
    return (
        f"✓ my_train_step took train_step's {STEPS} steps in fp32 (2 micro-batches), bf16, unclipped "
        f"(diff {largest:.0e}); {speed}"
    )
