"""Activation checkpointing: write a forward pass that checkpoints a deep stack group by group of blocks."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from helpers.memory import saved_tensors_meter
from helpers.models import deep_linear_stack

from . import exercise


def reference_checkpointed_forward(stack: torch.nn.Sequential, x: torch.Tensor, every: int) -> torch.Tensor:
    """Run `stack` on x with one checkpoint(..., use_reentrant=False) per group of `every` Linear+ReLU blocks."""
    modules = 2 * every  # a Linear and a ReLU per block
    for start in range(0, len(stack), modules):
        x = checkpoint(stack[start : start + modules], x, use_reentrant=False)
    return x


# (depth, every): groups of `every` blocks, the last one shorter; grouping by modules or checkpointing every block
# keeps another number of activations in each case.
CASES = ((10, 3), (9, 4), (6, 2))
WIDTH, BATCH = 16, 4


def _with_grad_input(checkpointed_forward: Callable, stack: torch.nn.Sequential, x: torch.Tensor, every: int) -> bool:
    """Whether, given an input that needs a gradient, every parameter gets one: true of use_reentrant=True (which
    needs such an input), false when the forward ran without autograd or cut the graph between groups."""
    stack.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = checkpointed_forward(stack, x.detach().clone().requires_grad_(), every)
    if out.requires_grad:
        out.sum().backward()
    ok = all(p.grad is not None for p in stack.parameters())
    stack.zero_grad(set_to_none=True)
    return ok


@exercise("checkpointed_forward", reference=reference_checkpointed_forward)
def check_checkpointed_forward(checkpointed_forward: Callable) -> str:
    """On stacks of 10, 9 and 6 blocks: the plain gradients, and one activation kept per group of `every` blocks."""
    activation = BATCH * WIDTH * 4  # bytes of one float32 activation
    kept_counts = []
    for depth, every in CASES:
        torch.manual_seed(depth)
        stack, x = deep_linear_stack(WIDTH, depth), torch.randn(BATCH, WIDTH)  # x: data, no requires_grad
        with saved_tensors_meter() as plain_meter:
            plain_out = stack(x)
            plain_kept = plain_meter.bytes
        plain_out.sum().backward()
        plain = [p.grad.clone() for p in stack.parameters() if p.grad is not None]  # every one has a gradient
        stack.zero_grad(set_to_none=True)
        with warnings.catch_warnings(), saved_tensors_meter() as meter:
            warnings.simplefilter("ignore")  # the reentrant variant warns; the hints below say what went wrong
            out = checkpointed_forward(stack, x, every)
            kept = meter.bytes
        assert isinstance(out, torch.Tensor) and out.shape == (BATCH, WIDTH), (
            f"hint: return the stack's output, a tensor of shape {(BATCH, WIDTH)}; got {type(out).__name__}"
        )
        assert torch.allclose(out, plain_out, rtol=1e-5, atol=1e-6), (
            "hint: the output differs from a plain run's: run every module of the stack exactly once, in order, "
            "the last (shorter) group included"
        )
        if not out.requires_grad:
            assert _with_grad_input(checkpointed_forward, stack, x, every), (
                "hint: the output needs no gradient: the forward ran without autograd (torch.no_grad() or "
                "inference_mode), so nothing can train; checkpointing saves memory by recomputing in backward, "
                "with autograd on"
            )
            raise AssertionError(
                "hint: the output needs no gradient: with use_reentrant=True and a data input (no requires_grad) "
                "nothing checkpointed gets one; pass use_reentrant=False"
            )
        out.sum().backward()
        if not all(p.grad is not None for p in stack.parameters()):
            missing = sum(p.grad is None for p in stack.parameters())
            assert _with_grad_input(checkpointed_forward, stack, x, every), (
                f"hint: {missing} parameter tensors got no gradient: the graph was cut between groups (.detach(), "
                ".data, a new tensor); pass each group's output on to the next group as it is"
            )
            raise AssertionError(
                "hint: some parameters got no gradient: use_reentrant=True gives a checkpointed group none when its "
                "input needs no gradient (the first group's is data); pass use_reentrant=False"
            )
        assert all(
            p.grad is not None and torch.allclose(p.grad, g, rtol=1e-5, atol=1e-7)
            for p, g in zip(stack.parameters(), plain)
        ), (
            "hint: the output is right but the gradients differ from a plain run's: let autograd see every module, "
            "each checkpoint call with use_reentrant=False"
        )
        groups = math.ceil(depth / every)
        assert kept < plain_kept, (
            f"hint: {depth} blocks kept {kept / activation:g} activations, as many as a plain run: nothing was "
            f"checkpointed; call checkpoint(stack[start : start + {2 * every}], x, use_reentrant=False) per group"
        )
        assert kept != activation or groups == 1, (
            f"hint: one checkpoint over the whole stack keeps 1 activation, but its backward recomputes the whole "
            f"stack and holds all its activations at once: checkpoint groups of `every` = {every} blocks, {groups} calls"
        )
        assert kept != depth * activation, (
            f"hint: {depth} blocks kept {depth} activations, one per block: you checkpointed every block; "
            f"checkpoint groups of `every` = {every} blocks instead, {groups} calls"
        )
        assert kept != math.ceil(2 * depth / every) * activation, (
            f"hint: the groups are too small: a block is two modules (a Linear and a ReLU), so a group of {every} "
            f"blocks is {2 * every} modules of the stack, stack[start : start + {2 * every}]"
        )
        assert kept == groups * activation, (
            f"hint: {depth} blocks in groups of {every} are {groups} groups and keep {groups} activations (one input "
            f"each); yours kept {kept / activation:g}: call checkpoint once per group"
        )
        kept_counts.append(groups)
    plain_counts = "/".join(str(depth + 1) for depth, _ in CASES)
    return (
        f"✓ checkpointed_forward: plain gradients, {'/'.join(map(str, kept_counts))} activations kept "
        f"(plain {plain_counts}), one per group"
    )
