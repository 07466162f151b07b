"""One load run of ``quality.py``, in a process of its own, through loadtest's API.

    python -m benchmarks.routing.load SPEC.json

SPEC holds ``base_url`` (or ``base_urls``: several routers of one fleet, sent to in
turn), ``dataset_path`` (a JSONL file from
``workloads``), ``num_prompts``, ``request_rate``, ``seed``,
``request_timeout_s``, ``duration_s`` (or null) and ``result_json``. The prompts
are sent in the file's order, each with its ``output_tokens`` as ``max_tokens``
and, when the line has one, its ``user`` in the body (what session affinity keys
on); that per-request field is why this uses ``loadtest.harness.measure`` with
its own payloads rather than ``python -m loadtest run``, whose ``jsonl`` dataset
has no per-line extra fields. Everything else — Poisson arrivals, streaming,
timing, summary, the result document — is the harness's own.

Exit status: 0 when the run completed (failed requests are in the result), 2
when it could not run (the message is on stderr).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import uvloop

from loadtest import harness, report
from loadtest.client import Payload, build_body
from loadtest.config import RunConfig
from loadtest.errors import LoadTestError


def config_from_spec(spec: dict[str, object]) -> RunConfig:
    base_urls = spec.get("base_urls") or [spec["base_url"]]
    assert isinstance(base_urls, list)
    urls = [str(u) for u in base_urls]
    return RunConfig(
        base_url=urls[0], other_base_urls=tuple(urls[1:]), dataset="jsonl",
        dataset_path=Path(str(spec["dataset_path"])), num_prompts=int(spec["num_prompts"]),
        request_rate=float(spec["request_rate"]), seed=int(spec["seed"]), shuffle=False,
        ignore_eos=True, request_timeout_s=float(spec["request_timeout_s"]),
        duration_s=None if spec.get("duration_s") is None else float(spec["duration_s"]),
        result_json=Path(str(spec["result_json"])), plots=False, progress=False,
        metadata={k: str(v) for k, v in dict(spec.get("labels") or {}).items()},
        request_id_prefix="rq-")


def payloads(config: RunConfig, model: str) -> list[Payload]:
    assert config.dataset_path is not None
    out = []
    for line in config.dataset_path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        extra = {"user": row["user"]} if row.get("user") else {}
        body = build_body(config.endpoint, model=model, prompt=row["prompt"],
                          max_tokens=row["output_tokens"], stream=config.stream,
                          ignore_eos=config.sends_ignore_eos, extra_body=extra)
        out.append(Payload(body, row.get("prompt_tokens", 0), row["output_tokens"]))
    return out[: config.request_count]


async def run(config: RunConfig) -> harness.RunResult:
    model = await harness.check_server(config)
    workload = harness.Workload(model=model, payloads=payloads(config, model), tokenizer=None)
    return await harness.measure(config, workload)


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        config = config_from_spec(json.loads(Path(argv[0]).read_text()))
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(run(config))
    except LoadTestError as exc:
        print(f"load: {exc}", file=sys.stderr)
        return 2
    assert config.result_json is not None
    report.write_json(config.result_json, report.run_document(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
