"""A load test from settings to results: reach the server, build the prompts,
send them on schedule, summarize. `run` does one point, `sweep` several."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import aiohttp

from loadtest import datasets
from loadtest.arrivals import arrival_offsets
from loadtest.client import ENDPOINT_PATHS, Payload, RequestRecord, build_body
from loadtest.config import RunConfig
from loadtest.errors import ConfigError, DatasetError, UnreachableError
from loadtest.metrics import Metrics, summarize
from loadtest.runner import LoadPlan, run_load

SweepParameter = Literal["request_rate", "max_concurrency"]


@dataclass(frozen=True, kw_only=True)
class Workload:
    model: str
    payloads: list[Payload]
    tokenizer: datasets.Tokenizer | None


@dataclass(frozen=True, kw_only=True)
class RunResult:
    config: RunConfig
    model: str
    started_at: str
    finished_at: str
    metrics: Metrics
    records: list[RequestRecord]
    time_zero_unix_s: float = 0.0
    """Wall-clock time (Unix seconds) of the run's time zero: each record's
    `scheduled_s`, `start_s` and `end_s` are offsets from it (to line requests up with
    other logs: a deploy, a restart)."""


async def run(config: RunConfig, *, stop: asyncio.Event | None = None) -> RunResult:
    """`stop`, once set, ends the run early: no new request is sent, those under way
    finish and are measured."""
    model = await check_server(config)
    return await measure(config, build_workload(config, model), stop=stop)


async def sweep(config: RunConfig, parameter: SweepParameter,
                values: Sequence[float], *,
                stop: asyncio.Event | None = None) -> list[RunResult]:
    """One run per value of ``parameter``, in order, on the same prompts; `stop` ends
    the point under way early and skips the rest."""
    points = [point_config(config, parameter, v) for v in values]
    model = await check_server(config)
    workload = build_workload(max(points, key=lambda c: c.prompt_count), model)
    results = []
    for point in points:
        results.append(await measure(point, workload, stop=stop))
        if stop is not None and stop.is_set():
            break
    return results


def point_config(config: RunConfig, parameter: SweepParameter, value: float) -> RunConfig:
    if parameter == "max_concurrency":
        return dataclasses.replace(config, max_concurrency=int(value))
    return dataclasses.replace(config, request_rate=float(value))


async def check_server(config: RunConfig) -> str:
    """The model to ask for, after checking that the server answers and serves it (at
    every base URL: the first chooses it when ``config.model`` is unset)."""
    model = await _check_one(config, config.base_url, config.model)
    for other in config.other_base_urls:
        await _check_one(config, other, model)
    return model


async def _check_one(config: RunConfig, base_url: str, model: str | None) -> str:
    url = base_url.rstrip("/") + "/v1/models"
    served: list[str] | None = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, \
                s.get(url, headers=config.headers) as resp:
            if resp.status in (401, 403):
                raise UnreachableError(
                    f"{base_url} refused the request (HTTP {resp.status}): pass the API"
                    " key with --header 'Authorization=Bearer KEY' or OPENAI_API_KEY")
            if resp.status == 200:
                served = [m["id"] for m in (await resp.json())["data"]]
    except aiohttp.ClientConnectorError as exc:
        err = exc.os_error
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise UnreachableError(f"cannot connect to {base_url}: {reason}") from None
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        raise UnreachableError(
            f"{base_url} did not answer GET /v1/models: {type(exc).__name__}"
            f"{': ' + str(exc) if str(exc) else ''}") from None
    if model is None:
        if not served:
            raise ConfigError(f"--model is required: {url} lists no model")
        return served[0]
    if served is not None and model not in served:
        raise UnreachableError(f"{base_url} does not serve model {model!r}"
                               f" (it serves: {', '.join(served) or 'nothing'})")
    return model


def build_workload(config: RunConfig, model: str) -> Workload:
    tokenizer_dir = config.tokenizer or (Path(model) if Path(model).is_dir() else None)
    if tokenizer_dir is None and config.dataset != "jsonl":
        raise DatasetError(f"the {config.dataset} dataset counts tokens with the model's own"
                           " tokenizer: pass --tokenizer DIR (a local directory)")
    tokenizer = datasets.load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    n = config.prompt_count
    if config.dataset == "random":
        assert tokenizer is not None
        prompts = datasets.random_prompts(
            tokenizer, num_prompts=n, input_len=config.random_input_len,
            output_len=config.output_len or config.random_output_len,
            range_ratio=config.random_range_ratio, prefix_len=config.random_prefix_len,
            seed=config.seed)
    elif config.dataset == "sharegpt":
        assert tokenizer is not None and config.dataset_path is not None
        prompts = datasets.sharegpt_prompts(
            config.dataset_path, tokenizer, num_prompts=n, output_len=config.output_len,
            seed=config.seed, shuffle=config.shuffle)
    else:
        assert config.dataset_path is not None
        prompts = datasets.jsonl_prompts(
            config.dataset_path, num_prompts=n, output_len=config.output_len,
            tokenizer=tokenizer, seed=config.seed, shuffle=config.shuffle)
    payloads = [
        Payload(build_body(config.endpoint, model=model, prompt=p.text,
                           max_tokens=p.output_len, stream=config.stream,
                           ignore_eos=config.sends_ignore_eos, extra_body=config.extra_body),
                p.prompt_len, p.output_len)
        for p in prompts]
    return Workload(model=model, payloads=payloads, tokenizer=tokenizer)


async def measure(config: RunConfig, workload: Workload, *,
                  stop: asyncio.Event | None = None) -> RunResult:
    offsets = arrival_offsets(config.request_count, request_rate=config.request_rate,
                              burstiness=config.burstiness, ramp_up=config.ramp_up,
                              seed=config.seed)
    path = ENDPOINT_PATHS[config.endpoint]
    plan = LoadPlan(
        url=config.base_url.rstrip("/") + path,
        other_urls=[u.rstrip("/") + path for u in config.other_base_urls],
        payloads=workload.payloads, offsets=offsets, max_concurrency=config.max_concurrency,
        duration_s=config.duration_s, request_timeout_s=config.request_timeout_s,
        num_warmups=config.num_warmups, stream=config.stream, headers=config.headers,
        request_id_prefix=config.request_id_prefix, progress=config.progress,
        label=_label(config), stop=stop)
    started = _now()
    outcome = await run_load(plan)
    time_zero = time.time() - (time.perf_counter() - outcome.started_perf_s)
    finished = _now()
    if workload.tokenizer is not None:
        for r in outcome.records:
            if r.ok and r.text is not None:  # no usage reported: count the text
                r.output_tokens = len(workload.tokenizer.encode(r.text, add_special_tokens=False))
    metrics = summarize(outcome.records, outcome.duration_s, percentiles=config.percentiles,
                        slos_ms=config.goodput_ms)
    return RunResult(config=config, model=workload.model, started_at=started,
                     time_zero_unix_s=round(time_zero, 4),
                     finished_at=finished, metrics=metrics, records=outcome.records)


def _label(config: RunConfig) -> str:
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    cap = f" c={config.max_concurrency}" if config.max_concurrency else ""
    return f"rate={rate}{cap}"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
