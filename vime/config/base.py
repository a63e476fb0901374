"""Typed configuration sections whose fields are also their command-line flags.

Each section is a keyword-only dataclass. A field declared with :func:`option` becomes the flag
``--field-name`` (or the name given), its default and help text come from the declaration, and
:func:`section_from_args` rebuilds the typed section from a parsed namespace. One declaration
therefore serves the parser, ``--help`` and the components that receive the section.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from vime.errors import UserError


class ConfigError(UserError, ValueError):
    """A user error in the command line; the message names the offending flag."""

    def __init__(self, flag: str, message: str):
        self.flag, self.message = flag, message
        super().__init__(f"{flag}: {message}")

    def __reduce__(self):
        return type(self), (self.flag, self.message)


def option(
    default: Any = None,
    help: str = "",
    *,
    choices=None,
    flag: str | None = None,
    nargs=None,
    metavar: str | None = None,
    default_factory=None,
    parse=None,
    negatable: bool = False,
):
    """Declare a field that is also a command-line flag (``parse``: the value's parser when the field's
    type cannot parse it, e.g. ``json.loads`` for a dict; ``negatable``: a bool flag that also has its
    ``--no-`` form, as one whose default is true always has)."""
    metadata = {"help": help, "choices": choices, "flag": flag, "nargs": nargs, "metavar": metavar, "parse": parse}
    if negatable:
        metadata["negatable"] = True
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def json_object(text: str) -> dict:
    """Parse a flag's JSON object value (argparse names the flag when this raises)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}: {text!r}")
    return value


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _base_type(annotation) -> tuple[type, bool]:
    """Return (element type, is_list) for a field annotation such as ``int | None``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple):
        return typing.get_args(annotation)[0], True
    if origin is typing.Literal:
        return type(typing.get_args(annotation)[0]), False
    return annotation, False


def add_section_arguments(parser: argparse.ArgumentParser, section: type, title: str, description: str = "") -> None:
    group = parser.add_argument_group(title, description)
    hints = typing.get_type_hints(section)
    for field in dataclasses.fields(section):
        if "help" not in field.metadata:
            continue
        name = flag_name(field)
        kind, is_list = _base_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        kwargs: dict[str, Any] = {"dest": field.name, "help": field.metadata["help"], "default": default}
        if kind is bool and not is_list:
            negatable = default or field.metadata.get("negatable")
            kwargs["action"] = argparse.BooleanOptionalAction if negatable else "store_true"
        else:
            kwargs["type"] = field.metadata.get("parse") or kind
            if field.metadata.get("choices"):
                kwargs["choices"] = field.metadata["choices"]
            if is_list:
                kwargs["nargs"] = field.metadata.get("nargs") or "+"
            elif field.metadata.get("nargs"):
                kwargs["nargs"] = field.metadata["nargs"]
            if field.metadata.get("metavar"):
                kwargs["metavar"] = field.metadata["metavar"]
        if kwargs["help"] and default not in (None, False, [], ()) and "%(default)" not in kwargs["help"]:
            kwargs["help"] += " (default: %(default)s)"
        group.add_argument(name, **kwargs)


def section_from_args(section: type, args: argparse.Namespace):
    values = {}
    for field in dataclasses.fields(section):
        if hasattr(args, field.name):
            value = getattr(args, field.name)
            values[field.name] = list(value) if isinstance(value, tuple) else value
    return section(**values)


def require(condition: bool, flag: str, message: str) -> None:
    if not condition:
        raise ConfigError(flag, message)
