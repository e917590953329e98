import pytest

from helpers.timing import (
    compare,
    format_table,
    median,
    median_ratio,
    middle_half,
    ratio_quartiles,
    time_call,
    time_interleaved,
)


def test_time_call_warms_up_then_times():
    calls = []
    seconds = time_call(lambda: calls.append(1), repeat=3, warmup=2)
    assert len(calls) == 5 and len(seconds) == 3 and all(s >= 0 for s in seconds)


def test_time_interleaved_alternates_and_reverses_every_other_round():
    order = []
    result = time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeat=3, warmup=1)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up A B, then rounds A B, B A, A B
    assert set(result) == {"a", "b"} and all(len(v) == 3 for v in result.values())


def test_time_interleaved_keeps_each_name_with_its_own_times():
    import time

    result = time_interleaved({"slow": lambda: time.sleep(0.02), "fast": lambda: None}, repeat=4, warmup=0)
    assert all(s >= 0.02 for s in result["slow"]) and all(s < 0.02 for s in result["fast"])


def test_median_and_ratio():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0


@pytest.mark.parametrize("kwargs, message", [({"repeat": 0}, "repeat"), ({"warmup": -1}, "warmup")])
def test_bad_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        time_call(lambda: None, **kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="fns"):
        time_interleaved({})
    with pytest.raises(ValueError, match="values"):
        median([])
    with pytest.raises(ValueError, match="equally long"):
        median_ratio([1.0], [1.0, 2.0])


def test_ratio_quartiles_bound_the_middle_half_of_the_pairwise_ratios():
    first, third = ratio_quartiles([0.90, 0.95, 1.0, 1.05, 1.10], [1.0] * 5)
    assert first == pytest.approx(0.95) and third == pytest.approx(1.05)
    assert ratio_quartiles([1.0], [2.0]) == (0.5, 0.5)
    with pytest.raises(ValueError):
        ratio_quartiles([1.0, 2.0], [1.0])


def test_ratio_quartiles_keep_the_median_between_them_also_when_printed():
    # two rounds with close ratios: the first quartile prints as 1.035 while the median is 1.03480
    numerator, denominator = [1.0346, 1.0350], [1.0, 1.0]
    first, third = ratio_quartiles(numerator, denominator)
    middle = median_ratio(numerator, denominator)
    assert first <= middle <= third
    assert f"{first:.3f}" == "1.035" and middle < 1.035  # what a raw comparison with the printed value trips on
    assert float(f"{first:.3f}") <= round(middle, 3) <= float(f"{third:.3f}")


def test_format_table_aligns_columns_and_formats_numbers():
    rows = [
        {"case": "MLP", "ratio": 0.99512, "n": 3, "tiny": 1e-7},
        {"case": "CNN, bar", "ratio": 1.5, "n": None, "tiny": 0.0},
    ]
    text = format_table(rows, ["case", "ratio", "n", "tiny"], title="t")
    lines = text.splitlines()
    assert lines[0] == "t"
    assert lines[1].split() == ["case", "ratio", "n", "tiny"]
    assert set(lines[2]) == {"-", " "}
    assert "0.995" in lines[3] and "1e-07" in lines[3] and "1.500" in lines[4]
    assert len({len(line) for line in lines[1:]}) == 1  # every row as wide as the header


def test_format_table_applies_column_formats():
    text = format_table([{"a": 1.23456}], ["a"], formats={"a": "{:.1f}"})
    assert text.splitlines()[-1].strip() == "1.2"


@pytest.mark.parametrize(
    "rows, columns, formats, message",
    [
        ([{"a": 1}], [], None, "columns"),
        ([{"a": 1}], ["a"], {"b": "{}"}, "formats"),
        ([{"a": 1}], ["a", "b"], None, "lacks the columns"),
    ],
)
def test_format_table_bad_inputs(rows, columns, formats, message):
    with pytest.raises(ValueError, match=message):
        format_table(rows, columns, formats=formats)


