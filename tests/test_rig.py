"""The measuring rig: variants timed in turns after warm-up, memory metered, ratios and sentences from the run."""

import warnings

import pytest
import torch

from helpers.models import MLP
from helpers.rig import Measurement, Result, measure, precision_steps


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
    measured = _fixed([1.0, 2.0, 4.0, 8.0], [0.5, 1.0, 2.0, 16.0])
    assert measured.time_ratio("b") == pytest.approx(0.5)
    assert measured.time_ratio("a", against="b") == pytest.approx(2.0)
    low, high = measured.ratio_spread("b")
    assert low == pytest.approx(0.5) and high == pytest.approx(0.875)
    assert measured.conclusion("b").startswith("b was faster than a")
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


def test_chart_draws_memory_in_the_largest_values_binary_unit():
    import matplotlib.pyplot as plt

    measured = _fixed([0.001, 0.002, 0.003], [0.002, 0.004, 0.006])
    measured["a"].saved_bytes, measured["b"].saved_bytes = 68608, 17152  # 67.00 KiB and 16.75 KiB
    figure = measured.chart()
    memory = figure.axes[1]
    assert memory.get_ylabel() == "saved for backward, KiB"
    assert [bar.get_height() for bar in memory.patches] == pytest.approx([67.0, 16.75])
    assert [text.get_text() for text in memory.texts] == ["67.00 KiB", "16.75 KiB"]
    plt.close(figure)


def test_report_prints_the_table_and_one_sentence_per_variant(capsys):
    _fixed([1.0, 1.0, 1.0], [3.0, 3.0, 3.0]).report("title here")
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


def test_precision_steps_train_copies_and_leave_the_model_alone():
    torch.manual_seed(0)
    model = MLP(64, (16,), 10)
    before = [p.detach().clone() for p in model.parameters()]
    inputs, targets = torch.randn(8, 64), torch.randint(0, 10, (8,))
    steps = precision_steps(model, inputs, targets, precisions=["fp32", "bf16", "fp16"], device="cpu")
    measured = measure(steps, device="cpu", repeat=2, warmup=1, saved_tensors=True, exclude=model)
    assert set(measured.results) == {"fp32", "bf16", "fp16"}
    assert all(len(r.seconds) == 2 and all(s > 0 for s in r.seconds) for r in measured.results.values())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert measured["bf16"].saved_bytes < measured["fp32"].saved_bytes  # 16-bit activations
    for bad in (["fp8"], [], "fp32"):
        with pytest.raises(ValueError, match="precisions must be"):
            precision_steps(model, inputs, targets, precisions=bad, device="cpu")


def test_a_tf32_step_is_the_fp32_step_run_with_tf32_products_and_puts_the_setting_back(monkeypatch):
    """'tf32': float32 without autocast, under compat.fp32_precision_as('tf32'). On the CPU TF32 changes nothing,
    so the step is made here with tf32_available patched, to see the setting during the step and after it."""
    from helpers import compat, rig

    seen = []

    def train_epoch(*args, **kwargs):  # the rig's train_epoch, noting the float32 setting while it runs
        seen.append(compat.fp32_precision())
        return real_train_epoch(*args, **kwargs)

    real_train_epoch = rig.train_epoch
    monkeypatch.setattr(rig, "train_epoch", train_epoch)
    monkeypatch.setattr(rig, "tf32_available", lambda device: (True, "TF32 here (patched)"))
    torch.manual_seed(0)
    model = MLP(64, (16,), 10)
    inputs, targets = torch.randn(8, 64), torch.randint(0, 10, (8,))
    before = compat.fp32_precision()
    steps = precision_steps(model, inputs, targets, precisions=["fp32", "tf32"], device="cpu")
    fp32, tf32 = steps["fp32"](), steps["tf32"]()
    assert seen == [before, {"matmul": "tf32", "conv": "tf32"}] and compat.fp32_precision() == before
    assert fp32.loss == tf32.loss and tf32.optimizer_steps == 1  # the same float32 step, no autocast


def test_notebook_05s_table_on_a_gpu_from_ampere_on_fp32_tf32_bf16_fp16_and_autocast_against_tf32(monkeypatch):
    """05's section 4 on an H100, rehearsed on the CPU: the four rows, and the 16-bit rows against tf32."""
    from helpers import loop, rig

    monkeypatch.setattr(rig, "tf32_available", lambda device: (True, "TF32 here (patched)"))
    monkeypatch.setattr(loop, "tf32_available", lambda device: (True, "TF32 here (patched)"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    compared = loop.precisions_for("cuda", tf32=True)
    assert compared == ["fp32", "tf32", "bf16", "fp16"]
    torch.manual_seed(0)
    model, inputs, targets = MLP(64, (16,), 10), torch.randn(8, 64), torch.randint(0, 10, (8,))
    steps = precision_steps(model, inputs, targets, precisions=compared, device="cpu")  # the CPU stands in
    m = measure(steps, device="cpu", repeat=2, warmup=1, saved_tensors=True, labels={"fp32": "fp32 (ieee)"})
    assert [row["variant"] for row in m.rows()] == ["fp32 (ieee)", "tf32", "bf16", "fp16"]
    assert m["tf32"].saved_bytes == m["fp32"].saved_bytes  # TF32 keeps float32 storage
    for name in ("bf16", "fp16"):
        assert "tf32" in m.conclusion(name, against="tf32") and m.time_ratio(name, against="tf32") > 0


def test_precision_steps_refuse_tf32_where_there_is_none():
    model, inputs, targets = MLP(64, (16,), 10), torch.randn(8, 64), torch.randint(0, 10, (8,))
    with pytest.raises(ValueError, match="precisions names 'tf32', but no TF32 on cpu"):
        precision_steps(model, inputs, targets, precisions=["fp32", "tf32"], device="cpu")


def test_in_fp32_precision_restores_the_setting_even_when_the_step_fails():
    from helpers import compat
    from helpers.rig import in_fp32_precision

    before = compat.fp32_precision()

    def failing():
        assert compat.fp32_precision() == {"matmul": "tf32", "conv": "tf32"}
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        in_fp32_precision(failing, "tf32")()
    assert compat.fp32_precision() == before
    assert in_fp32_precision(lambda: 7, "ieee")() == 7
    with pytest.raises(ValueError, match="mode must be one of"):
        in_fp32_precision(failing, "bf16")


def test_precision_steps_with_accumulation_make_one_step_from_micro_batches_holding_less_for_backward():
    from helpers.memory import saved_peak_bytes

    torch.manual_seed(0)
    model = MLP(64, (16,), 10)
    inputs, targets = torch.randn(8, 64), torch.randint(0, 10, (8,))
    whole = precision_steps(model, inputs, targets, precisions=["fp32"], device="cpu")["fp32"]
    micro = precision_steps(model, inputs, targets, precisions=["fp32"], device="cpu", accumulation_steps=4)["fp32"]
    done = micro()
    assert (done.micro_batches, done.optimizer_steps, done.samples) == (4, 1, 8)
    whole()
    trained = [step.args[0] for step in (whole, micro)]  # the copies each step trains (train_epoch's model)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*(m.parameters() for m in trained)))
    assert saved_peak_bytes(micro) < saved_peak_bytes(whole)
    with pytest.raises(ValueError, match="accumulation_steps must be"):
        precision_steps(model, inputs, targets, precisions=["fp32"], device="cpu", accumulation_steps=0)


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
