import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from helpers.data import DIGIT_CLASSES, DigitsDataset, export_png_folders
from helpers.experiments import (DIGITS_DEFAULTS, DigitsRun, batch_length, digits_model, init_weights,
                                 loader_benchmark, run_digits, run_loader_benchmark, text_table, time_loader,
                                 train_digits)
from helpers.models import count_parameters


def test_text_table_aligns_columns():
    table = text_table(["name", "value"], [["a", 1], ["long name", 2.5]])
    lines = table.splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert lines[1].replace(" ", "").strip("-") == ""
    with pytest.raises(ValueError, match="2 cells"):
        text_table(["a", "b"], [[1]])


def test_init_weights_zeroes_biases_and_scales_weights_for_relu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(400, 300), nn.ReLU(), nn.Conv2d(3, 4, 3), nn.BatchNorm1d(3))
    model.apply(init_weights)
    assert torch.all(model[0].bias == 0) and torch.all(model[2].bias == 0)
    assert model[0].weight.std().item() == pytest.approx(math.sqrt(2 / 400), rel=0.05)
    assert torch.all(model[3].weight == 1)  # left alone


def test_digits_model_shape():
    model = digits_model()
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert count_parameters(model) == 64 * 128 + 128 + 2 * 128 + 128 * 64 + 64 + 2 * 64 + 64 * 10 + 10


def test_train_digits_prints_the_knobs_it_used(capsys):
    run = train_digits(lr=0.1, epochs=2, batch_size=64, seed=3, progress=False, live_plot=False)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("trained 2 epochs at lr=0.1 (sgd, batch size 64, seed 3)")
    assert line.endswith(f"test accuracy {run.test_accuracy:.3f}")
    assert isinstance(run, DigitsRun) and len(run.history) == 2
    assert run.test_accuracy > 0.5
    assert "history" not in repr(run) and "model" not in repr(run)


def test_train_digits_repeats_with_the_same_seed_and_uses_the_optimizer_asked_for(capsys):
    first = train_digits(epochs=1, seed=5, progress=False, live_plot=False)
    second = train_digits(epochs=1, seed=5, progress=False, live_plot=False)
    assert all(torch.equal(a, b) for a, b in zip(first.model.state_dict().values(),
                                                 second.model.state_dict().values()))
    adam = train_digits(lr=0.003, epochs=1, optimizer="adam", progress=False, live_plot=False)
    assert "(adam," in capsys.readouterr().out
    assert adam.optimizer == "adam"


@pytest.mark.parametrize("kwargs, message", [
    ({"epochs": 0}, "epochs"), ({"batch_size": 0}, "batch_size"), ({"seed": -1}, "seed"),
    ({"optimizer": "lbfgs"}, "optimizer"), ({"lr": 0}, "lr")])
def test_train_digits_bad_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        train_digits(**kwargs, progress=False, live_plot=False)


def test_run_digits_returns_nothing_and_prints(monkeypatch, capsys):
    import helpers.experiments as experiments

    calls = []
    monkeypatch.setattr(experiments, "train_digits", lambda **kwargs: calls.append(kwargs))
    assert run_digits(**DIGITS_DEFAULTS, seed=0) is None
    assert calls == [{**DIGITS_DEFAULTS, "seed": 0}]


def test_batch_length_finds_the_batch_dimension():
    assert batch_length(torch.zeros(5, 3)) == 5
    assert batch_length((torch.zeros(4, 2), torch.zeros(4))) == 4
    assert batch_length({"image": torch.zeros(6, 1), "label": torch.zeros(6)}) == 6
    for bad in (torch.tensor(1.0), "abc", []):
        with pytest.raises((TypeError, ValueError)):
            batch_length(bad)


def test_time_loader_counts_every_sample_each_epoch():
    loader = DataLoader(TensorDataset(torch.zeros(10, 2), torch.zeros(10)), batch_size=4)
    rows = time_loader(loader, epochs=2)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(r["samples"] == 10 and r["batches"] == 3 for r in rows)
    assert all(0 < r["first_batch_s"] <= r["epoch_s"] for r in rows)
    with pytest.raises(ValueError, match="epochs"):
        time_loader(loader, epochs=0)
    with pytest.raises(ValueError, match="at least one batch"):
        time_loader([], epochs=1)


@pytest.fixture(scope="module")
def small_png_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("pngs") / "train"
    return export_png_folders(Subset(DigitsDataset("test", size=28), range(40)), root, classes=DIGIT_CLASSES)


@pytest.mark.parametrize("num_workers, persistent", [(0, True), (1, True), (2, False)])
def test_loader_benchmark_reads_every_png_and_reports_its_settings(small_png_root, capsys, num_workers, persistent):
    rows = loader_benchmark(num_workers=num_workers, batch_size=16, prefetch_factor=3, persistent_workers=persistent,
                            epochs=2, seed=1, root=small_png_root)
    assert [r["samples"] for r in rows] == [40, 40]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"num_workers={num_workers}, batch_size=16, ")
    assert ("prefetch_factor=3" in line) == (num_workers > 0)
    assert "2 epoch(s) of 40 PNGs" in line


def test_loader_benchmark_bad_knobs(small_png_root):
    with pytest.raises(ValueError, match="num_workers"):
        loader_benchmark(num_workers=-1, root=small_png_root)
    with pytest.raises(ValueError, match="prefetch_factor"):
        loader_benchmark(prefetch_factor=0, root=small_png_root)
    with pytest.raises(TypeError, match="persistent_workers"):
        loader_benchmark(persistent_workers=1, root=small_png_root)


def test_run_loader_benchmark_returns_nothing(monkeypatch):
    import helpers.experiments as experiments

    calls = []
    monkeypatch.setattr(experiments, "loader_benchmark", lambda **kwargs: calls.append(kwargs))
    assert run_loader_benchmark(0, 8, 2, False, 1, 0) is None
    assert calls == [{"num_workers": 0, "batch_size": 8, "prefetch_factor": 2, "persistent_workers": False,
                      "epochs": 1, "seed": 0}]
