"""The RunningMean exercise gives each kind of mistake its own hint, and tells a stub class from an answer."""

import pytest
import torch
from torch import nn

from helpers.exercises import ENVIRONMENT_VARIABLE, ExerciseNotDone
from helpers.exercises.setup import check_running_mean


class WeightsOnTheCpu(nn.Module):  # no device=: right on the CPU, a clash wherever else x lives
    def forward(self, x):
        weights = torch.ones(x.shape[1], x.shape[1], dtype=x.dtype).tril()
        return (weights / weights.sum(dim=1, keepdim=True)) @ x


class WeightsInFloat32(nn.Module):  # no dtype=: a float64 input meets float32 weights
    def forward(self, x):
        weights = torch.ones(x.shape[1], x.shape[1], device=x.device).tril()
        return (weights / weights.sum(dim=1, keepdim=True)) @ x


class MeanOfTheWholeSequence(nn.Module):  # every position gets the mean over all positions, not those up to t
    def forward(self, x):
        return x.mean(dim=1, keepdim=True).expand_as(x)


class OneMeanPerSequence(nn.Module):  # the positions axis is reduced away
    def forward(self, x):
        return x.mean(dim=1)


class MaskOfFixedLength(nn.Module):  # nanoGPT's causal mask: a buffer made once, for sequences up to 8 long
    def __init__(self, block_size=8):
        super().__init__()
        weights = torch.ones(block_size, block_size).tril()
        self.register_buffer("weights", weights / weights.sum(dim=1, keepdim=True))

    def forward(self, x):
        length = x.shape[1]
        return self.weights[:length, :length].to(x.dtype) @ x


class LearnedWeights(nn.Module):  # an nn.Parameter: trained by any optimizer given model.parameters()
    def __init__(self):
        super().__init__()
        self.weights = nn.Parameter(torch.ones(6, 6).tril() / torch.arange(1, 7).view(-1, 1))

    def forward(self, x):
        return self.weights.to(x.dtype) @ x


class WithoutSuperInit(nn.Module):  # an __init__ that forgets super().__init__()
    def __init__(self):
        self.dim = 1

    def forward(self, x):
        return x.cumsum(dim=self.dim) / torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)


class DividedByTheLength(nn.Module):  # the running sum over the whole length, not over the t + 1 positions so far
    def forward(self, x):
        return x.cumsum(dim=1) / x.shape[1]


class UpperTriangle(nn.Module):  # triu: position t averages positions t..end
    def forward(self, x):
        weights = torch.ones(x.shape[1], x.shape[1], device=x.device, dtype=x.dtype).triu()
        return (weights / weights.sum(dim=1, keepdim=True)) @ x


class SumsInPlace(nn.Module):  # right numbers, but the caller's x is overwritten
    def forward(self, x):
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        return x.cumsum_(dim=1).div_(counts)


class UnderNoGrad(nn.Module):  # right values, and no gradient reaches the layers before it
    @torch.no_grad()
    def forward(self, x):
        weights = torch.ones(x.shape[1], x.shape[1], device=x.device, dtype=x.dtype).tril()
        return (weights / weights.sum(dim=1, keepdim=True)) @ x


class WeightsThatRequireGrad(nn.Module):  # "weights need gradients": a leaf that fills .grad on every backward
    def forward(self, x):
        weights = torch.ones(x.shape[1], x.shape[1], device=x.device, dtype=x.dtype, requires_grad=True)
        return (weights.tril() / weights.tril().sum(dim=1, keepdim=True)) @ x


class DetachedSum(nn.Module):  # the running sum detached "to save memory": the counts still divide x's graph
    def forward(self, x):
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        return x.cumsum(dim=1).detach() / counts + 0 * x


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (WeightsOnTheCpu, r"with x on meta, matmul got tensors on \['cpu', 'meta'\].*device=x.device"),
    (WeightsInFloat32, "on float64 input forward failed"),
    (MeanOfTheWholeSequence, r"position t holds the mean of x\[:, :t \+ 1\]"),
    (OneMeanPerSequence, r"the output keeps the input's shape \(2, 6, 3\), got \(2, 3\)"),
    (MaskOfFixedLength, "right for length 6, but for length 9 forward failed .*a buffer or parameter made in __init__"),
    (LearnedWeights, r"RunningMean holds parameters \['weights'\], which an optimizer would train"),
    (WithoutSuperInit, r"call super\(\).__init__\(\) first"),
    (DividedByTheLength, r"divided by the whole length \(6\): divide position t by t \+ 1"),
    (UpperTriangle, r"averaged the positions from t to the end \(triu\)"),
    (SumsInPlace, "forward changed x in place"),
    (UnderNoGrad, r"the output carries no graph \(forward ran under torch.no_grad\(\)"),
    (WeightsThatRequireGrad, r"forward made a tensor of shape \(6, 6\) with requires_grad=True"),
    (DetachedSum, "the values are right but their gradient with respect to x is not"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_running_mean(wrong)


class FromTheRunningSum(nn.Module):
    def forward(self, x):
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        return x.cumsum(dim=1) / counts


class WeightsMovedWithTo(nn.Module):  # made on the CPU, then moved to x: a copy per call, but right everywhere
    def forward(self, x):
        weights = torch.ones(x.shape[1], x.shape[1]).tril().to(x)
        return (weights / weights.sum(dim=1, keepdim=True)) @ x


RIGHT = [FromTheRunningSum, WeightsMovedWithTo]


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right, capsys):
    check_running_mean(right)
    assert capsys.readouterr().out.startswith("✓ RunningMean gave the running mean")


def test_a_fixed_length_buffer_is_tried_one_position_past_its_end():
    """A mask buffer of any length up to 4096 meets a sequence one longer than it."""
    for block_size in (6, 1025, 2048):
        with pytest.raises(AssertionError, match=f"for length {block_size + 1} forward failed"):
            check_running_mean.check(lambda block_size=block_size: MaskOfFixedLength(block_size))


class StubModule(nn.Module):  # what the notebook holds: a module whose forward is still to be written
    def forward(self, x):
        raise NotImplementedError("write it here")


def test_the_notebooks_stub_class_is_reported_as_the_stub(monkeypatch, capsys):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    with pytest.raises(ExerciseNotDone, match="RunningMean is still the stub"):
        check_running_mean(StubModule)
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "reference")
    check_running_mean(StubModule)
    assert capsys.readouterr().out.splitlines()[-1].startswith("✓ RunningMean gave the running mean")
