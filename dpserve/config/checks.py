"""The checks a resolved router or serve configuration must pass.

`dpserve.config` resolves the settings and calls :func:`validate_router` and
:func:`validate_serve`; each failed check raises :class:`ConfigError` naming the
setting, its rule and the value. The adapter-name rules live here too, for the
deploy API that names adapters at run time.
"""

from __future__ import annotations

import ipaddress
import re

from dpserve.config.schema import POLICIES, RouterConfig, ServeConfig
from dpserve.config.settings import ConfigError, DiscoveryError, parse_target, require


def validate_router(c: RouterConfig) -> None:
    require(bool(c.host), "router.host", "must not be empty", c.host)
    require(0 <= c.port <= 65535, "router.port", "must be in 0..65535", c.port)
    require(1 <= c.workers <= 64, "router.workers", "must be in 1..64", c.workers)
    require(c.policy in POLICIES, "router.policy", f"must be one of {', '.join(POLICIES)}",
             c.policy)
    require(c.max_body_bytes >= 1024, "router.max_body_bytes", "must be at least 1024",
             c.max_body_bytes)
    for name in ("connect_timeout_s", "first_byte_timeout_s", "stream_idle_timeout_s",
                 "health_interval_s", "health_timeout_s"):
        value = getattr(c, name)
        require(value > 0, f"router.{name}", "must be > 0", value)
    require(c.graceful_shutdown_s >= 0, "router.graceful_shutdown_s", "must be >= 0",
             c.graceful_shutdown_s)
    for name in ("migration_limit", "migration_max_tokens", "retry_backoff_s",
                 "retry_backoff_max_s", "max_in_flight_per_replica",
                 "queue_size", "breaker_cooldown_s"):
        value = getattr(c, name)
        require(value >= 0, f"router.{name}", "must be >= 0", value)
    for name in ("engine_scrape_interval_s", "queue_timeout_s"):
        value = getattr(c, name)
        require(value > 0, f"router.{name}", "must be > 0", value)
    if c.load_factor is not None:
        require(c.load_factor >= 1, "router.load_factor", "must be >= 1", c.load_factor)
    if c.otlp_traces_endpoint is not None:
        require(c.otlp_traces_endpoint.startswith(("http://", "https://")),
                "router.otlp_traces_endpoint", "must be an http:// or https:// URL",
                c.otlp_traces_endpoint)
    if c.discover is not None:
        try:
            parse_target(c.discover)
        except DiscoveryError as exc:
            raise ConfigError(f"router.discover: {exc}") from None
    for name in ("discover_interval_s", "deploy_lock_ttl_s"):
        value = getattr(c, name)
        require(value > 0, f"router.{name}", "must be > 0", value)
    _validate_lora(c)
    _validate_kv(c)
    _validate_peers(c)
    require(c.prefix_chars >= 1, "router.prefix_chars", "must be >= 1", c.prefix_chars)
    for name in ("max_attempts", "unhealthy_threshold", "healthy_threshold",
                 "breaker_failures"):
        value = getattr(c, name)
        require(value >= 1, f"router.{name}", "must be >= 1", value)
    for name in ("max_header_bytes", "max_connections", "max_inflight_body_bytes",
                 "max_response_bytes"):
        value = getattr(c, name)
        require(value >= 1024 if name != "max_connections" else value >= 1,
                f"router.{name}", "must be at least 1024" if name != "max_connections"
                else "must be >= 1", value)
    require(c.max_inflight_body_bytes >= c.max_body_bytes, "router.max_inflight_body_bytes",
            f"must be >= router.max_body_bytes ({c.max_body_bytes})",
            c.max_inflight_body_bytes)
    for name in ("client_header_timeout_s", "client_body_timeout_s", "keep_alive_timeout_s"):
        value = getattr(c, name)
        require(value > 0, f"router.{name}", "must be > 0", value)
    if c.admin_port is not None:
        require(1 <= c.admin_port <= 65535, "router.admin_port", "must be in 1..65535",
                c.admin_port)
        require(c.admin_port != c.port or c.port == 0, "router.admin_port",
                "must differ from router.port", c.admin_port)
    for proxy in c.trusted_proxies or []:
        try:
            ipaddress.ip_network(proxy, strict=False)
        except ValueError:
            raise ConfigError(f"router.trusted_proxies: not an address or network, "
                              f"got {proxy!r}") from None
    for local in c.local_admin_addresses:
        try:
            loopback = ipaddress.ip_network(local, strict=False).is_loopback
        except ValueError:
            raise ConfigError(f"router.local_admin_addresses: not an address or network, "
                              f"got {local!r}") from None
        require(loopback, "router.local_admin_addresses",
                "must be loopback addresses (set an admin key to manage the router from "
                "elsewhere)", local)
    require(c.engine_metrics_cache_s >= 0, "router.engine_metrics_cache_s", "must be >= 0",
            c.engine_metrics_cache_s)
    require(not c.engine_metrics_need_key or bool(c.api_keys) or c.admin_key is not None,
            "router.engine_metrics_need_key", "needs an API key or the admin key to check "
            "(DPSERVE_API_KEY, --api-key-file, DPSERVE_ADMIN_KEY)", c.engine_metrics_need_key)
    _validate_admin_exposure(c)
    require(c.log_level.lower() in ("debug", "info", "warning", "error", "critical"),
             "router.log_level", "must be debug, info, warning, error or critical", c.log_level)


