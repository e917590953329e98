import math

import matplotlib
import pytest
import torch

from helpers.experiments_accumulation import (ACCUMULATION_SPEC, PRECISION_SPEC, AccumulationRun, PrecisionRun,
                                              digits_tensors, plot_accumulation_curves, plot_precision_run,
                                              precisions_for, run_accumulation_experiment, run_precision_experiment,
                                              scaled_lr, time_training_steps, train_digits_mlp)
from helpers.models import MLP

matplotlib.use("Agg")


@pytest.mark.parametrize("rule, expected", [("none", 0.4), ("linear", 0.1), ("sqrt", 0.2)])
def test_scaled_lr_rules(rule, expected):
    assert scaled_lr(0.4, 16, 64, rule) == pytest.approx(expected)
    assert scaled_lr(0.4, 64, 64, rule) == pytest.approx(0.4)


@pytest.mark.parametrize("kwargs, message", [
    ({"lr": 0}, "lr must be a positive number"),
    ({"lr": True}, "lr must be a positive number"),
    ({"batch_size": 0}, "batch_size must be a positive int"),
    ({"reference_batch_size": 2.0}, "reference_batch_size must be a positive int"),
    ({"rule": "cubic"}, "rule must be one of"),
])
def test_scaled_lr_bad_inputs(kwargs, message):
    arguments = {"lr": 0.1, "batch_size": 16, "reference_batch_size": 64, "rule": "linear", **kwargs}
    with pytest.raises(ValueError, match=message):
        scaled_lr(**arguments)


def test_digits_tensors():
    train = digits_tensors("train", torch.float64)
    images, labels = train.tensors
    assert images.shape == (1347, 1, 8, 8) and images.dtype == torch.float64 and labels.dtype == torch.int64
    assert len(digits_tensors("test")) == 450
    with pytest.raises(TypeError, match="floating-point"):
        digits_tensors("train", torch.int64)


def test_train_digits_mlp_is_reproducible():
    datasets = (digits_tensors("train"), digits_tensors("test"))
    runs = [train_digits_mlp(seed=3, batch_size=256, lr=0.05, epochs=1, device=torch.device("cpu"), datasets=datasets)
            for _ in range(2)]
    (model_a, history_a), (model_b, history_b) = runs
    timeless = lambda history: [{k: v for k, v in row.items() if k != "samples_per_s"} for row in history]
    assert timeless(history_a) == timeless(history_b)
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
    assert history_a[0]["optimizer_steps"] == math.ceil(1347 / 256)


def test_accumulation_experiment_accumulated_run_follows_the_big_batch(capsys):
    result = run_accumulation_experiment(seed=1, micro_batch=64, accumulation_steps=3, epochs=2, lr=0.1,
                                         lr_rule="sqrt", device="cpu", show=True, progress=False)
    assert isinstance(result, AccumulationRun)
    assert result.dtype == torch.float64
    for a, b in zip(result.curve("big", "val_loss"), result.curve("accumulated", "val_loss")):
        assert a == pytest.approx(b, rel=1e-9)
    assert result.curve("big", "optimizer_steps") == [math.ceil(1347 / 192)] * 2
    assert result.curve("accumulated", "optimizer_steps") == [math.ceil(1347 / 192)] * 2
    assert result.curve("small", "optimizer_steps") == [math.ceil(1347 / 64)] * 2
    assert result.runs["small"]["lr"] == pytest.approx(0.1 / math.sqrt(3))
    assert "64 x 3 accumulated" in repr(result)
    assert "64 x 3 accumulated" in capsys.readouterr().out
    figure = plot_accumulation_curves(result)
    assert len(figure.axes) == 3 and len(figure.axes[0].lines) == 3


def test_accumulation_experiment_rejects_bad_values():
    with pytest.raises(ValueError, match="micro_batch must be in"):
        run_accumulation_experiment(micro_batch=1, show=False, progress=False)
    with pytest.raises(ValueError, match="lr_rule must be one of"):
        run_accumulation_experiment(lr_rule="double", show=False, progress=False)
    assert set(ACCUMULATION_SPEC) == {"seed", "micro_batch", "accumulation_steps", "epochs", "lr", "lr_rule"}


def test_precisions_for():
    assert precisions_for("cpu") == ["fp32", "bf16"]
    assert precisions_for(torch.device("cuda")) == ["fp32", "bf16", "fp16"]


def test_time_training_steps_times_copies_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = MLP(64, (16,), 10)
    before = [p.detach().clone() for p in model.parameters()]
    inputs, targets = torch.randn(8, 64), torch.randint(0, 10, (8,))
    seconds = time_training_steps(model, inputs, targets, precisions=["fp32", "bf16", "fp16"], device="cpu",
                                  repeat=2, warmup=1)
    assert set(seconds) == {"fp32", "bf16", "fp16"}
    assert all(len(v) == 2 and all(s > 0 for s in v) for v in seconds.values())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="precisions must be"):
        time_training_steps(model, inputs, targets, precisions=["fp8"], device="cpu")
    with pytest.raises(ValueError, match="precisions must be"):
        time_training_steps(model, inputs, targets, precisions=[], device="cpu")


def test_precision_experiment_on_cpu(capsys):
    result = run_precision_experiment(seed=2, epochs=1, lr=0.05, batch_size=256, width=64, repeat=3, device="cpu",
                                      show=True, progress=False)
    assert isinstance(result, PrecisionRun)
    assert list(result.histories) == ["fp32", "bf16"] == list(result.step_seconds)
    assert result.step_ratio("fp32") == pytest.approx(1.0)
    assert result.step_ratio("bf16") > 0
    assert abs(result.histories["bf16"][-1]["val_accuracy"] - result.histories["fp32"][-1]["val_accuracy"]) <= 0.05
    assert "bf16" in repr(result) and "time vs fp32" in capsys.readouterr().out
    figure = plot_precision_run(result)
    assert len(figure.axes) == 2


def test_precision_experiment_rejects_bad_values():
    with pytest.raises(ValueError, match="width must be one of"):
        run_precision_experiment(width=100, show=False, progress=False)
    with pytest.raises(ValueError, match="lr must be in"):
        run_precision_experiment(lr=1.0, show=False, progress=False)
    assert set(PRECISION_SPEC) == {"seed", "epochs", "lr", "batch_size", "width", "repeat"}
