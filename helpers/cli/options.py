"""Command-line options from a dataclass of settings: one `--flag` per field, with its default, its type and the
comment written beside the field as its help, so a script's config block is its documentation."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any


def field_comments(settings: type) -> dict[str, str]:
    """Each field's comment in the source of the dataclass `settings` (`name: int = 1  # what it is`), by field."""
    comments = {}
    for line in inspect.getsource(settings).splitlines():
        name, _, rest = line.strip().partition(":")
        if "#" in rest and name.isidentifier():
            comments[name] = rest.split("#", 1)[1].strip()
    return comments


def _value_type(hint: Any) -> Any:
    """int for `int` and `int | None`, and so on: the type an option's text is read as."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def parser_for(
    settings: type, *, prog: str, description: str, choices: Mapping[str, Sequence[str]] | None = None
) -> argparse.ArgumentParser:
    """An ArgumentParser with an option per field of the dataclass `settings`: bools as --x / --no-x, the fields
    named in `choices` limited to those values, the others read as their annotated type."""
    if not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
        raise TypeError(f"settings must be a dataclass type, got {settings!r}")
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    comments, hints, choices = field_comments(settings), typing.get_type_hints(settings), dict(choices or {})
    for field in dataclasses.fields(settings):
        flag = f"--{field.name.replace('_', '-')}"
        options: dict[str, Any] = {"default": field.default, "help": comments.get(field.name) or " "}
        kind = _value_type(hints[field.name])
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        elif field.name in choices:
            parser.add_argument(flag, choices=list(choices[field.name]), **options)
        else:
            parser.add_argument(flag, type=kind, **options)
    return parser


def parse_settings(settings: type, argv: Sequence[str] | None, **parser_options: Any) -> Any:
    """The dataclass `settings` built from the command line; a value it refuses ends the program with its message."""
    parser = parser_for(settings, **parser_options)
    try:
        return settings(**vars(parser.parse_args(argv)))
    except (ValueError, TypeError) as error:
        parser.error(str(error))
