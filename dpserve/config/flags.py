"""Command-line flags generated from the fields of a settings dataclass.

A setting is declared once, as a field with its type, default and docstring; its flag
follows from it. `max_body_bytes: int` becomes `--max-body-bytes` (dest
`max_body_bytes`, `type=int`), with the field's docstring as its help. Every flag
defaults to None, so that an unset flag leaves the setting to the environment, the
YAML file and the default (`dpserve.config.settings.resolve`). By annotation:

| field                              | flag                                        |
|------------------------------------|---------------------------------------------|
| `int`, `float` (or `... \\| None`)  | `type=int`, `type=float`                    |
| `str`, `list[...]`                 | a string (a list's items comma-separated)   |
| `Literal[...]`                     | `choices`, in the Literal's order           |
| `bool` defaulting to False         | `store_true` (default None)                 |
| `bool` defaulting to True          | `--name` / `--no-name` (default None)       |

`overrides` holds what truly differs for a flag (a metavar, an appending flag, a
help that names the flag's alternatives); `flags` there replaces the option strings.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from dpserve.config.fielddocs import as_help, field_docs


def flag_name(field: str) -> str:
    """`max_body_bytes` -> `--max-body-bytes`."""
    return "--" + field.replace("_", "-")


def add_setting_flags(
    container: argparse._ActionsContainer,
    cls: type,
    names: Sequence[str] | None = None,
    *,
    skip: Collection[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Add a flag to `container` (a parser or an argument group) for each field of the
    dataclass `cls` named in `names` (default: every field, in declaration order) and
    not in `skip`. `overrides[name]` updates that flag's `add_argument` keywords."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    chosen = [n for n in (names if names is not None else fields) if n not in skip]
    overrides = overrides or {}
    unknown = (set(chosen) - set(fields)) | (set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for name in chosen:
        kwargs = flag_arguments(fields[name], hints[name], docs.get(name, ""))
        kwargs.update(overrides.get(name, {}))
        flags = kwargs.pop("flags", (flag_name(name),))
        container.add_argument(*flags, dest=name, **kwargs)


def flag_arguments(field: dataclasses.Field[Any], hint: Any, doc: str) -> dict[str, Any]:
    """The `add_argument` keywords for one field (see the module docstring)."""
    kwargs: dict[str, Any] = {"help": as_help(doc) if doc else None}
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        on_by_default = field.default is True
        kwargs["action"] = argparse.BooleanOptionalAction if on_by_default else "store_true"
        kwargs["default"] = None
    elif typing.get_origin(hint) is typing.Literal:
        kwargs["choices"] = typing.get_args(hint)
    elif hint in (int, float):
        kwargs["type"] = hint
    return kwargs
