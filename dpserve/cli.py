"""The `dpserve` command line: it parses, builds a config, and hands over.

    dpserve serve --model M [--replicas N] [--gpus 0,1] [--port 8000] [-- VLLM ARGS]
    dpserve router --replica URL [--replica URL ...] | --discover dns://NAME:PORT [--base-model DIR]
    dpserve deploy CHECKPOINT_DIR | --watch OUTPUT_DIR [--router URL]
    dpserve status [--router URL]
    dpserve top [--router URL] [--interval S]
    dpserve demo [--model DIR] [--steps N] [--run-dir DIR]
    dpserve build-tiny-model --output DIR
    dpserve config-reference [--write FILE | --check FILE]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import prometheus_client

from dpserve import __version__
from dpserve.commands import add_commands
from dpserve.config import (
    ConfigError,
    RouterConfig,
    ServeConfig,
    build_router_config,
    build_serve_config,
    load_yaml,
)
from dpserve.config.reference import Section, document


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpserve",
        description="Serve a model data-parallel on vLLM replicas behind an OpenAI router.",
    )
    parser.add_argument("--version", action="version", version=f"dpserve {__version__}")
    add_commands(parser.add_subparsers(dest="command", required=True))
    document(parser, reference_sections())  # every flag: a help line, and its default
    return parser


def reference_sections() -> list[Section]:
    """The settings the configuration reference and the flags' help describe."""
    from dpserve.finetune.config import FinetuneConfig  # light: no torch at import

    return [
        Section("`dpserve serve`: replicas", ServeConfig, "", ("serve",),
                "YAML keys at the top level of `--config`."),
        Section("`dpserve serve` and `dpserve router`: the router", RouterConfig, "router.",
                ("serve", "router"), "YAML keys under `router:`."),
        Section("`dpserve finetune`", FinetuneConfig, "finetune.", ("finetune",),
                "YAML keys under `finetune:`, or at the top level of a file of their own. "
                "The same flags work for `torchrun -m dpserve.finetune.train` (except the "
                "launcher's process and rendezvous settings)."),
    ]


def build_parser() -> argparse.ArgumentParser:
    """The `dpserve` argument parser (the configuration reference is generated from it)."""
    return _parser()


def _flags(ns: argparse.Namespace) -> dict[str, Any]:
    flags = {k: v for k, v in vars(ns).items() if v is not None}
    if isinstance(flags.get("gpus"), str):
        try:
            flags["gpus"] = [int(g) for g in flags["gpus"].split(",") if g.strip()]
        except ValueError:
            raise ConfigError(f"gpus: expected comma-separated integers, got {ns.gpus!r}") from None
    for name in ("trusted_proxies", "local_admin_addresses"):
        if isinstance(flags.get(name), str):
            flags[name] = [p.strip() for p in flags[name].split(",") if p.strip()]
    return flags


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    prometheus_client.disable_created_metrics()  # `_created` series double every counter


