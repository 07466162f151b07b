"""The settings of the router and of `dpserve serve`: every one with its type, default
and meaning.

The docstring under each field is its documentation: `--help`, the configuration
reference and the error messages are generated from it (`dpserve.config.reference`).
Values are resolved and checked by `dpserve.config`, which re-exports both classes.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

PolicyName = Literal["auto", "least-outstanding", "round-robin", "session-affinity",
                     "prefix-affinity", "engine-load", "kv-aware"]
POLICIES: tuple[PolicyName, ...] = typing.get_args(PolicyName)
"""The replica selection policies `policy` may name (`dpserve.router.routing.policies`)."""


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How the router listens, routes, checks health and gives up."""

    host: str = "127.0.0.1"
    """Address the OpenAI API listens on. Replicas always stay on loopback."""
    port: int = 8000
    """Port of the OpenAI API."""
    workers: int = 1
    """Processes serving the data plane on the port (SO_REUSEPORT), one core each: the
    first leads (health checks, deploys, admin, metrics) and serves too. More than one
    only where the router, not the engines, is the bottleneck; docs/serving.md."""
    policy: PolicyName = "auto"
    """Replica selection: `auto` (`kv-aware` where the prompts can be tokenized as the
    engines see them: `dpserve serve`, or `dpserve router --tokenizer`; else
    `prefix-affinity`), `prefix-affinity` (prompts starting alike together, the rest
    spread by recent work), `least-outstanding` (fewer in flight of two random replicas),
    `round-robin`, `session-affinity` (X-Session-Id or `user`), `engine-load` (the
    engines' own queue and KV-cache reports) or `kv-aware` (the prefix each engine
    reports it caches, by its KV-cache events, against its own load; prefix affinity
    where events are not published). Why these: docs/serving.md,
    benchmarks/routing/README.md."""
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
    assemble_responses: bool = True
    """Non-streamed completions and chats are asked of the engine as a stream and their
    answer assembled by the router, the same JSON vLLM would send: a stall is then
    caught within `stream_idle_timeout_s`, and a replica lost mid-way is continued
    elsewhere by token replay instead of started over (docs/serving.md)."""
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
    tokenizer: str | None = None
    """`kv-aware`: model directory whose tokenizer and chat template turn each prompt into
    the token ids its engine will see (`sim`: the simulator's). Default for `dpserve
    serve`: the served model; `dpserve router` without it routes by prefix affinity."""
    kv_events_endpoint: str | None = None
    """`kv-aware`: where every replica publishes its KV events, `tcp://*:PORT`, reached on
    each replica's own host; unset: each replica's `GET /kv_event_sources` says."""
    kv_events_replay_endpoint: str | None = None
    """With `kv_events_endpoint`: where every replica replays missed event batches,
    `tcp://*:PORT`; unset: a gap leaves the replica unscored until its cache resets."""
    kv_events_topic: str = "kv"
    """With `kv_events_endpoint`: the topic the replicas publish their events on."""
    peers: list[str] | None = None
    """Other routers in front of the same replicas, as `HOST:PORT` of their `peer_bind`;
    each HOST is resolved to all its addresses (a Kubernetes headless Service of the
    router pods names them all; this router's own reports are ignored). Each router tells
    the others, every 10 ms while something changes, its requests in flight on each
    replica, which `kv-aware` and `engine-load` add to the engines' queue, and under
    `kv-aware` the work it sent lately and the prompts it sent (counted as cached where
    they went until the engine reports them). Needs `peer_key`. `dpserve router` only;
    with several `workers`, the first talks to the peers for all of them."""
    peer_bind: str | None = None
    """`HOST:PORT` where this router publishes its reports to its peers (e.g.
    `0.0.0.0:5560`); unset with `peers` set: this router only listens."""
    peer_key: str | None = field(default=None, repr=False)
    """Key every peer signs its reports with (HMAC-SHA256): at least 32 characters,
    the same on every router. From DPSERVE_PEER_KEY or `peer_key_file`, never on the
    command line. Reports are signed, not encrypted: admit only the routers to the port."""
    peer_key_file: str | None = None
    """File holding `peer_key` (its first line), e.g. a mounted Kubernetes secret."""
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
    `admin_key_file`. Without one, `/admin/*` answers local clients only
    (`local_admin_addresses`)."""
    admin_key_file: str | None = None
    """File holding the admin key (its first line, at least 16 characters); read at
    start-up."""
    insecure_admin: bool = False
    """Let a router listening beyond loopback start without an admin key (its `/admin/*`
    then answers local clients only). Without this, such a router refuses to start:
    a sidecar proxy or a NAT can make remote clients look local."""
    admin_host: str = "127.0.0.1"
    """Address of the separate admin listener (with `admin_port`)."""
    admin_port: int | None = None
    """Serve `/admin/*` on a listener of its own at `admin_host:admin_port` and nowhere
    else; the API port then answers 404 there."""
    trusted_proxies: list[str] | None = None
    """Addresses or networks (CIDR) of proxies in front of the router whose
    X-Forwarded-For and X-Forwarded-Proto are believed. Unset: none are; the client is
    the connection's peer. Setting any requires `admin_key`: a proxy relays remote
    clients, and one on this machine (a sidecar) relays them from a local address."""
    local_admin_addresses: list[str] = field(default_factory=lambda: ["127.0.0.1", "::1"])
    """Client addresses (or loopback networks, CIDR) that count as this machine for
    `/admin/*` when no admin key is set. Only loopback addresses are accepted. Not all
    of 127.0.0.0/8 by default: a proxy on this machine relays from addresses there
    (Istio's sidecar from 127.0.0.6)."""
    engine_metrics_need_key: bool = False
    """`/metrics/engines` (every engine's own vLLM series: load, queues, KV cache, token
    counts) needs an API key or the admin key, as `Authorization: Bearer KEY`
    (Prometheus: `authorization: {credentials_file: ...}`). Off: open like `/metrics`,
    for scrapers without a secret; it tells nothing of any request's content."""
    engine_metrics_cache_s: float = 1.0
    """`/metrics/engines` answers from one fetch of every engine for this long, and
    callers meanwhile share one fetch: its cost to the engines is bounded whoever asks
    how often. Set it near the scrape interval to fetch once per scrape."""
    max_header_bytes: int = 32 * 1024
    """Largest request line plus headers; a larger request gets 431 and its connection
    is closed."""
    client_header_timeout_s: float = 10.0
    """Time a client has to send a request's line and headers, from its first byte (or,
    on a new connection, from the connection); past it the connection is closed."""
    client_body_timeout_s: float = 30.0
    """Longest wait for the next piece of a request body; past it the request gets 408
    and its connection is closed."""
    keep_alive_timeout_s: float = 75.0
    """An idle keep-alive client connection is closed after this long. Longer than the
    idle timeouts of clients and load balancers (60 s is common): a server that closes
    first races with a request just sent, which the client sees reset."""
    max_connections: int = 2048
    """Open client connections; one beyond it takes the place of one idle between
    requests, or, when none is, gets 503 and is closed at once."""
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
    within `load_factor` x the average in flight (1.5 unless set); `policy` chooses
    among them. Off: adapter requests are placed by `policy` alone."""
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
    """GPU indices to use (comma-separated on the command line), one replica each.
    Default: all visible GPUs."""
    cpu_kvcache_gib: float = 1.0
    """KV-cache size per CPU replica (VLLM_CPU_KVCACHE_SPACE), in GiB."""
    cpu_binds: str | None = None
    """Cores of each CPU replica, `|` between replicas, vLLM's id-list syntax within
    one, e.g. `0-3|4-7`: the replica's processes run on those only. Default: the cores
    split evenly."""
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


def effective_policy(c: RouterConfig) -> PolicyName:
    """The policy the router runs: `c.policy`, with `auto` settled by whether prompts can
    be tokenized (`c.tokenizer`; `dpserve serve` sets it to the served model)."""
    if c.policy != "auto":
        return c.policy
    return "kv-aware" if c.tokenizer is not None else "prefix-affinity"
