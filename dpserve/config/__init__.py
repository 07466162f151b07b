"""Typed, validated settings for the router and the replica supervisor.

Every setting is resolved once, at the edge, in this order:

    command-line flag  >  environment (DPSERVE_<NAME>)  >  YAML file  >  default

and then validated (`dpserve.config.checks`); an invalid value raises
:class:`ConfigError` naming the setting. Nothing here is global: the resulting
frozen dataclasses are passed explicitly to whatever needs them.

YAML layout (every key optional)::

    model: build/tiny-llama
    replicas: 2
    router:
      port: 8000
      policy: prefix-affinity
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from dpserve.config.checks import (
    LORA_RANKS,
    is_loopback_host,
    lora_name_problem,
    parse_lora_spec,
    validate_router,
    validate_serve,
)
from dpserve.config.keys import read_keys, resolve_keys
from dpserve.config.schema import (
    POLICIES,
    PolicyName,
    RouterConfig,
    ServeConfig,
    effective_policy,
)
from dpserve.config.settings import (
    ENV_PREFIX,
    ConfigError,
    DiscoveryError,
    DnsTarget,
    load_yaml,
    parse_target,
    resolve,
)

__all__ = ["ENV_PREFIX", "LORA_RANKS", "POLICIES", "ConfigError", "DiscoveryError", "DnsTarget",
           "PolicyName", "RouterConfig", "ServeConfig", "build_router_config", "build_serve_config",
           "effective_policy", "is_loopback_host", "load_yaml", "lora_name_problem",
           "parse_lora_spec", "parse_target", "resolve"]

def build_router_config(
    flags: Mapping[str, Any],
    file_values: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> RouterConfig:
    """Resolve a RouterConfig; `file_values` is the YAML file's `router:` section."""
    env = os.environ if env is None else env
    cfg = resolve(RouterConfig, flags, file_values or {}, env, prefix="router.")
    keys = resolve_keys(api_key=cfg.api_key, api_keys=cfg.api_keys,
                        api_key_file=cfg.api_key_file, admin_key=cfg.admin_key,
                        admin_key_file=cfg.admin_key_file, env=env)
    peer_key = cfg.peer_key
    if cfg.peer_key_file is not None:
        (_, peer_key), *_ = read_keys(cfg.peer_key_file, "router.peer_key_file")
    cfg = dataclasses.replace(cfg, api_keys=keys.api_keys, admin_key=keys.admin_key,
                              peer_key=peer_key,
                              otlp_traces_endpoint=cfg.otlp_traces_endpoint
                              or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None)
    validate_router(cfg)
    return cfg


def build_serve_config(
    flags: Mapping[str, Any],
    file_values: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> ServeConfig:
    """Resolve a ServeConfig (and its RouterConfig) from flags, env and a YAML mapping."""
    env = os.environ if env is None else env
    file_values = dict(file_values or {})
    router_file = file_values.pop("router", None) or {}
    if not isinstance(router_file, dict):
        raise ConfigError("router: must be a mapping of router settings")
    router = build_router_config(flags, router_file, env)
    cfg = resolve(ServeConfig, flags, file_values, env, prefix="", extra={"router": router})
    if cfg.model.startswith("~"):  # from a YAML file or quoted: no shell expanded it
        cfg = dataclasses.replace(cfg, model=os.path.expanduser(cfg.model))
    if cfg.router.policy in ("auto", "kv-aware") and cfg.router.tokenizer is None:
        # The engines' own tokenizer: the prompts' token ids as they will see them.
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(
            cfg.router, tokenizer=cfg.model))
    validate_serve(cfg)
    return cfg
