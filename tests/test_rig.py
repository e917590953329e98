"""The measuring rig: variants timed in turns after warm-up, memory metered, ratios and sentences from the run."""

import warnings

import pytest
import torch

from helpers.rig import Measurement, Result, measure, payback, rung_by_rung, throughput_table


def test_measure_times_every_variant_in_turns_after_warm_up():
    calls = []
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    result = measure(steps, device="cpu", repeat=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # a warm-up round, then rounds in alternating order
    assert [len(result[name].seconds) for name in steps] == [3, 3]
    assert result.baseline == "a" and result["a"].saved_bytes is None and result["a"].cuda_peak_bytes is None


def test_per_divides_the_seconds_into_units(monkeypatch):
    """A call of 4 steps that took 0.4 s took 0.1 s per step (the clock stands in: the rounds are known)."""
    from helpers import rig

    clock = {"x": [0.4, 0.6], "y": [0.4, 0.8]}
    monkeypatch.setattr(rig, "time_interleaved", lambda steps, **options: {name: clock[name] for name in steps})
    result = measure({"x": lambda: None, "y": lambda: None}, device="cpu", repeat=2, warmup=0, per={"x": 1, "y": 4})
    assert result["x"].seconds == [0.4, 0.6] and result["y"].seconds == pytest.approx([0.1, 0.2])
    assert result.unit == "step" and result.median_ms("y") == pytest.approx(150.0)
    every = measure({"x": lambda: None, "y": lambda: None}, device="cpu", repeat=2, warmup=0, per=2)
    assert every["y"].seconds == pytest.approx([0.2, 0.4])


def test_saved_tensors_meters_the_peak_held_for_backward():
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 32)
    inputs = torch.randn(64, 32)

    def step(times: int) -> None:
        out = inputs
        for _ in range(times):
            out = torch.relu(layer(out))
        out.sum().backward()

    result = measure({1: lambda: step(1), 4: lambda: step(4)}, device="cpu", repeat=1, warmup=0, saved_tensors=True)
    one, four = result[1].saved_bytes, result[4].saved_bytes
    batch_bytes = 64 * 32 * 4  # the input, and each ReLU's output (also the next Linear's input), kept once
    assert (one, four) == (2 * batch_bytes, 5 * batch_bytes)
    assert result.memory_ratio(4) == pytest.approx(four / one)
    assert {"saved for backward", "memory ratio"} <= set(result.rows()[0])
    with pytest.raises(ValueError, match="CUDA"):
        result.peak_ratio(4)


def _fixed(seconds_a, seconds_b) -> Measurement:
    return Measurement(
        torch.device("cpu"), {"a": Result("a", seconds_a), "b": Result("b", seconds_b)}, baseline="a", unit="batch"
    )


def test_ratios_are_per_round_and_the_sentence_follows_the_middle_half():
    # b takes half of a's time in every round but one: the median of per-round ratios says 0.5
    measured = _fixed([1.0, 2.0, 4.0, 8.0, 1.0, 2.0, 4.0, 8.0], [0.5, 1.0, 2.0, 16.0, 0.5, 1.0, 2.0, 4.0])
    assert measured.time_ratio("b") == pytest.approx(0.5)
    assert measured.time_ratio("a", against="b") == pytest.approx(2.0)
    low, high = measured.ratio_spread("b")
    assert low == pytest.approx(0.5) and high == pytest.approx(0.5)
    assert measured.conclusion("b").startswith("b was faster than a") and measured.verdict("b") == "faster"
    assert measured.verdict("a", against="b") == "slower"
    assert measured.conclusions() == [measured.conclusion("b")]
    assert _fixed([1.0, 1.0, 1.0], [0.9, 1.1, 1.0]).conclusion("b").startswith("b and a were not told apart")
    assert _fixed([1.0, 1.0], [2.0, 2.0]).conclusion("b").startswith("b and a were not told apart: too few")


def test_table_rows_and_chart_name_the_baseline_and_units():
    measured = _fixed([0.001, 0.002, 0.003], [0.002, 0.004, 0.006])
    rows = measured.rows()
    assert [row["variant"] for row in rows] == ["a", "b"]
    assert rows[1]["ms/batch"] == pytest.approx(4.0) and rows[1]["time ratio"] == pytest.approx(2.0)
    table = measured.table()
    assert "ratios against 'a'" in table and "x2.00" in table and "ms/batch" in table
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figure = measured.chart()
    assert len(figure.axes) == 1
    import matplotlib.pyplot as plt

    plt.close(figure)


def test_report_prints_the_table_and_one_sentence_per_variant(capsys):
    _fixed([1.0] * 5, [3.0] * 5).report("title here")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "title here" and out[-1].strip().startswith("b was slower than a")