def test_format_table_takes_rows_as_sequences_in_column_order():
    as_lists = format_table([["MLP", 0.5], ("CNN", 1.25)], ["case", "ratio"])
    as_dicts = format_table([{"case": "MLP", "ratio": 0.5}, {"case": "CNN", "ratio": 1.25}], ["case", "ratio"])
    assert as_lists == as_dicts
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        format_table([["MLP"]], ["case", "ratio"])


def test_middle_half_is_the_quartiles_of_the_times_in_ms():
    assert middle_half([0.001, 0.002, 0.003, 0.004, 0.005]) == "2.000-4.000"
    assert middle_half([0.5], scale=1, digits=1) == "0.5-0.5"
    with pytest.raises(ValueError, match="seconds"):
        middle_half([])


def test_compare_states_only_what_the_middle_half_and_the_sign_test_show():
    assert compare("a", [1] * 5, "b", [2] * 5).startswith("a was faster than b (time ratio 0.500")
    assert compare("a", [2] * 5, "b", [1] * 5).startswith("a was slower than b")
    # the median ratio is below 1, but the middle half spans 1: no conclusion
    assert "the middle half of the ratios spans 1" in compare("a", [0.5, 0.9, 1.5, 0.8, 1.2], "b", [1] * 5)
    with pytest.raises(ValueError, match="equally long"):
        compare("a", [1, 2], "b", [1])
    # four rounds are too few, however clear they look: all four one way happens by chance 1 time in 16
    assert "too few rounds to judge, at least 5" in compare("a", [1] * 4, "b", [2] * 4)
    # 7 of 8 rounds one way pass (p = 0.035); 6 of 7 do not (p = 0.0625), although the middle half is clear of 1
    assert compare("a", [0.9] * 7 + [1.1], "b", [1] * 8).startswith("a was faster")
    assert "the rounds disagree too often" in compare("a", [0.9] * 6 + [1.1], "b", [1] * 7)
    assert "7 of 8 rounds below 1" in compare("a", [0.9] * 7 + [1.1], "b", [1] * 8)


def test_a_small_ratio_is_printed_with_enough_digits_to_read_it():
    assert "time ratio 0.995" in compare("a", [0.995] * 5, "b", [1] * 5)


@pytest.mark.parametrize(
    ("favouring", "rounds", "chance"), [(5, 5, 1 / 32), (4, 5, 6 / 32), (7, 8, 9 / 256), (0, 3, 1.0)]
)
def test_sign_test_is_the_binomial_tail(favouring, rounds, chance):
    from helpers.timing import sign_test

    assert sign_test(favouring, rounds) == pytest.approx(chance)


@pytest.mark.parametrize("timer", ["time_call", "time_interleaved"])
def test_the_clock_is_read_only_after_the_device_finished_each_call(monkeypatch, timer):
    """On a GPU a call returns when its kernels are queued: each timing waits for the device before reading the
    clock (a fake device stands in: its synchronize advances the clock by the queued work)."""
    from helpers import timing

    now = [0.0]
    queued = []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(
        timing, "synchronize", lambda device: (now.__setitem__(0, now[0] + sum(queued)), queued.clear())
    )
    work = lambda: queued.append(0.5)  # noqa: E731  # half a second of "kernels", queued, not yet run
    if timer == "time_call":
        seconds = timing.time_call(work, repeat=3, warmup=1, device="cuda")
    else:
        seconds = timing.time_interleaved({"a": work, "b": work}, repeat=3, warmup=1, device="cuda")["b"]
    assert seconds == [0.5, 0.5, 0.5]


def test_median_ratio_is_the_median_of_per_round_ratios_not_a_ratio_of_medians():
    """Mistake: median(a) / median(b), which pairs rounds that did not run together."""
    from helpers.timing import median_ratio

    assert median_ratio([1.0, 10.0, 100.0], [1.0, 1.0, 1000.0]) == pytest.approx(1.0)  # ratios 1, 10, 0.1


