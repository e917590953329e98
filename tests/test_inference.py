import pytest
import torch
from torch import nn

from helpers.inference import (GRAD_MODES, batch_from, calls_per_timing, compare_compiled, eval_mode, format_table,
                               grad_mode, measure_inference, num_threads, predict_one, series_by, thread_speedup,
                               time_grad_modes)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(8, 3))


def _rows() -> list[dict]:
    return [
        {"batch_size": 1, "threads": 1, "latency_s": 0.010, "throughput": 100.0},
        {"batch_size": 1, "threads": 2, "latency_s": 0.008, "throughput": 125.0},
        {"batch_size": 8, "threads": 1, "latency_s": 0.020, "throughput": 400.0},
        {"batch_size": 8, "threads": 2, "latency_s": 0.010, "throughput": 800.0},
    ]


# grad_mode / eval_mode / num_threads

def test_grad_mode_switches_autograd_as_named():
    with grad_mode("plain"):
        assert torch.is_grad_enabled()
    with grad_mode("no_grad"):
        assert not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    with grad_mode("inference_mode"):
        assert torch.is_inference_mode_enabled()
    assert GRAD_MODES == ("plain", "no_grad", "inference_mode")


def test_grad_mode_rejects_unknown_names():
    with pytest.raises(ValueError, match="mode must be one of"):
        grad_mode("eval")


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_restores_the_previous_mode(training):
    model = _model().train(training)
    with eval_mode(model):
        assert not model.training and not model[4].training
    assert model.training is training and model[4].training is training


def test_eval_mode_restores_even_after_an_error():
    model = _model().train()
    with pytest.raises(KeyError):
        with eval_mode(model):
            raise KeyError("boom")
    assert model.training


def test_eval_mode_rejects_non_modules():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        with eval_mode("model"):
            pass


def test_num_threads_sets_and_restores():
    before = torch.get_num_threads()
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError):
        with num_threads(1):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with num_threads(None):
        assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_num_threads_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="threads must be a positive int"):
        with num_threads(bad):
            pass


# predict_one / batch_from

def test_predict_one_matches_the_batched_prediction_and_keeps_the_mode():
    model = _model().train()
    inputs = torch.randn(6, 2, 2)
    model.eval()
    with torch.no_grad():
        expected = model(inputs).argmax(dim=1)
    model.train()
    got = [predict_one(model, sample) for sample in inputs]
    assert got == expected.tolist()
    assert model.training


def test_predict_one_rejects_bad_samples_and_models():
    model = _model()
    with pytest.raises(ValueError, match="sample must be a tensor"):
        predict_one(model, torch.tensor(1.0))
    with pytest.raises(ValueError, match="sample must be a tensor"):
        predict_one(model, [1.0, 2.0])
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        predict_one(lambda x: x, torch.zeros(4))
    with pytest.raises(ValueError, match=r"logits \[1, classes\]"):
        predict_one(nn.Flatten(0), torch.zeros(4))


def test_batch_from_cycles_through_the_inputs():
    inputs = torch.arange(3).float().view(3, 1)
    assert batch_from(inputs, 7).view(-1).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert batch_from(inputs, 2).shape == (2, 1)


def test_batch_from_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        batch_from(torch.zeros(3, 1), 0)
    with pytest.raises(ValueError, match="inputs must be a tensor"):
        batch_from(torch.zeros(0, 1), 4)
    with pytest.raises(ValueError, match="inputs must be a tensor"):
        batch_from([1, 2], 4)


def test_calls_per_timing_covers_min_samples():
    assert calls_per_timing(1, 256) == 256
    assert calls_per_timing(100, 256) == 3
    assert calls_per_timing(1024, 256) == 1
    with pytest.raises(ValueError, match="min_samples must be a positive int"):
        calls_per_timing(4, 0)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        calls_per_timing(-4, 10)


# measurements (shape of the results, not speed)

def test_measure_inference_gives_one_row_per_batch_size_and_thread_count():
    model = _model().train()
    before = torch.get_num_threads()
    rows = measure_inference(model, torch.randn(5, 2, 2), batch_sizes=[1, 4], threads=[1, 2], repeat=1,
                             warmup=0, min_samples=4)
    assert [(r["batch_size"], r["threads"]) for r in rows] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    for row in rows:
        assert row["latency_s"] > 0
        assert row["throughput"] == pytest.approx(row["batch_size"] / row["latency_s"])
        assert row["calls"] == calls_per_timing(row["batch_size"], 4)
    assert torch.get_num_threads() == before
    assert model.training


