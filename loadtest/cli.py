"""``python -m loadtest run|sweep``: flags, the run, the report, the exit status.

Flag names follow ``vllm bench serve`` where it has one. Exit status: 0 when
every request succeeded, 1 when some failed (the results are still written),
2 when the test could not run (bad flag, unreachable server, unusable
dataset: one line on stderr), 130 on a second Ctrl-C. The first Ctrl-C (or SIGTERM)
stops sending: the requests under way finish and the run is reported as usual.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from loadtest import harness, report
from loadtest.arrivals import RampUp
from loadtest.client import Endpoint
from loadtest.config import DATASETS, RunConfig, parse_goodput, parse_key_values
from loadtest.errors import ConfigError, LoadTestError
from loadtest.harness import RunResult, SweepParameter

T = TypeVar("T")
_ENDPOINTS: dict[str, Endpoint] = {
    "completions": "completions", "/v1/completions": "completions",
    "chat": "chat", "/v1/chat/completions": "chat"}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        if args.command == "run":
            return _run(config)
        parameter: SweepParameter = "request_rate" if args.request_rates else "max_concurrency"
        values = _numbers(args.request_rates or args.max_concurrencies,
                          "--request-rates" if args.request_rates else "--max-concurrencies")
        return _sweep(config, parameter, values)
    except LoadTestError as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loadtest: interrupted", file=sys.stderr)
        return 130


def _run(config: RunConfig) -> int:
    result = _drive(lambda stop: harness.run(config, stop=stop))
    print(report.summary_table(result))
    if config.result_json:
        report.write_json(config.result_json,
                          report.run_document(result, detailed=config.save_detailed))
        print(f"results: {config.result_json}")
    if plot_dir := _plot_dir(config):
        from loadtest import plots

        path = plots.latency_cdfs([result], [""], plot_dir / f"{_stem(config)}-latency-cdf.png")
        print(f"plot: {path}")
    return _status([result])


def _sweep(config: RunConfig, parameter: SweepParameter, values: list[float]) -> int:
    results = _drive(lambda stop: harness.sweep(config, parameter, values, stop=stop))
    for result in results:
        print(report.summary_table(result))
    print(report.sweep_table(results, parameter))
    if config.result_json:
        report.write_json(config.result_json, report.sweep_document(
            results, parameter, values, detailed=config.save_detailed))
        print(f"results: {config.result_json}")
    if plot_dir := _plot_dir(config):
        from loadtest import plots

        stem = _stem(config)
        labels = [f"{'rate' if parameter == 'request_rate' else 'c'}={v:g}" for v in values]
        for path in (plots.latency_cdfs(results, labels, plot_dir / f"{stem}-latency-cdf.png"),
                     plots.sweep_plot(results, parameter, plot_dir / f"{stem}-sweep.png")):
            print(f"plot: {path}")
    return _status(results)


def _status(results: list[RunResult]) -> int:
    """1 if any request failed, saying how many and what the first failure was told."""
    failed = [r for r in results if r.metrics.failed]
    for result in failed:
        print(f"loadtest: {report.failures_line(result.metrics)}", file=sys.stderr)
        first = next((r for r in result.records if not r.ok and r.detail), None)
        if first is not None:
            print(f"loadtest: the first ({first.error}): {first.detail}", file=sys.stderr)
    return 1 if failed else 0


def _drive(run: Callable[[asyncio.Event], Coroutine[Any, Any, T]]) -> T:
    """Run `run(stop)` on uvloop (the client's own overhead is part of what it
    measures). The first SIGINT or SIGTERM sets `stop`: nothing new is sent, the
    requests under way finish and the run is reported as usual; a second one
    interrupts (exit 130, nothing written)."""
    import uvloop

    interrupted = False

    async def main() -> T:
        loop, task, stop = asyncio.get_running_loop(), asyncio.current_task(), asyncio.Event()

        def on_signal() -> None:
            nonlocal interrupted
            if not stop.is_set():
                print("loadtest: stopping: no new requests, waiting for those under way "
                      "(again to abort)", file=sys.stderr, flush=True)
                stop.set()
            elif task is not None:
                interrupted = True
                task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            return await run(stop)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            return runner.run(main())
        except asyncio.CancelledError:
            if interrupted:
                raise KeyboardInterrupt from None
            raise


def _plot_dir(config: RunConfig) -> Path | None:
    if not config.plots:
        return None
    if config.plot_dir:
        return config.plot_dir
    return config.result_json.parent if config.result_json else None


def _stem(config: RunConfig) -> str:
    return config.result_json.stem if config.result_json else "loadtest"


# --- flags ----------------------------------------------------------------------------------


def config_from_args(args: argparse.Namespace) -> RunConfig:
    headers = parse_key_values(args.header or [], "--header")
    if (key := os.environ.get("OPENAI_API_KEY")) and not any(
            h.lower() == "authorization" for h in headers):
        headers["Authorization"] = f"Bearer {key}"
    extra_body = _json_object(args.extra_body, "--extra-body") if args.extra_body else {}
    if args.temperature is not None:
        extra_body["temperature"] = args.temperature
    ramp_up = None
    if args.ramp_up_strategy:
        if args.ramp_up_start_rps is None or args.ramp_up_end_rps is None:
            raise ConfigError("--ramp-up-strategy needs --ramp-up-start-rps and"
                              " --ramp-up-end-rps")
        ramp_up = RampUp(strategy=args.ramp_up_strategy, start_rps=args.ramp_up_start_rps,
                         end_rps=args.ramp_up_end_rps)
    return RunConfig(
        base_url=args.base_url[0], other_base_urls=tuple(args.base_url[1:]),
        model=args.model, endpoint=_ENDPOINTS[args.endpoint],
        stream=not args.no_stream, dataset=args.dataset, dataset_path=args.dataset_path,
        tokenizer=args.tokenizer, num_prompts=args.num_prompts,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len,
        output_len=args.output_len, seed=args.seed, shuffle=not args.disable_shuffle,
        ignore_eos=True if args.ignore_eos else None,
        request_rate=args.request_rate, burstiness=args.burstiness, ramp_up=ramp_up,
        max_concurrency=args.max_concurrency, duration_s=args.duration,
        num_warmups=args.num_warmups, request_timeout_s=args.request_timeout,
        percentiles=tuple(_numbers(args.metric_percentiles, "--metric-percentiles")),
        goodput_ms=parse_goodput(args.goodput or []), headers=headers, extra_body=extra_body,
        request_id_prefix=args.request_id_prefix, result_json=args.result_json,
        save_detailed=args.save_detailed, plot_dir=args.plot_dir, plots=not args.no_plots,
        metadata=parse_key_values(args.metadata or [], "--metadata"),
        progress=not args.disable_tqdm)


def _numbers(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(math.isnan(v) for v in values):
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {text!r}")
    return values


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: not JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: expected a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    server = common.add_argument_group("server")
    server.add_argument("--base-url", required=True, action="append",
                        help="e.g. http://127.0.0.1:8000; repeated: roots of one service "
                             "(e.g. several routers), sent to in turn")
    server.add_argument("--model", help="model name (default: the first the server lists)")
    server.add_argument("--endpoint", choices=sorted(_ENDPOINTS), default="completions")
    server.add_argument("--no-stream", action="store_true",
                        help="non-streaming requests (no TTFT, TPOT or ITL)")
    server.add_argument("--header", nargs="*", metavar="KEY=VALUE",
                        help="extra request headers (OPENAI_API_KEY sets Authorization)")
    server.add_argument("--extra-body", metavar="JSON", help="merged into every request body")
    server.add_argument("--temperature", type=float)
    server.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                        help="per request, from send to the last byte (default 600)")
    server.add_argument("--request-id-prefix", default="loadtest-")

    data = common.add_argument_group("workload")
    data.add_argument("--dataset", "--dataset-name", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", type=Path, help="the JSONL or ShareGPT JSON file")
    data.add_argument("--tokenizer", type=Path, metavar="DIR",
                      help="the model's tokenizer directory (default: --model if a directory)")
    data.add_argument("--num-prompts", type=int,
                      help="requests to send (default 1000; with --duration, a cap)")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="tokens of one random prefix shared by every prompt")
    data.add_argument("--output-len", type=int, help="output tokens for every request")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--disable-shuffle", action="store_true",
                      help="keep the file's order (jsonl, sharegpt)")
    data.add_argument("--ignore-eos", action="store_true",
                      help="ask for exactly the output length (always on for random)")

    load = common.add_argument_group("arrivals")
    load.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                      help="requests/s (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival times: 1 Poisson, <1 burstier")
    load.add_argument("--ramp-up-strategy", choices=("linear", "exponential"))
    load.add_argument("--ramp-up-start-rps", type=float)
    load.add_argument("--ramp-up-end-rps", type=float)
    load.add_argument("--max-concurrency", type=int, metavar="C")
    load.add_argument("--duration", type=float, metavar="S",
                      help="stop sending new requests after S seconds")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="unrecorded requests sent first")

    out = common.add_argument_group("metrics and output")
    out.add_argument("--metric-percentiles", default="90,95,99", metavar="P,P,...")
    out.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    out.add_argument("--result-json", type=Path, metavar="FILE")
    out.add_argument("--save-detailed", action="store_true",
                     help="add every request's record to the JSON")
    out.add_argument("--plot-dir", type=Path,
                     help="write PNG plots here (default: beside --result-json)")
    out.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    out.add_argument("--metadata", nargs="*", metavar="KEY=VALUE",
                     help="labels stored in the JSON")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    parser = argparse.ArgumentParser(
        prog="python -m loadtest", description="Load test an OpenAI-compatible server.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", parents=[common], help="one load test")
    sweep = sub.add_parser("sweep", parents=[common],
                           help="one load test per request rate or concurrency")
    which = sweep.add_mutually_exclusive_group(required=True)
    which.add_argument("--request-rates", metavar="R,R,...", help="e.g. 1,2,4,8,inf")
    which.add_argument("--max-concurrencies", metavar="C,C,...", help="e.g. 1,4,16")
    return parser
