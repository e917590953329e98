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


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (WeightsOnTheCpu, r"with x on meta, matmul got tensors on \['cpu', 'meta'\].*device=x.device"),
        (WeightsInFloat32, "on float64 input forward failed"),
        (MeanOfTheWholeSequence, r"position t holds the mean of x\[:, :t \+ 1\]"),
        (OneMeanPerSequence, r"the output keeps the input's shape \(2, 6, 3\), got \(2, 3\)"),
    ],
)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: {hint}"):
        check_running_mean(wrong)


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


def test_another_right_answer_passes(capsys):
    class FromTheRunningSum(nn.Module):
        def forward(self, x):
            counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
            return x.cumsum(dim=1) / counts

    check_running_mean(FromTheRunningSum)
    assert capsys.readouterr().out.startswith("✓ ")