def test_measure_inference_with_threads_none_reports_the_current_count():
    rows = measure_inference(_model(), torch.randn(2, 4), batch_sizes=[2], threads=None, repeat=1, warmup=0,
                             min_samples=1)
    assert rows[0]["threads"] == torch.get_num_threads()


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_sizes": []}, "batch_sizes must be a non-empty sequence"),
    ({"batch_sizes": [0]}, "each of batch_sizes must be a positive int"),
    ({"batch_sizes": [4, 4]}, "batch_sizes must not repeat"),
    ({"batch_sizes": "16"}, "batch_sizes must be a non-empty sequence"),
    ({"batch_sizes": [1], "threads": [0]}, "each of threads must be a positive int"),
    ({"batch_sizes": [1], "threads": []}, "threads must be a non-empty sequence"),
    ({"batch_sizes": [1], "min_samples": 0}, "min_samples must be a positive int"),
    ({"batch_sizes": [1], "repeat": 0}, "repeat must be a positive int"),
])
def test_measure_inference_rejects_bad_arguments(kwargs, message):
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match=message):
        measure_inference(_model(), torch.randn(2, 4), **kwargs)
    assert torch.get_num_threads() == before


def test_time_grad_modes_times_every_mode_and_keeps_the_model_mode():
    model = _model().eval()
    seconds = time_grad_modes(model, torch.randn(4, 4), repeat=2, warmup=0)
    assert list(seconds) == list(GRAD_MODES)
    assert all(len(v) == 2 and all(s > 0 for s in v) for v in seconds.values())
    assert not model.training
    with pytest.raises(ValueError, match="mode must be one of"):
        time_grad_modes(model, torch.randn(4, 4), modes=["fast"])
    with pytest.raises(ValueError, match="modes must name"):
        time_grad_modes(model, torch.randn(4, 4), modes=[])


def test_compare_compiled_rejects_bad_arguments_before_compiling():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        compare_compiled("model", torch.zeros(2, 4))
    with pytest.raises(ValueError, match="inputs must be a tensor"):
        compare_compiled(_model(), torch.zeros(0, 4))


# tables and ratios

def test_thread_speedup_divides_by_the_baseline_at_each_batch_size():
    speedup = thread_speedup(_rows())
    assert speedup == {1: {1: 1.0, 2: 1.25}, 8: {1: 1.0, 2: 2.0}}
    assert thread_speedup(_rows(), baseline_threads=2)[8][1] == pytest.approx(0.5)


def test_thread_speedup_rejects_bad_rows():
    with pytest.raises(ValueError, match="no row with threads=4"):
        thread_speedup(_rows(), baseline_threads=4)
    with pytest.raises(ValueError, match="at least one measurement"):
        thread_speedup([])
    with pytest.raises(ValueError, match="lacks"):
        thread_speedup([{"batch_size": 1, "threads": 1}])
    with pytest.raises(ValueError, match="baseline_threads must be a positive int"):
        thread_speedup(_rows(), baseline_threads=0)


def test_series_by_regroups_rows_for_a_chart():
    xs, series = series_by(_rows(), x="batch_size", y="throughput", group="threads", label="{} thr")
    assert xs == [1, 8]
    assert series == {"1 thr": [100.0, 400.0], "2 thr": [125.0, 800.0]}


def test_series_by_rejects_incomplete_rows():
    with pytest.raises(ValueError, match="lacks rows for batch_size"):
        series_by(_rows()[:3], x="batch_size", y="throughput", group="threads")
    with pytest.raises(ValueError, match="every row must have the key 'speed'"):
        series_by(_rows(), x="batch_size", y="speed", group="threads")
    with pytest.raises(ValueError, match="at least one row"):
        series_by([], x="a", y="b", group="c")


def test_format_table_aligns_columns_and_applies_formats():
    text = format_table(_rows()[:2], ["batch_size", "throughput"], formats={"throughput": "{:.1f}"})
    lines = text.splitlines()
    assert lines[0] == "batch_size  throughput"
    assert set(lines[1]) == {"-", " "}
    assert lines[2] == "         1       100.0"
    assert len({len(line) for line in lines}) == 1


def test_format_table_rejects_bad_columns():
    with pytest.raises(ValueError, match="row 0 lacks the columns"):
        format_table(_rows(), ["batch_size", "speed"])
    with pytest.raises(ValueError, match="formats names columns not in columns"):
        format_table(_rows(), ["batch_size"], formats={"speed": "{}"})
    with pytest.raises(ValueError, match="columns must name at least one"):
        format_table(_rows(), [])
