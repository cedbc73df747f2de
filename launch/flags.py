"""Command-line flags derived from config dataclasses, both ways.

`add_flags` builds a parser's flags from a config class: `--field-name`, with type, default,
choices and help from `opt(...)`. `to_argv` turns a config back into the flags that differ from the
defaults. That is how a launcher hands a child process its config."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

C = TypeVar("C")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    """X for `X | None`."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, _base_type(hints[f.name])) for f in dataclasses.fields(cls) if f.init]


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    for f, tp in _fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kwargs: dict[str, Any] = {"help": argparse.SUPPRESS if meta.get("hidden") else meta.get("help")}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = tp
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
        parser.add_argument(_flag(f.name), dest=f.name, **kwargs)


def from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """The config of `cls` from parsed flags. Fields the parser lacks keep their defaults."""
    values = {f.name: getattr(args, f.name) for f, _ in _fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def to_argv(cfg: Any) -> list[str]:
    """`cfg` as flags, for every required field and every field that differs from its default."""
    argv: list[str] = []
    for f, tp in _fields(type(cfg)):
        value = getattr(cfg, f.name)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if not required and value == f.default:
            continue
        if tp is bool:
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif value is not None:
            argv += [_flag(f.name), str(value)]
    return argv