def _run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop (a faster event loop; the data plane's numbers assume it)."""
    import uvloop

    return uvloop.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    code = _main(argv)
    if argv is None:  # the program itself, not a caller in this process
        _leave_if_heavy(code)
    return code


def _leave_if_heavy(code: int) -> None:
    """End the process now if the command loaded torch: its interpreter teardown (the
    final garbage collection over torch's and transformers' objects) took 2 s here
    after every `dpserve finetune`, with nothing left to do. What a normal exit does
    before it still runs: the atexit handlers (temporary directories, logging), after
    every other thread has ended (if one has not, the normal exit waits for it)."""
    import atexit
    import threading

    if "torch" not in sys.modules or any(
            not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, extra = args[:cut], args[cut + 1:]
    ns = _parser().parse_args(args)
    from dpserve.preflight import PreflightError

    try:
        return _run(ns, extra)
    except ConfigError as exc:
        print(f"dpserve {ns.command}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except PreflightError as exc:  # one line per problem; nothing was started
        for problem in exc.problems:
            print(f"dpserve {ns.command}: {problem}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _merged(adapter: Path) -> Path | None:
    """The full-weight checkpoint of an adapter checkpoint `OUTPUT/step-N`:
    `OUTPUT/merged/step-N`, written now unless `--merge-on-save` already did."""
    from dpserve.checkpoint import CheckpointError, verify_checkpoint
    from dpserve.finetune.lora import LoraError, export_merged
    from dpserve.finetune.state import MERGED_DIR

    adapter = adapter.resolve()
    done = adapter.parent / MERGED_DIR / adapter.name
    try:
        if done.is_dir():
            verify_checkpoint(done)
            print(f"merged checkpoint {done} (already written)", flush=True)
            return done
        merged = export_merged(adapter, adapter.parent / MERGED_DIR)
    except (LoraError, CheckpointError, OSError) as exc:
        print(f"dpserve deploy --merge: {exc}", file=sys.stderr)
        return None
    print(f"merged checkpoint {merged}", flush=True)
    return merged


def _run(ns: argparse.Namespace, extra: list[str]) -> int:
    if ns.command == "config-reference":
        from dpserve.config.reference import run

        return run(build_parser(), reference_sections(), write=ns.write, check=ns.check)
    if ns.command == "top":
        from dpserve.top.app import run_top

        return run_top(ns)
    if ns.command in ("deploy", "status"):
        from dpserve.rollout.client import run_admin_command

        if getattr(ns, "merge", False):
            if ns.checkpoint is None:
                raise ConfigError("merge: give an adapter CHECKPOINT_DIR, not --watch")
            merged = _merged(Path(ns.checkpoint))
            if merged is None:
                return 2
            ns.checkpoint = str(merged)
        return run_admin_command(ns)

    if ns.command == "build-tiny-model":
        from dpserve.tinymodel import build_tiny_model

        print(build_tiny_model(Path(ns.output), force=ns.force, size=ns.size))
        return 0
    if ns.command == "demo":
        from dpserve.demo.run import DemoOptions, run_demo

        _setup_logging("warning")
        if not 1 <= ns.questions <= 45:
            raise ConfigError(f"questions: must be in 1..45, got {ns.questions}")
        return run_demo(DemoOptions(
            model_dir=Path(ns.model), replicas=ns.replicas, port=ns.port,
            run_dir=Path(ns.run_dir), steps=ns.steps, questions=ns.questions,
            load_duration_s=ns.load_duration_s))

    if ns.command == "export-merged":
        from dpserve.checkpoint import CheckpointError
        from dpserve.finetune.lora import LoraError, export_merged

        try:
            print(export_merged(Path(ns.adapter), Path(ns.output)))
        except (LoraError, CheckpointError, OSError) as exc:
            print(f"dpserve export-merged: {exc}", file=sys.stderr)
            return 2
        return 0

    if ns.command == "finetune":
        from dpserve.finetune.config import build_finetune_config, given_settings
        from dpserve.finetune.launch import run_finetune

        if ns.plan:
            from dpserve.finetune.plan import run_plan

            return run_plan(build_finetune_config(ns, plan_only=True), ns.device_memory_gib,
                            ns.plan_device)
        return run_finetune(build_finetune_config(ns), given_settings(ns))

    # The serving stack (uvicorn, starlette, OpenTelemetry) only now: a machine set up
    # to fine-tune or to build the tiny model needs none of it.
    from dpserve import preflight
    from dpserve.replicas.launcher import usable_cores, visible_gpus

    file_values = load_yaml(ns.config)
    if extra and ns.command != "serve":
        raise ConfigError("arguments after `--` are only accepted by `serve`")
    if ns.command == "router":
        from dpserve.serve import run_router

        for url in ns.replica:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"replica: expected an http(s) URL, got {url!r}")
        cfg = build_router_config(_flags(ns), file_values.get("router") or {})
        if not ns.replica and cfg.discover is None:
            raise ConfigError("replica: give at least one --replica URL, or --discover")
        _setup_logging(cfg.log_level)
        base_model = os.path.expanduser(ns.base_model) if ns.base_model else None
        sockets = preflight.listen_or_refuse(
            preflight.check_router(base_model, tokenizer=cfg.tokenizer), cfg)
        return _run_loop(run_router(cfg, ns.replica, base_model, sockets))

    from dpserve.serve import run_serve

    flags = _flags(ns)
    if extra:
        flags["vllm_args"] = extra
    serve_cfg = build_serve_config(flags, file_values)
    _setup_logging(serve_cfg.router.log_level)
    found = preflight.check_serve(serve_cfg, visible=visible_gpus(), cores=usable_cores())
    sockets = preflight.listen_or_refuse(found, serve_cfg.router)
    return _run_loop(run_serve(serve_cfg, sockets))