def is_loopback_host(host: str) -> bool:
    """Whether a listening address is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _validate_admin_exposure(c: RouterConfig) -> None:
    """Without an admin key, `/admin/*` trusts loopback clients; a listener beyond
    loopback must not rely on that (a sidecar or NAT makes remote clients look local)."""
    if c.admin_key is not None:
        return
    if c.trusted_proxies:
        raise ConfigError(
            "router.admin_key: required with router.trusted_proxies: a proxy relays remote "
            "clients, and one on this machine (a sidecar) relays them from a local address "
            "that /admin would trust; set DPSERVE_ADMIN_KEY or --admin-key-file")
    if c.insecure_admin:
        return
    exposed = (c.admin_host if c.admin_port is not None else c.host)
    if not is_loopback_host(exposed):
        where = "router.admin_host" if c.admin_port is not None else "router.host"
        raise ConfigError(
            f"router.admin_key: required when /admin listens beyond loopback ({where} is "
            f"{exposed}): set DPSERVE_ADMIN_KEY or --admin-key-file, serve /admin on a "
            "loopback --admin-port, or accept the risk with --insecure-admin")


# vLLM 0.32 accepts these adapter ranks (`LoRAConfig.max_lora_rank`).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# An adapter's name is a path segment, a label and an engine-side name: kept plain. `@`
# separates a name from its version (`NAME@VERSION` pins a version).
_LORA_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def lora_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if not name or len(name) > 64 or not set(name) <= _LORA_NAME_CHARS or name[0] in ".-":
        return (f"adapter name {name!r} must be 1-64 letters, digits, '.', '_' or '-', "
                "not starting with '.' or '-'")
    return None


def parse_lora_spec(spec: str) -> tuple[str, str]:
    """`NAME=DIR` -> (NAME, DIR); ConfigError naming `router.loras` otherwise."""
    name, sep, path = spec.partition("=")
    if not sep or not path:
        raise ConfigError(f"router.loras: expected NAME=DIR, got {spec!r}")
    problem = lora_name_problem(name)
    if problem is not None:
        raise ConfigError(f"router.loras: {problem}")
    return name, path


def _validate_lora(c: RouterConfig) -> None:
    require(c.max_loras >= 1, "router.max_loras", "must be >= 1", c.max_loras)
    require(c.max_lora_rank in LORA_RANKS, "router.max_lora_rank",
            f"must be one of {', '.join(map(str, LORA_RANKS))} (vLLM's choices)",
            c.max_lora_rank)
    if c.max_cpu_loras is not None:
        require(c.max_cpu_loras >= c.max_loras, "router.max_cpu_loras",
                f"must be >= max_loras ({c.max_loras})", c.max_cpu_loras)
    names = [parse_lora_spec(spec)[0] for spec in c.loras or ()]
    require(len(set(names)) == len(names), "router.loras", "must not name an adapter twice",
            ",".join(names))
    if names or c.max_cpu_loras is not None:
        require(c.enable_lora, "router.enable_lora",
                "must be set to deploy adapters (--enable-lora)", c.enable_lora)


def _validate_kv(c: RouterConfig) -> None:
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        value = getattr(c, name)
        if value is not None:
            found = _KV_ENDPOINT.fullmatch(value)
            require(found is not None and int(found[1]) <= 65535, f"router.{name}",
                    "must be tcp://*:PORT (each replica's own host is used)", value)
    require(c.kv_events_replay_endpoint is None or c.kv_events_endpoint is not None,
            "router.kv_events_replay_endpoint", "needs kv_events_endpoint",
            c.kv_events_replay_endpoint)
    require(0 < len(c.kv_events_topic) <= 256, "router.kv_events_topic",
            "must be 1 to 256 characters", c.kv_events_topic)


_KV_ENDPOINT = re.compile(r"tcp://\*:([1-9][0-9]{0,4})")
MIN_PEER_KEY_CHARS = 32
_PEER_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._*-]+):([1-9][0-9]{0,4})")


def _validate_peers(c: RouterConfig) -> None:
    for name, values in (("peers", c.peers or []), ("peer_bind", [c.peer_bind] if
                                                      c.peer_bind is not None else [])):
        for value in values:
            found = _PEER_ADDRESS.fullmatch(value)
            require(found is not None and int(found[2]) <= 65535, f"router.{name}",
                    "must be HOST:PORT ([ADDR]:PORT for IPv6)", value)
    if not c.peers and c.peer_bind is None:
        return
    require(bool(c.peers), "router.peer_bind", "needs peers (the other routers)",
            c.peer_bind)
    require(c.peer_key is not None, "router.peer_key",
            "must be set with peers (DPSERVE_PEER_KEY or peer_key_file): reports between "
            "routers are signed", None)
    assert c.peer_key is not None
    require(len(c.peer_key) >= MIN_PEER_KEY_CHARS and c.peer_key.isprintable()
            and " " not in c.peer_key, "router.peer_key",
            f"must be at least {MIN_PEER_KEY_CHARS} printable characters, no spaces",
            "<hidden>")


def validate_serve(c: ServeConfig) -> None:
    require(c.router.discover is None, "router.discover",
             "only `dpserve router` discovers replicas; `serve` starts its own", c.router.discover)
    require(not c.router.peers, "router.peers",
            "only `dpserve router` has peers; `serve` is one router for its replicas",
            c.router.peers)
    require(bool(c.model.strip()), "model", "must not be empty", c.model)
    if c.replicas is not None:
        require(c.replicas >= 1, "replicas", "must be >= 1", c.replicas)
    if c.gpus is not None:
        require(len(c.gpus) > 0 and all(g >= 0 for g in c.gpus), "gpus",
                 "must be a non-empty list of GPU indices >= 0", c.gpus)
        require(len(set(c.gpus)) == len(c.gpus), "gpus", "must not repeat a GPU", c.gpus)
        if c.replicas is not None:
            require(c.replicas == len(c.gpus), "replicas",
                     f"must equal the number of --gpus ({len(c.gpus)}) when both are given",
                     c.replicas)
    require(c.cpu_kvcache_gib > 0, "cpu_kvcache_gib", "must be > 0", c.cpu_kvcache_gib)
    if c.cpu_binds is not None:
        binds = c.cpu_binds.split("|")
        require(all(_is_core_set(b) for b in binds), "cpu_binds",
                 "must be core lists like '0-3|4-7' or '0,2|1,3', one per replica", c.cpu_binds)
        if c.replicas is not None:
            require(len(binds) == c.replicas, "cpu_binds",
                     f"must name one core list per replica ({c.replicas})", c.cpu_binds)
    for name in ("startup_timeout_s", "restart_backoff_s", "restart_backoff_max_s",
                 "stop_timeout_s"):
        value = getattr(c, name)
        require(value > 0, name, "must be > 0", value)
    require(c.restart_backoff_max_s >= c.restart_backoff_s, "restart_backoff_max_s",
             "must be >= restart_backoff_s", c.restart_backoff_max_s)
    for arg in c.vllm_args:
        require(arg.split("=", 1)[0] not in _RESERVED_VLLM_ARGS, "vllm_args",
                 "must not set --host, --port, --model, --served-model-name or the LoRA "
                 "options (dpserve owns them: use --enable-lora, --max-loras, "
                 "--max-lora-rank, --max-cpu-loras, --lora)", arg)


_RESERVED_VLLM_ARGS = frozenset({"--host", "--port", "--model", "--served-model-name",
                                 "--enable-lora", "--max-loras", "--max-lora-rank",
                                 "--max-cpu-loras", "--lora-modules"})


def _is_core_set(text: str) -> bool:
    """True for vLLM's id-list syntax: `5`, `0-3`, `5,2-4`."""
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and (not hi.isdigit() or int(hi) < int(lo))):
            return False
    return True
