"""How a setting gets its value: flags > environment > YAML file > defaults.

The machinery behind `dpserve.config` and the other typed configs (fine-tune,
simulated fleet): read a YAML mapping, resolve a frozen dataclass field by field
from the four sources, coerce each raw value to the field's declared type, and
fail with a :class:`ConfigError` that names the setting. Values with a syntax of
their own are parsed here too (`dns://NAME:PORT`, the discovery target), so that
the settings never depend on the code that uses them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

ENV_PREFIX = "DPSERVE_"


def without_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less every dpserve setting. Those include the API and admin keys
    (DPSERVE_API_KEY(S), DPSERVE_ADMIN_KEY), which no child process dpserve starts (an
    engine, the checkpoint checker) needs: whatever a process holds can leak through
    its logs, crash dumps or `/proc`."""
    return {k: v for k, v in environ.items() if not k.startswith(ENV_PREFIX)}


class ConfigError(ValueError):
    """A setting is missing, malformed or out of range; the message names it."""


T = TypeVar("T")


def load_yaml(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """Read a YAML settings file; a missing or non-mapping file is a ConfigError."""
    if path is None:
        return {}
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping, got {type(data).__name__}")
    return data


def resolve(
    cls: type[T],
    flags: Mapping[str, Any],
    file_values: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    prefix: str,
    extra: Mapping[str, Any] | None = None,
) -> T:
    """Build dataclass `cls` from flags > env (DPSERVE_<NAME>) > file values > defaults.

    `extra` supplies already-built fields (nested configs); `prefix` names the
    section in error messages.
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    nested = set(extra or {})
    unknown = set(file_values) - names
    if unknown:
        raise ConfigError(
            f"unknown setting(s) in config file: {', '.join(prefix + u for u in sorted(unknown))}"
        )
    values: dict[str, Any] = dict(extra or {})
    for name in names - nested:
        label = prefix + name
        if flags.get(name) is not None:
            raw, source = flags[name], "flag"
        elif ENV_PREFIX + name.upper() in env:
            raw, source = env[ENV_PREFIX + name.upper()], "env"
        elif name in file_values:
            raw, source = file_values[name], "file"
        else:
            continue
        values[name] = _coerce(label, hints[name], raw, from_text=source == "env")
    try:
        return cls(**values)
    except TypeError as exc:  # a required field without a value
        missing = sorted(
            f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.name not in values
            and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        raise ConfigError(f"missing required setting(s): {', '.join(missing)}") from exc


def _coerce(label: str, hint: Any, raw: Any, *, from_text: bool) -> Any:
    """Turn a flag/env/YAML value into the field's declared type, or fail naming it."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if raw is None or (from_text and optional and raw == ""):
        if optional:
            return None
        raise ConfigError(f"{label}: a value is required")
    try:
        if typing.get_origin(hint) is list:
            (item,) = typing.get_args(hint)
            if isinstance(raw, str):
                raw = [p.strip() for p in raw.split(",") if p.strip()] if from_text else [raw]
            if not isinstance(raw, list | tuple):
                raise TypeError
            return [_scalar(item, v) for v in raw]
        return _scalar(hint, raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{label}: expected {_type_name(hint)}, got {raw!r}") from None


def _scalar(hint: Any, raw: Any) -> Any:
    if typing.get_origin(hint) is typing.Literal:
        # A choice reads as its values' type; whether it is one of them is the
        # validation's to say (in the message that lists them).
        return _scalar(type(typing.get_args(hint)[0]), raw)
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError
    if hint is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError
        return int(raw)
    if hint is float:
        if isinstance(raw, bool):
            raise ValueError
        value = float(raw)
        if not math.isfinite(value):  # "inf" and "nan" parse, but no setting means them
            raise ValueError
        return value
    if hint is str:
        if not isinstance(raw, str | int | float) or isinstance(raw, bool):
            raise TypeError
        return str(raw)
    raise TypeError(hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return _type_name(type(typing.get_args(hint)[0]))
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true/false"}.get(
        hint, str(hint)
    )


def require(ok: bool, label: str, message: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{label}: {message}, got {value!r}")


# -- values with a syntax of their own -----------------------------------------------

SCHEMES = ("dns",)


class DiscoveryError(ValueError):
    """A discovery target that cannot be parsed; the message says why."""


@dataclass(frozen=True)
class DnsTarget:
    """`dns://NAME:PORT`: replicas are `http://ADDRESS:PORT` for each A record of NAME."""

    name: str
    port: int

    def __str__(self) -> str:
        return f"dns://{self.name}:{self.port}"


def parse_target(text: str) -> DnsTarget:
    """Parse `dns://NAME:PORT` (the only scheme so far); DiscoveryError if malformed."""
    parts = urlsplit(text)
    if parts.scheme not in SCHEMES:
        raise DiscoveryError(f"expected dns://NAME:PORT, got {text!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or not 0 < port < 65536:
        raise DiscoveryError(f"expected dns://NAME:PORT with a port in 1..65535, got {text!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise DiscoveryError(f"expected dns://NAME:PORT and nothing else, got {text!r}")
    return DnsTarget(parts.hostname, port)
