"""The router's API and admin keys: gathered from the environment, the config file and
key files, then checked at start-up, an error naming where a bad key came from (the
variable, or the file and line) and never showing the key.

An API key has at least 8 characters; an admin key, which deploys weights into every
replica, at least 16, and is none of the API keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dpserve.config.settings import ENV_PREFIX, ConfigError, require

MIN_API_KEY_CHARS = 8
MIN_ADMIN_KEY_CHARS = 16


@dataclass(frozen=True)
class Keys:
    api_keys: list[str] | None
    """Every accepted API key, each once, in the order found; None: no key required."""
    admin_key: str | None


def resolve_keys(*, api_key: str | None, api_keys: list[str] | None,
                 api_key_file: str | None, admin_key: str | None,
                 admin_key_file: str | None, env: Mapping[str, str]) -> Keys:
    """The keys of the resolved settings plus those of the key files, checked."""
    sources: dict[str, str] = {}  # key -> where it came from
    for key in [api_key] if api_key else []:
        sources.setdefault(key, _where("API_KEY", "router.api_key", env))
    for key in api_keys or []:
        sources.setdefault(key, _where("API_KEYS", "router.api_keys", env))
    if api_key_file is not None:
        for line, key in read_keys(api_key_file, "router.api_key_file"):
            sources.setdefault(key, f"line {line} of {api_key_file}")
    admin_from = _where("ADMIN_KEY", "router.admin_key", env)
    if admin_key_file is not None:
        (line, admin_key), *_ = read_keys(admin_key_file, "router.admin_key_file")
        admin_from = f"line {line} of {admin_key_file}"
    for key, where in sources.items():
        require(len(key) >= MIN_API_KEY_CHARS, "router.api_key",
                f"must be at least {MIN_API_KEY_CHARS} characters (the key from {where})",
                "<hidden>")
        require(key.isprintable() and " " not in key, "router.api_key",
                f"must be printable and have no spaces (the key from {where})", "<hidden>")
    if admin_key is not None:
        require(len(admin_key) >= MIN_ADMIN_KEY_CHARS, "router.admin_key",
                f"must be at least {MIN_ADMIN_KEY_CHARS} characters (the key from "
                f"{admin_from})", "<hidden>")
        require(admin_key not in sources, "router.admin_key",
                "must differ from every API key", "<hidden>")
    return Keys(api_keys=list(sources) or None, admin_key=admin_key)


def read_keys(path: str, label: str) -> list[tuple[int, str]]:
    """(line number, key) of the non-empty, non-comment lines of a key file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read {path}: {exc.strerror}") from None
    keys = [(n, k.strip()) for n, k in enumerate(text.splitlines(), 1)
            if k.strip() and not k.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"{label}: {path} holds no key")
    return keys


def _where(variable: str, setting: str, env: Mapping[str, str]) -> str:
    return ENV_PREFIX + variable if ENV_PREFIX + variable in env else f"{setting} in the file"
