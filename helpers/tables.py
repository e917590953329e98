"""Plain-text tables for measurements: what notebooks print and the benchmark reports."""
from __future__ import annotations

from typing import Mapping, Sequence


def _default_format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if 0.001 <= abs(value) < 1000 else f"{value:.4g}"
    return "" if value is None else str(value)


def format_table(rows: Sequence[Mapping | Sequence], columns: Sequence[str], *,
                 formats: Mapping[str, str] | None = None, title: str = "") -> str:
    """Rows (dicts keyed by column, or sequences in column order) as an aligned table.

    `formats` maps a column to a format such as '{:.2f}'.
    Floats without a format get 3 decimals (or 4 significant digits when very large or small).
    """
    if not columns:
        raise ValueError("columns must name at least one column")
    formats = dict(formats or {})
    unknown = set(formats) - set(columns)
    if unknown:
        raise ValueError(f"formats names columns not in columns: {sorted(unknown)}")
    cells = [[str(c) for c in columns]]
    for number, row in enumerate(rows):
        if not isinstance(row, Mapping):
            if len(row) != len(columns):
                raise ValueError(f"row {number} has {len(row)} cells for {len(columns)} columns: {list(row)}")
            row = dict(zip(columns, row))
        missing = [c for c in columns if c not in row]
        if missing:
            raise ValueError(f"row {number} lacks the columns {missing}")
        cells.append([formats[c].format(row[c]) if c in formats else _default_format(row[c]) for c in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(([title] if title else []) + lines)
