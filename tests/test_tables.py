import pytest

from helpers.tables import format_table


def test_format_table_aligns_columns_and_formats_numbers():
    rows = [{"case": "MLP", "ratio": 0.99512, "n": 3, "tiny": 1e-7}, {"case": "CNN, bar", "ratio": 1.5, "n": None, "tiny": 0.0}]
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


@pytest.mark.parametrize("rows, columns, formats, message", [
    ([{"a": 1}], [], None, "columns"),
    ([{"a": 1}], ["a"], {"b": "{}"}, "formats"),
    ([{"a": 1}], ["a", "b"], None, "lacks the columns"),
])
def test_format_table_bad_inputs(rows, columns, formats, message):
    with pytest.raises(ValueError, match=message):
        format_table(rows, columns, formats=formats)


def test_format_table_takes_rows_as_sequences_in_column_order():
    as_lists = format_table([["MLP", 0.5], ("CNN", 1.25)], ["case", "ratio"])
    as_dicts = format_table([{"case": "MLP", "ratio": 0.5}, {"case": "CNN", "ratio": 1.25}], ["case", "ratio"])
    assert as_lists == as_dicts
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        format_table([["MLP"]], ["case", "ratio"])
