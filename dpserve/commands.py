"""The `dpserve` subcommands and their flags (`dpserve.cli` parses with them).

A flag that sets a setting is generated from the setting's field
(`dpserve.config.flags`): its name, type and help come from there, and it has no
default of its own (None), so the environment and the YAML file may still set it;
`dpserve.config.reference.document` adds the setting's default to its help. The
flags that set nothing (`--replica`, `deploy`'s, `demo`'s) are written out here.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, TypeAlias

from dpserve.config import RouterConfig, ServeConfig
from dpserve.config.flags import add_setting_flags

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_commands(sub: Subparsers) -> None:
    for add in (_add_serve, _add_router, _add_deploy, _add_status, _add_top, _add_finetune,
                _add_export_merged, _add_demo, _add_config_reference, _add_build_tiny_model):
        add(sub)


ROUTER_FLAGS = ("host", "port", "workers", "policy", "max_body_bytes", "max_attempts",
                "migration_limit", "migration_max_tokens", "health_interval_s",
                "otlp_traces_endpoint", "graceful_shutdown_s", "log_level", "api_key_file",
                "admin_key_file", "admin_port", "admin_host", "insecure_admin",
                "trusted_proxies", "engine_metrics_need_key", "engine_metrics_cache_s",
                "local_admin_addresses", "checkpoint_root", "snapshot_dir", "tokenizer",
                "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic")
"""The router settings `serve` and `router` take as flags; the others (timeouts, queue,
breaker, ...) come from the environment or the YAML file, and the keys themselves never
from a flag, where `ps` would show them."""
LORA_FLAGS = ("enable_lora", "max_loras", "lora_affinity", "max_lora_rank", "max_cpu_loras",
              "loras")
ROUTER_ONLY_FLAGS = ("discover", "discover_interval_s", "route_around_paused", "deploy_lock",
                     "deployed_link", "peers", "peer_bind", "peer_key_file")
SERVE_FLAGS = ("model", "served_model_name", "replicas", "gpus", "cpu_kvcache_gib",
               "cpu_binds", "startup_timeout_s", "run_dir")

FLAG_OVERRIDES: dict[str, dict[str, Any]] = {
    # The setting also takes `critical`, in any case, from the environment or the file.
    "log_level": {"choices": ("debug", "info", "warning", "error")},
    # Where else a key may come from: the setting's docstring is about the file.
    "api_key_file": {"help": "file with the keys clients may send, one per line, each at "
                             "least 8 characters (or set DPSERVE_API_KEY / DPSERVE_API_KEYS)"},
    "admin_key_file": {"help": "file with the key for /admin/*, at least 16 characters (or "
                               "set DPSERVE_ADMIN_KEY); without one, /admin/* answers "
                               "loopback clients only"},
    "trusted_proxies": {"metavar": "ADDR[,ADDR...]"},
    "local_admin_addresses": {"metavar": "ADDR[,ADDR...]"},
    "checkpoint_root": {"metavar": "DIR"},
    "snapshot_dir": {"metavar": "DIR"},
    "tokenizer": {"metavar": "DIR"},
    "kv_events_endpoint": {"metavar": "tcp://*:PORT"},
    "kv_events_replay_endpoint": {"metavar": "tcp://*:PORT"},
    "loras": {"flags": ("--lora",), "action": "append", "metavar": "NAME=DIR"},
    "discover": {"metavar": "dns://NAME:PORT"},
    "peers": {"flags": ("--peer",), "action": "append", "metavar": "HOST:PORT"},
    "peer_bind": {"metavar": "HOST:PORT"},
    "peer_key_file": {"metavar": "FILE",
                      "help": "file with the key peers sign their reports with, at least 32 "
                              "characters (or set DPSERVE_PEER_KEY)"},
    "deploy_lock": {"metavar": "FILE"},
    "deployed_link": {"metavar": "LINK"},
}
"""Where a flag differs from what its field gives (`dpserve.config.flags`)."""


def _router_flags(p: argparse.ArgumentParser) -> None:
    add_setting_flags(p.add_argument_group("router"), RouterConfig, ROUTER_FLAGS,
                      overrides=FLAG_OVERRIDES)
    add_setting_flags(p.add_argument_group("LoRA adapters"), RouterConfig, LORA_FLAGS,
                      overrides=FLAG_OVERRIDES)
    p.add_argument("--config", help="YAML settings file (flags > env DPSERVE_* > file)")


def _admin_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default=os.environ.get("DPSERVE_ROUTER_URL"),
                   help="router base URL (default $DPSERVE_ROUTER_URL or "
                        "http://127.0.0.1:8000)")
    p.add_argument("--admin-key-file", help="file with the admin key (or DPSERVE_ADMIN_KEY)")


def _add_serve(sub: Subparsers) -> None:
    serve = sub.add_parser(
        "serve", help="start one vLLM replica per GPU (or CPU slice) and the router",
        description="Arguments after `--` are passed to every `vllm serve`.",
    )
    add_setting_flags(serve, ServeConfig, SERVE_FLAGS)
    _router_flags(serve)


def _add_router(sub: Subparsers) -> None:
    router = sub.add_parser("router", help="run the router alone in front of existing replicas")
    router.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="replica base URL, e.g. http://10.0.0.5:8000 (repeat)")
    add_setting_flags(router, RouterConfig, ROUTER_ONLY_FLAGS, overrides=FLAG_OVERRIDES)
    router.add_argument("--base-model", metavar="DIR",
                        help="local model directory the replicas were started on; "
                             "`dpserve deploy` checks checkpoints against it")
    _router_flags(router)


def _add_deploy(sub: Subparsers) -> None:
    deploy = sub.add_parser(
        "deploy", help="hot-load a fine-tuned checkpoint into the running replicas",
        description="Validate a checkpoint against the served model, then reload it into "
                    "the replicas one at a time (drain, pause, reload, canary, resume) "
                    "without failing a request; any failure rolls back.")
    target = deploy.add_mutually_exclusive_group(required=True)
    target.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT_DIR",
                        help="a complete checkpoint, e.g. out/step-000120")
    target.add_argument("--watch", metavar="OUTPUT_DIR",
                        help="deploy each new checkpoint `dpserve finetune` publishes here")
    kind = deploy.add_mutually_exclusive_group()
    kind.add_argument("--name", metavar="NAME",
                      help="CHECKPOINT_DIR is a LoRA adapter: serve it as model NAME beside "
                           "the base (replicas started with --enable-lora); a new version "
                           "of NAME replaces the last once loaded everywhere")
    kind.add_argument("--merge", action="store_true",
                      help="CHECKPOINT_DIR is a LoRA adapter: fold it into full weights "
                           "(beside it, in merged/) and hot-load those")
    deploy.add_argument("--batch", type=int, help="replicas reloaded at once (default 1)")
    deploy.add_argument("--canary-prompt", help="prompt of each replica's canary request")
    deploy.add_argument("--drop-adapters", action="store_true", default=None,
                        help="full weights while LoRA adapters serve: stop serving them "
                             "(they were trained on the weights replaced)")
    deploy.add_argument("--drain-wait-s", type=float,
                        help="let in-flight requests finish (up to S s) before pausing")
    gate = deploy.add_argument_group("quality gate (the first replica updated is scored "
                                     "out of rotation before any other is)")
    gate.add_argument("--eval", metavar="FILE.jsonl",
                      help="eval set in fine-tuning format (a fine-tune's --eval-data), "
                           "inside the checkpoint root; scores go in the deploy record")
    gate.add_argument("--gate-metric", choices=("exact_match", "mean_logprob"),
                      help="what the gate compares (default exact_match; mean_logprob: "
                           "mean log-probability per token of the expected answers)")
    gate.add_argument("--gate-min-score", type=float,
                      help="roll back unless the new version scores at least this")
    gate.add_argument("--gate-vs-current", action="store_true", default=None,
                      help="roll back if the new version scores surely below the current "
                           "one (95%% confidence, paired per example) by more than "
                           "--gate-margin and the spread of repeated runs")
    gate.add_argument("--gate-margin", type=float, help="for --gate-vs-current (default 0)")
    gate.add_argument("--gate-repeats", type=int, metavar="N",
                      help="runs of the eval set on each version (default 2): their spread "
                           "is the score's own noise")
    canary = deploy.add_argument_group(
        "canary traffic (the first replica updated serves a share of requests and is "
        "compared with a baseline, a replica on the current version with its cache reset "
        "alike: TTFT and errors, each with a confidence interval)")
    canary.add_argument("--canary-weight", type=float, metavar="P",
                        help="percent of new requests sent to it, 0 < P < 100")
    canary.add_argument("--canary-duration-s", type=float, metavar="D",
                        help="the window (default 60); a look every D/4 s, closing it at "
                             "the first sure verdict")
    canary.add_argument("--canary-max-duration-s", type=float, metavar="S",
                        help="while unsure, go on up to S s (default 2 x D)")
    canary.add_argument("--canary-max-ttft-ratio", type=float,
                        help="roll back if its TTFT is surely more than this many times its "
                             "baseline's (default 1.5); pass once surely not")
    canary.add_argument("--canary-ttft-slack-ms", type=float, metavar="MS",
                        help="a TTFT this close to its baseline's is never a regression, "
                             "whatever the ratio (default 20)")
    canary.add_argument("--canary-max-error-rate-delta", type=float,
                        help="roll back if its error rate is surely above its baseline's, "
                             "by more than this (default 0.02: two points); pass once "
                             "surely not")
    canary.add_argument("--canary-min-requests", type=int,
                        help="answers each side needs before any verdict (default 30)")
    canary.add_argument("--canary-confidence", type=float, metavar="C",
                        help="the verdict's confidence over the whole window, all looks "
                             "included (default 0.95)")
    canary.add_argument("--canary-inconclusive", choices=("rollback", "promote"),
                        help="what a window still unsure at its end does (default rollback)")
    deploy.add_argument("--no-mixed-versions", action="store_true", default=None,
                        help="no response may begin on the old weights and end on the new: "
                             "pause each replica only once its requests have ended "
                             "(--drain-wait-s, default 600 s), else fail the deploy")
    deploy.add_argument("--interval-s", type=float, default=10.0,
                        help="--watch: seconds between looks at OUTPUT_DIR")
    deploy.add_argument("--max-deploys", type=int, help="--watch: stop after N deploys")
    deploy.add_argument("--timeout-s", type=float, help="--watch: stop after S seconds")
    _admin_client_flags(deploy)


def _add_status(sub: Subparsers) -> None:
    status = sub.add_parser("status", help="replicas, their state, load and weight version")
    _admin_client_flags(status)


def _add_top(sub: Subparsers) -> None:
    top = sub.add_parser("top", help="a live view of the replicas: load, tokens/s, TTFT, "
                                     "prefix-cache hits, GPU or CPU use, and routing on "
                                     "KV events under kv-aware; q quits")
    _admin_client_flags(top)
    top.add_argument("--interval", type=float, default=2.0,
                     help="seconds between refreshes (default 2)")


def _add_finetune(sub: Subparsers) -> None:
    finetune = sub.add_parser(
        "finetune", help="fine-tune the model with PyTorch DDP (one process per GPU)",
        description="Train data-parallel under torch's elastic launcher; checkpoints go to "
                    "OUTPUT/step-NNNNNN/ in Hugging Face layout, ready to serve or deploy.")
    from dpserve.finetune.config import add_arguments

    add_arguments(finetune, launcher=True)


def _add_demo(sub: Subparsers) -> None:
    from dpserve.demo import DEFAULT_STEPS as DEFAULT_DEMO_STEPS

    demo = sub.add_parser(
        "demo", help="serve the tiny model, fine-tune it and hot-deploy the checkpoint",
        description="Serve the built-in tiny model, ask it held-out questions, fine-tune it "
                    "with DDP, deploy the checkpoint under load and ask again; offline.")
    demo.add_argument("--model", default="build/tiny-llama",
                      help="where the tiny model is (built there if missing)")
    demo.add_argument("--replicas", type=int, default=2, help="replicas to serve on")
    demo.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    demo.add_argument("--run-dir", default="runs",
                      help="results go to RUN_DIR/demo-<timestamp>/ (default ./runs)")
    demo.add_argument("--steps", type=int, default=DEFAULT_DEMO_STEPS,
                      help=f"fine-tuning steps (default {DEFAULT_DEMO_STEPS})")
    demo.add_argument("--questions", type=int, default=9,
                      help="held-out questions asked before and after (1-45, default 9)")
    demo.add_argument("--load-duration-s", type=float, default=120.0,
                      help="the most seconds the load test may send; it stops once the "
                           "deploy is done (default 120)")


def _add_config_reference(sub: Subparsers) -> None:
    reference = sub.add_parser(
        "config-reference", help="print the configuration reference (Markdown)",
        description="Every setting, flag and environment variable, generated from the "
                    "config model and this parser; docs/configuration.md holds a copy.")
    mode = reference.add_mutually_exclusive_group()
    mode.add_argument("--write", metavar="FILE", help="replace the reference block in FILE")
    mode.add_argument("--check", metavar="FILE", help="exit 1 if FILE's block is stale")


def _add_export_merged(sub: Subparsers) -> None:
    export = sub.add_parser(
        "export-merged", help="fold a LoRA adapter checkpoint into full weights",
        description="Write base + adapter as an ordinary checkpoint (OUTPUT/step-N) that "
                    "`dpserve deploy` hot-loads.")
    export.add_argument("adapter", metavar="ADAPTER_CKPT", help="e.g. runs/lora/step-000200")
    export.add_argument("output", metavar="OUTPUT", help="directory receiving step-N/")


def _add_build_tiny_model(sub: Subparsers) -> None:
    build = sub.add_parser("build-tiny-model", help="build the tiny test model offline")
    build.add_argument("--output", default="build/tiny-llama", help="directory to build into")
    build.add_argument("--force", action="store_true", help="rebuild even if present")
    build.add_argument("--size", choices=("tiny", "150m"), default="tiny",
                       help="tiny (0.6M parameters, the tests' model) or 150m (benchmarks)")