def test_measure_refuses_bad_arguments_by_name():
    with pytest.raises(TypeError, match="steps must be a non-empty mapping"):
        measure({}, device="cpu")
    with pytest.raises(TypeError, match="steps must be"):
        measure([lambda: None], device="cpu")
    with pytest.raises(ValueError, match="repeat must be a positive int, got 0"):
        measure({"a": lambda: None}, device="cpu", repeat=0)
    with pytest.raises(ValueError, match="baseline must name one of the steps"):
        measure({"a": lambda: None}, device="cpu", baseline="b")
    with pytest.raises(ValueError, match="per must be a positive int"):
        measure({"a": lambda: None}, device="cpu", per=0)
    with pytest.raises(KeyError, match="no variant named 'z'"):
        _fixed([1.0], [1.0])["z"]


def test_cuda_peak_is_read_after_warm_up_around_one_more_call(monkeypatch):
    """On CUDA: timed rounds first, then one call between a peak reset and a peak read (its own peak)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: calls.append("allocated") or 100)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append("peak") or 123)
    measured = measure({"a": lambda: calls.append("step")}, device="cuda", repeat=1, warmup=1)
    assert measured["a"].cuda_peak_bytes == 23  # 123 at the peak, 100 allocated when the call began
    assert calls[-6:] == ["synchronize", "reset", "allocated", "step", "synchronize", "peak"]
    assert calls[:2] == ["step", "synchronize"]  # warm-up, then the clock
    with pytest.raises(ValueError, match="cuda_peak=True needs a CUDA device"):
        measure({"a": lambda: None}, device="cpu", cuda_peak=True)


@pytest.mark.parametrize(
    "largest, base, sizes",
    [(256, 4, [1, 4, 16, 64, 256]), (100, 4, [1, 4, 16, 64, 100]), (1, 4, [1]), (6, 2, [1, 2, 4, 6]), (2, 2, [1, 2])],
)
def test_powers_up_to_ends_at_the_largest_size(largest, base, sizes):
    from helpers.rig import powers_up_to

    assert powers_up_to(largest, base) == sizes


@pytest.mark.parametrize("largest, base, message", [(0, 4, "largest"), (8, 1, "base"), (8.0, 2, "largest")])
def test_powers_up_to_refuses_bad_sizes_by_name(largest, base, message):
    from helpers.rig import powers_up_to

    with pytest.raises((TypeError, ValueError), match=message):
        powers_up_to(largest, base)


def _ladder(**seconds) -> Measurement:
    results = {name: Result(name, times) for name, times in seconds.items()}
    return Measurement(torch.device("cpu"), results, baseline=next(iter(seconds)), unit="image")


def test_payback_divides_the_cost_by_the_time_saved_per_unit_only_when_the_run_showed_it_faster():
    # b takes 0.75 s where a takes 1 s in every round: 0.25 s saved per step, so 10 s pay back after 40 steps
    faster = _ladder(a=[1.0] * 6, b=[0.75] * 6)
    assert payback(faster, "b", 10.0) == "the 10.0 s of compiling pay back after 40 images of b"
    slower = _ladder(a=[1.0] * 6, b=[1.5] * 6)
    assert payback(slower, "b", 10.0, cost="tracing").startswith("b was slower than a here: the 10.0 s of tracing")
    assert "not told apart" in payback(_ladder(a=[1.0] * 6, b=[0.9, 1.1] * 3), "b", 10.0)
    with pytest.raises(ValueError, match="cost_s must be a positive number"):
        payback(faster, "b", -1.0)
    with pytest.raises(KeyError, match="no variant named 'c'"):
        payback(faster, "c", 10.0)


def test_throughput_table_gives_units_per_second_against_the_baseline_and_extra_columns():
    ladder = _ladder(plain=[0.01] * 5, fast=[0.005] * 5)
    table = throughput_table(ladder, columns={"accuracy": {"plain": 0.9, "fast": 0.91}}, title="t")
    lines = table.splitlines()
    assert lines[0] == "t"
    assert lines[1].split() == ["variant", "images/s", "throughput", "middle", "half", "accuracy"]
    assert lines[3].split() == ["plain", "100", "x1.00", "1.00-1.00", "0.900"]
    assert lines[4].split() == ["fast", "200", "x2.00", "2.00-2.00", "0.910"]
    with pytest.raises(ValueError, match=r"columns\['accuracy'\] has no value for the variants \['fast'\]"):
        throughput_table(ladder, columns={"accuracy": {"plain": 0.9}})


def test_rung_by_rung_compares_each_rung_with_the_one_below_and_names_what_paid():
    ladder = _ladder(plain=[1.0] * 5, workers=[0.5] * 5, bf16=[0.6] * 5, compile=[0.6, 0.59, 0.61, 0.6, 0.6])
    sentences = rung_by_rung(ladder)
    assert sentences[0].startswith("workers was faster than plain")
    assert sentences[1].startswith("bf16 was slower than workers")
    assert sentences[2].startswith("compile and bf16 were not told apart")
    assert sentences[3] == "On this cpu, workers paid; bf16 cost time."
    assert sentences[4].startswith("All together: compile was faster than plain")
    with pytest.raises(ValueError, match="at least two variants"):
        rung_by_rung(_ladder(plain=[1.0] * 5))
