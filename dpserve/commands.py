"""The `dpserve` subcommands and their flags (`dpserve.cli` parses with them).

A flag that sets a setting has no default of its own (None): the environment and
the YAML file may still set it, and `dpserve.config.reference.document` adds the setting's
default to its help.
"""

from __future__ import annotations

import argparse
import os
from typing import TypeAlias

from dpserve.config import POLICIES

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_commands(sub: Subparsers) -> None:
    for add in (_add_serve, _add_router, _add_deploy, _add_status, _add_top, _add_finetune,
                _add_export_merged, _add_demo, _add_config_reference, _add_build_tiny_model):
        add(sub)


def _router_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router")
    g.add_argument("--host", help="address of the OpenAI API (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port of the OpenAI API (default 8000)")
    g.add_argument("--workers", type=int,
                   help="processes serving the data plane on the port, one core each "
                        "(default 1)")
    g.add_argument("--policy", choices=POLICIES, help="replica selection policy")
    g.add_argument("--max-body-bytes", type=int, help="largest accepted request body")
    g.add_argument("--max-attempts", type=int, help="replicas tried per request")
    g.add_argument("--migration-limit", type=int,
                   help="moves of one stream to another replica after its own failed "
                        "mid-stream (default 3; 0: off)")
    g.add_argument("--migration-max-tokens", type=int,
                   help="longest context (prompt + generated tokens) a migration replays")
    g.add_argument("--health-interval-s", type=float, help="active health check period")
    g.add_argument("--otlp-traces-endpoint",
                   help="OTLP/HTTP URL to send traces to (default: "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset: no tracing)")
    g.add_argument("--graceful-shutdown-s", type=float,
                   help="time in-flight requests get on shutdown")
    g.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    g.add_argument("--api-key-file",
                   help="file with the keys clients may send, one per line, each at least "
                        "8 characters (or set DPSERVE_API_KEY / DPSERVE_API_KEYS)")
    g.add_argument("--admin-key-file",
                   help="file with the key for /admin/*, at least 16 characters (or set "
                        "DPSERVE_ADMIN_KEY); without one, /admin/* answers loopback "
                        "clients only")
    g.add_argument("--admin-port", type=int,
                   help="serve /admin/* only on this port, at --admin-host (default: on "
                        "the API port)")
    g.add_argument("--admin-host", help="address of the --admin-port listener")
    g.add_argument("--insecure-admin", action="store_true", default=None,
                   help="allow --host beyond loopback without an admin key (/admin/* "
                        "then trusts loopback clients)")
    g.add_argument("--trusted-proxies", metavar="ADDR[,ADDR...]",
                   help="proxies whose X-Forwarded-For is believed (addresses or CIDRs); "
                        "needs an admin key")
    g.add_argument("--engine-metrics-need-key", action="store_true", default=None,
                   help="/metrics/engines needs an API key or the admin key (default: open)")
    g.add_argument("--engine-metrics-cache-s", type=float,
                   help="/metrics/engines answers from one fetch for this long (default 1)")
    g.add_argument("--local-admin-addresses", metavar="ADDR[,ADDR...]",
                   help="loopback client addresses (or CIDRs) that may call /admin/* "
                        "without an admin key (default 127.0.0.1,::1)")
    g.add_argument("--checkpoint-root", metavar="DIR",
                   help="deploys load checkpoints inside DIR only (default: the served "
                        "model's parent directory)")
    g.add_argument("--snapshot-dir", metavar="DIR",
                   help="where deploys copy checkpoints before checking them; engines load "
                        "the copy (default for serve: RUN_DIR/snapshots)")
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true", default=None,
                      help="replicas take LoRA adapters at run time (serve: starts them so)")
    lora.add_argument("--max-loras", type=int,
                      help="adapters a replica computes with at once (default 1)")
    lora.add_argument("--lora-affinity", action=argparse.BooleanOptionalAction, default=None,
                      help="adapter requests prefer replicas where their adapter is running "
                           "(default on)")
    lora.add_argument("--max-lora-rank", type=int,
                      help="largest adapter rank the replicas accept (default 16)")
    lora.add_argument("--max-cpu-loras", type=int,
                      help="adapters a replica keeps in host memory (default: --max-loras)")
    lora.add_argument("--lora", action="append", dest="loras", metavar="NAME=DIR",
                      help="deploy the adapter checkpoint DIR as NAME at start (repeat)")
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
    serve.add_argument("--model", help="model directory (holding config.json) or Hugging "
                                       "Face id (ORG/NAME, fetched by vLLM)")
    serve.add_argument("--served-model-name",
                       help="name clients put in `model` (default: --model)")
    serve.add_argument("--replicas", type=int,
                       help="number of replicas (default: one per visible GPU, else 2 on CPU)")
    serve.add_argument("--gpus", help="comma-separated GPU indices, one replica each "
                                      "(default: every visible GPU)")
    serve.add_argument("--cpu-kvcache-gib", type=float, help="KV cache per CPU replica")
    serve.add_argument("--cpu-binds", help="cores per CPU replica, e.g. 0-3|4-7 (default: "
                                           "the usable cores split evenly)")
    serve.add_argument("--startup-timeout-s", type=float, help="deadline for a replica to start")
    serve.add_argument("--run-dir", help="where per-replica logs go (default ./runs)")
    _router_flags(serve)


def _add_router(sub: Subparsers) -> None:
    router = sub.add_parser("router", help="run the router alone in front of existing replicas")
    router.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="replica base URL, e.g. http://10.0.0.5:8000 (repeat)")
    router.add_argument("--discover", metavar="dns://NAME:PORT",
                        help="find replicas as the A records of NAME (e.g. a Kubernetes "
                             "headless Service), re-resolved on an interval")
    router.add_argument("--discover-interval-s", type=float,
                        help="seconds between two lookups of --discover's name (default 5)")
    router.add_argument("--route-around-paused", action="store_true", default=None,
                        help="keep replicas that answer /is_paused true out of rotation "
                             "(several routers share the replicas)")
    router.add_argument("--deploy-lock", metavar="FILE",
                        help="lock file on storage shared by every router: one deploy at a "
                             "time across them")
    router.add_argument("--deployed-link", metavar="LINK",
                        help="symlink pointed at each successfully deployed checkpoint, "
                             "for engines restarted later to load")
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
                      help="roll back if the new version scores below the current one by "
                           "more than --gate-margin")
    gate.add_argument("--gate-margin", type=float, help="for --gate-vs-current (default 0)")
    canary = deploy.add_argument_group("canary traffic (the first replica updated serves a "
                                       "share of requests, then is compared with a baseline: "
                                       "the next replica, its cache reset alike)")
    canary.add_argument("--canary-weight", type=float, metavar="P",
                        help="percent of new requests sent to it, 0 < P < 100")
    canary.add_argument("--canary-duration-s", type=float, metavar="D",
                        help="for this long (default 60)")
    canary.add_argument("--canary-max-error-rate-delta", type=float,
                        help="roll back if its error rate exceeds its baseline's by more "
                             "(default 0.01: one point)")
    canary.add_argument("--canary-max-ttft-ratio", type=float,
                        help="roll back if its TTFT p50 or p90 exceeds its baseline's by this "
                             "factor (default 1.5) and by more than --canary-ttft-slack-ms")
    canary.add_argument("--canary-ttft-slack-ms", type=float, metavar="MS",
                        help="a TTFT this close to its baseline's is never a regression, "
                             "whatever the ratio (default 20)")
    canary.add_argument("--canary-min-requests", type=int,
                        help="roll back if it served fewer requests (default 10)")
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
                                     "GPU or CPU use; q quits")
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
