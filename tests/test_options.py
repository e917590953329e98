"""helpers.cli.options: a dataclass of settings read from the command line, with its comments as help."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from helpers.cli.options import field_comments, parse_settings, parser_for


@dataclass(frozen=True)
class Settings:
    """A made-up config block."""

    steps: int = 3  # optimizer steps
    lr: float = 0.1  # the learning rate
    name: str | None = None  # where to write
    threads: int | None = None
    fast: bool = False  # go faster
    kind: str = "a"  # a or b

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be a positive int, got {self.steps}")


def read(*argv: str) -> Settings:
    return parse_settings(Settings, list(argv), prog="prog", description="d", choices={"kind": ("a", "b")})


def test_each_field_reads_as_its_type_with_its_default():
    assert read() == Settings()
    got = read("--steps", "7", "--lr", "0.5", "--name", "x", "--threads", "2", "--fast", "--kind", "b")
    assert got == Settings(steps=7, lr=0.5, name="x", threads=2, fast=True, kind="b")
    assert read("--no-fast").fast is False


def test_comments_are_the_help_and_fields_without_one_get_none():
    comments = field_comments(Settings)
    assert comments == {
        "steps": "optimizer steps",
        "lr": "the learning rate",
        "name": "where to write",
        "fast": "go faster",
        "kind": "a or b",
    }
    shown = parser_for(Settings, prog="prog", description="d").format_help()
    assert "optimizer steps" in shown and "--threads" in shown and "(default: 3)" in shown


def test_a_value_the_settings_refuse_ends_with_their_message(capsys):
    with pytest.raises(SystemExit):
        read("--steps", "0")
    assert "steps must be a positive int, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        read("--kind", "c")
    assert "invalid choice: 'c'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        read("--steps", "many")
    assert "invalid int value: 'many'" in capsys.readouterr().err


def test_only_a_dataclass_type_makes_a_parser():
    with pytest.raises(TypeError, match="settings must be a dataclass type"):
        parser_for(Settings(), prog="p", description="d")