def test_format_rows_puts_each_key_before_its_row_values():
    from helpers.timing import format_rows

    rows = {0: {"kept": 101, "ratio": 1.0}, 10: {"kept": 19, "ratio": 0.188}}
    lines = format_rows(rows, key="segments", formats={"ratio": "x{:.2f}"}, title="kept").splitlines()
    assert lines[0] == "kept"
    assert lines[1].split() == ["segments", "kept", "ratio"]
    assert [line.split() for line in lines[3:]] == [["0", "101", "x1.00"], ["10", "19", "x0.19"]]


def test_format_rows_refuses_no_rows_rows_that_are_not_mappings_and_a_key_named_like_a_column():
    from helpers.timing import format_rows

    with pytest.raises(ValueError, match="at least one row"):
        format_rows({}, key="segments")
    with pytest.raises(TypeError, match="rows must map each key"):
        format_rows([{"kept": 1}], key="segments")
    with pytest.raises(TypeError, match="rows must map each key"):
        format_rows({0: [1, 2]}, key="segments")
    with pytest.raises(ValueError, match="key 'kept' is also a column"):
        format_rows({0: {"kept": 1}}, key="kept")
    with pytest.raises(ValueError, match="row 1 lacks the columns"):
        format_rows({0: {"kept": 1}, 2: {"other": 1}}, key="segments")


def test_format_columns_puts_each_source_in_a_column_with_the_row_names_first():
    from helpers.timing import format_columns

    columns = {"by hand": {"loss": 0.5, "accuracy": 0.25}, "sklearn": {"accuracy": 0.75, "loss": 1.5}}
    lines = format_columns(columns, key="metric", title="agree?").splitlines()
    assert lines[0] == "agree?"
    assert lines[1].split() == ["metric", "by", "hand", "sklearn"]
    assert [line.split() for line in lines[3:]] == [["loss", "0.500", "1.500"], ["accuracy", "0.250", "0.750"]]


def test_format_columns_picks_rows_and_formats_every_value():
    from helpers.timing import format_columns

    columns = {"plain": {1: 2048, 2: 4096, "peak": 4096}, "no_grad": {1: 0, 2: 0, "peak": 0}}
    as_function = format_columns(columns, key="after", rows=["peak", 1], value_format=lambda b: f"{b // 1024} KiB")
    assert [line.split() for line in as_function.splitlines()[2:]] == [
        ["peak", "4", "KiB", "0", "KiB"],
        ["1", "2", "KiB", "0", "KiB"],
    ]
    as_string = format_columns(columns, key="after", rows=[2], value_format="{:,}")
    assert as_string.splitlines()[2].split() == ["2", "4,096", "0"]


def test_format_columns_refuses_bad_columns_a_key_named_like_a_column_missing_rows_and_bad_formats():
    from helpers.timing import format_columns

    with pytest.raises(ValueError, match="at least one column"):
        format_columns({}, key="metric")
    with pytest.raises(TypeError, match="columns must map each column"):
        format_columns([{"loss": 1}], key="metric")
    with pytest.raises(TypeError, match="columns must map each column"):
        format_columns({"a": [1, 2]}, key="metric")
    with pytest.raises(ValueError, match="key 'a' is also a column"):
        format_columns({"a": {"loss": 1}}, key="a")
    with pytest.raises(ValueError, match=r"column 'b' lacks the rows \['loss'\]"):
        format_columns({"a": {"loss": 1}, "b": {"other": 1}}, key="metric")
    with pytest.raises(ValueError, match=r"column 'a' lacks the rows \['f1'\]"):
        format_columns({"a": {"loss": 1}}, key="metric", rows=["f1"])
    with pytest.raises(TypeError, match="value_format must be a format string or a function"):
        format_columns({"a": {"loss": 1}}, key="metric", value_format=3)
