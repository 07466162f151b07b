"""Typed, validated settings for the router and the replica supervisor.

Every setting is resolved once, at the edge, in this order:

    command-line flag  >  environment (DPSERVE_<NAME>)  >  YAML file  >  default

and then validated; an invalid value raises :class:`ConfigError` naming the
setting. Nothing here is global: the resulting frozen dataclasses are passed
explicitly to whatever needs them.

YAML layout (every key optional)::

    model: build/tiny-llama
    replicas: 2
    router:
      port: 8000
      policy: prefix-affinity
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dpserve.keys import resolve_keys
from dpserve.settings import (
    ENV_PREFIX,
    ConfigError,
    DiscoveryError,
    DnsTarget,
    load_yaml,
    parse_target,
    require,
    resolve,
)

__all__ = ["ENV_PREFIX", "POLICIES", "ConfigError", "DiscoveryError", "DnsTarget",
           "RouterConfig", "ServeConfig", "build_router_config", "build_serve_config",
           "load_yaml", "parse_target", "resolve"]

POLICIES = ("least-outstanding", "round-robin", "session-affinity", "prefix-affinity",
            "engine-load")


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How the router listens, routes, checks health and gives up."""

    host: str = "127.0.0.1"
    """Address the OpenAI API listens on. Replicas always stay on loopback."""
    port: int = 8000
    """Port of the OpenAI API."""
    policy: str = "prefix-affinity"
    """Replica selection: `prefix-affinity` (prompts starting alike together, the rest
    spread by recent work), `least-outstanding` (fewer in flight of two random replicas),
    `round-robin`, `session-affinity` (X-Session-Id or `user`) or `engine-load` (the
    engines' own queue and KV-cache reports). Why the default: benchmarks/README.md."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body accepted; larger ones get 413 before reaching a replica."""
    connect_timeout_s: float = 5.0
    """Time to open a connection to a replica before trying another."""
    first_byte_timeout_s: float = 600.0
    """Time to wait for a replica's response headers (long prompts queue in vLLM)."""
    stream_idle_timeout_s: float = 300.0
    """Longest gap between two chunks of a response before the stream is cut with an error."""
    max_attempts: int = 3
    """Replicas tried per request when one fails before any byte reached the client
    (connection refused or dropped, 502/503/504, a timeout on a non-streaming request);
    each retry goes to a replica not tried yet."""
    migration_limit: int = 3
    """Times one stream may move to another replica when its own dies or stalls after
    the stream started (token replay; 0 turns migration off). Three covers a replica
    lost and its successor lost too, while a request that breaks every engine it
    reaches (a poison prompt) stops after three re-prefills."""
    migration_max_tokens: int = 32768
    """Longest context (prompt plus generated tokens) a migration replays; a longer
    stream is cut as without migration, since its re-prefill would cost more than
    the client's retry."""
    retry_backoff_s: float = 0.02
    """Delay before the first retry (full jitter), doubling per further retry."""
    retry_backoff_max_s: float = 1.0
    """Longest delay between two attempts of one request."""
    prefix_chars: int = 256
    """`prefix-affinity`: leading characters of the prompt (or rendered messages) hashed."""
    load_factor: float | None = None
    """Affinity policies: a replica takes a key's request only while its in-flight count
    is under `load_factor` x the fleet average (bounded loads). Default: 3 for
    `prefix-affinity` (a prefix's cache is worth some queueing), 2 for `session-affinity`,
    1.5 for the adapter preference of `lora_affinity`."""
    engine_scrape_interval_s: float = 1.0
    """`engine-load` and `lora_affinity`: period of reading every replica's /metrics
    (queue, KV cache, the adapters it runs)."""
    max_in_flight_per_replica: int = 0
    """Requests in flight per replica before new ones wait in the router's queue
    (0: no cap; vLLM's own scheduler queues them)."""
    queue_size: int = 1024
    """Requests that may wait for a free replica; beyond it, 429 with Retry-After."""
    queue_timeout_s: float = 30.0
    """Longest wait in the router's queue before 429 with Retry-After."""
    breaker_failures: int = 5
    """Consecutive failed requests (connection errors, timeouts, 5xx; never 4xx) that open
    a replica's circuit breaker and take it out of rotation."""
    breaker_cooldown_s: float = 10.0
    """Time an open breaker waits before letting one probe request through."""
    health_interval_s: float = 1.0
    """Period of the active health check of every replica."""
    health_timeout_s: float = 2.0
    """Timeout of one health check."""
    unhealthy_threshold: int = 2
    """Consecutive failed checks that take a ready replica out of rotation."""
    healthy_threshold: int = 1
    """Consecutive successful checks that put a replica (back) into rotation."""
    graceful_shutdown_s: float = 30.0
    """On SIGTERM/SIGINT, how long in-flight requests may run before being cut."""
    discover: str | None = None
    """`dns://NAME:PORT`: find replicas as the A records of NAME (e.g. a Kubernetes
    headless Service), re-resolved every `discover_interval_s`; a replica joins or
    leaves the pool as its address appears or disappears. `dpserve router` only."""
    discover_interval_s: float = 5.0
    """Period of re-resolving `discover`'s name."""
    otlp_traces_endpoint: str | None = None
    """OTLP/HTTP endpoint for traces (e.g. `http://collector:4318/v1/traces`): a span per
    request, its W3C context sent on to the replica; `dpserve serve` starts the engines
    with vLLM's `--otlp-traces-endpoint` too. Unset: the standard
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` if set, else tracing is off."""
    route_around_paused: bool = False
    """Also ask each replica's `/is_paused` (vLLM dev mode) at every health check and
    keep a paused one out of rotation. Set it when several routers share the replicas:
    another router's deploy pauses them without this one knowing."""
    deploy_lock: str | None = None
    """Lock file (on storage every router shares, e.g. the checkpoint volume) that a
    deploy holds while it runs, so only one router deploys at a time."""
    deploy_lock_ttl_s: float = 60.0
    """A deploy lock not renewed for this long is taken to be abandoned (its router
    died) and may be taken over; the holder renews it every third of it."""
    deployed_link: str | None = None
    """Symbolic link pointed at each checkpoint once its deploy succeeds. Engines started
    on it (and a router's `--base-model` naming it) load what is deployed, not the weights
    they first started on, when they are restarted later."""
    log_level: str = "info"
    """Log level of the router and supervisor (debug, info, warning, error)."""
    api_key: str | None = field(default=None, repr=False)
    """Key clients must send as `Authorization: Bearer KEY` on the API paths
    (`/health`, `/ready`, `/metrics` stay open): at least 8 printable characters, no
    spaces. Set it through DPSERVE_API_KEY or `api_key_file`, never on the command
    line, where `ps` would show it."""
    api_key_file: str | None = None
    """File holding API keys, one per line (`#` comments allowed), each at least 8
    characters, e.g. a mounted Kubernetes secret; read at start-up."""
    api_keys: list[str] | None = field(default=None, repr=False)
    """Several accepted keys at once (DPSERVE_API_KEYS, comma-separated; each at least 8
    characters), so keys can be rotated without downtime. After resolution this holds
    every accepted key: `api_key`, these, and the lines of `api_key_file`."""
    admin_key: str | None = field(default=None, repr=False)
    """Key for `/admin/*` (replica list, drain, hot-load), sent as `Authorization:
    Bearer KEY`: at least 16 characters, none of the API keys. From DPSERVE_ADMIN_KEY or
    `admin_key_file`. Without one, `/admin/*` answers loopback clients only."""
    admin_key_file: str | None = None
    """File holding the admin key (its first line, at least 16 characters); read at
    start-up."""
    insecure_admin: bool = False
    """Let a router listening beyond loopback start without an admin key (its `/admin/*`
    then answers loopback clients only). Without this, such a router refuses to start:
    a sidecar proxy or a NAT can make remote clients look local."""
    admin_host: str = "127.0.0.1"
    """Address of the separate admin listener (with `admin_port`)."""
    admin_port: int | None = None
    """Serve `/admin/*` on a listener of its own at `admin_host:admin_port` and nowhere
    else; the API port then answers 404 there."""
    trusted_proxies: list[str] | None = None
    """Addresses or networks (CIDR) of proxies in front of the router whose
    X-Forwarded-For and X-Forwarded-Proto are believed. Unset: none are; the client is
    the connection's peer."""
    max_header_bytes: int = 32 * 1024
    """Largest request line plus headers; a larger request gets 431 and its connection
    is closed."""
    client_header_timeout_s: float = 10.0
    """Time a client has to send a request's line and headers, from its first byte (or,
    on a new connection, from the connection); past it the connection is closed."""
    client_body_timeout_s: float = 30.0
    """Longest wait for the next piece of a request body; past it the request gets 408
    and its connection is closed."""
    keep_alive_timeout_s: float = 5.0
    """An idle keep-alive client connection is closed after this long."""
    max_connections: int = 2048
    """Open client connections; one beyond it gets 503 and is closed at once."""
    max_inflight_body_bytes: int = 256 * 1024 * 1024
    """Request bodies held in memory at once, over all requests (the parsed JSON costs a
    few times more); a request that would pass it gets 503 with Retry-After."""
    max_response_bytes: int = 128 * 1024 * 1024
    """Largest non-streamed response read from a replica; a larger one is answered 502.
    Streams are relayed event by event with no total limit; one event larger than this
    ends the stream with an error event."""
    checkpoint_root: str | None = None
    """Directory every deployed checkpoint must lie in (symbolic links resolved).
    Default: the parent directory of the served model."""
    snapshot_dir: str | None = None
    """Where a deploy copies a checkpoint before validating it; the engines load that
    copy, which only the router writes, so they load exactly the bytes that were
    checked. Default for `dpserve serve`: RUN_DIR/snapshots; `dpserve router` needs it
    (on storage every engine reads) to deploy."""
    enable_lora: bool = False
    """Replicas take LoRA adapters at run time (`dpserve deploy ADAPTER --name NAME`):
    `dpserve serve` starts each with vLLM's `--enable-lora` and run-time adapter loading;
    for `dpserve router` it states that the replicas were started so."""
    max_loras: int = 1
    """Adapters one replica computes with at once (vLLM's `--max-loras`); a request for
    another waits for a slot. Fewer than the adapters in use makes routing matter."""
    lora_affinity: bool = True
    """With `enable_lora`: a request for an adapter prefers replicas where that adapter
    is running (else one with a free slot, else the least work of other adapters),
    within `load_factor` x the average in flight (default 1.5); `policy` chooses among
    them. Off: adapter requests are placed by `policy` alone."""
    max_lora_rank: int = 16
    """Largest adapter rank the replicas accept (vLLM's `--max-lora-rank`; memory is
    reserved for it); a deploy of a higher rank is refused before any replica changes."""
    max_cpu_loras: int | None = None
    """Adapters one replica keeps loaded in host memory (vLLM's `--max-cpu-loras`);
    default: vLLM's (`max_loras`). Every deployed version counts while it serves."""
    loras: list[str] | None = None
    """Adapters deployed at start, `NAME=DIR` each (repeat the flag; DPSERVE_LORAS
    comma-separated), exactly as `dpserve deploy DIR --name NAME` would."""


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """What `dpserve serve` launches: the replicas and the router in front of them."""

    model: str
    """Model directory (holding `config.json`) or Hugging Face id (`ORG/NAME`, fetched by
    vLLM) loaded by every replica; checked before any replica starts."""
    served_model_name: str | None = None
    """Name clients use in `model`; defaults to the model argument."""
    replicas: int | None = None
    """Number of replicas. Default: one per GPU, or 2 CPU replicas without a GPU."""
    gpus: list[int] | None = None
    """GPU indices to use, one replica each. Default: all visible GPUs."""
    cpu_kvcache_gib: float = 1.0
    """KV-cache size per CPU replica (VLLM_CPU_KVCACHE_SPACE), in GiB."""
    cpu_binds: str | None = None
    """Cores of each CPU replica, `|` between replicas, vLLM's id-list syntax within
    one (VLLM_CPU_OMP_THREADS_BIND), e.g. `0-3|4-7`. Default: the cores split evenly."""
    startup_timeout_s: float = 900.0
    """Deadline for a replica's /health to answer after its process starts."""
    restart_backoff_s: float = 1.0
    """First delay before restarting a replica that died; doubles up to the maximum."""
    restart_backoff_max_s: float = 30.0
    """Longest delay between two restarts of the same replica."""
    stop_timeout_s: float = 20.0
    """On shutdown, time a replica gets after SIGTERM before SIGKILL."""
    run_dir: str = "runs"
    """Directory for per-replica logs; each serve gets its own timestamped folder."""
    vllm_args: list[str] = field(default_factory=list)
    """Extra arguments passed to every `vllm serve` (after `--`)."""
    router: RouterConfig = field(default_factory=RouterConfig)


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
    cfg = dataclasses.replace(cfg, api_keys=keys.api_keys, admin_key=keys.admin_key,
                              otlp_traces_endpoint=cfg.otlp_traces_endpoint
                              or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None)
    _validate_router(cfg)
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
    _validate_serve(cfg)
    return cfg


def _validate_router(c: RouterConfig) -> None:
    require(bool(c.host), "router.host", "must not be empty", c.host)
    require(0 <= c.port <= 65535, "router.port", "must be in 0..65535", c.port)
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
    if c.admin_key is not None or c.insecure_admin:
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


def _validate_serve(c: ServeConfig) -> None:
    require(c.router.discover is None, "router.discover",
             "only `dpserve router` discovers replicas; `serve` starts its own", c.router.discover)
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
