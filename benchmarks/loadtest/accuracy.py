"""How fast and how exact the load-test harness is, beside vLLM's own benchmark client.

Three parts, each printed as a table with ratios against a baseline measured
in the same run:

1. **Ceiling** — the harness on one core (this process, pinned to core 0)
   against the fake OpenAI server (`loadtest.fakes`, its own process, pinned to
   core 1) answering at once with a fixed 4-token stream. Poisson arrivals at
   rising rates, ``--point-seconds`` each, ``--repeats`` times; the quietest
   repeat counts (other processes on the core can only add error). The server
   notes, on the shared monotonic clock, when it wrote each token; the
   harness's **timing error** is how late it timestamped the first token after
   the server wrote it, and its **send lag** how late it sent a request after
   its scheduled time. A rate is *sustained* when every request completed, the
   achieved rate was >= 95% of the offered one, and the timing error stayed
   under 1 ms; the highest such rate is printed for the median, p90 and p99 of
   the error.
2. **Scripted server** — the fake server with a known 200 ms time to first token
   and 20 ms per token; the harness and vLLM's client (``vllm.benchmarks.serve``:
   its parser from ``add_cli_args``, then ``main``), each in a fresh process
   pinned to the other core, on the same random workload and arrival rate, in
   ABBA order (vLLM, harness, harness, vLLM); each number is the median of the runs.
3. **Real vLLM replica** (``--skip-vllm`` to leave out) — one CPU replica of the
   tiny model (its engine bound to core 0); the same 64-in / 64-out random
   workload, 160 prompts at concurrency 16, from both clients, ABBA ``--rounds``
   times, after an unrecorded warm-up run.

    python -m benchmarks.loadtest.accuracy [--model-dir build/tiny-llama] [--parts 1,2,3]
        [--rates 250,500,...] [--point-seconds 2] [--repeats 3] [--rounds 2] [--json OUT]

Servers bind 127.0.0.1 on free ports, run in their own process groups and are
stopped in ``finally``. Numbers from a busy machine say more about the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import uvloop

from benchmarks.common.tools import REPO
from loadtest.arrivals import arrival_offsets
from loadtest.client import Payload, build_body
from loadtest.runner import LoadPlan, run_load

PY = sys.executable
VLLM_BENCH = """
import json, sys
from argparse import ArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = ArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[2:]))
keep = {k: float(v) for k, v in result.items() if isinstance(v, (int, float))}
open(sys.argv[1], "w").write(json.dumps(keep))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cores: set[int]) -> Any:
    usable = os.sched_getaffinity(0)
    return lambda: os.sched_setaffinity(0, cores & usable or usable)


@contextmanager
def server_process(cmd: list[str], url: str, ready_path: str, deadline_s: float,
                   env: dict[str, str] | None = None, cores: set[int] | None = None,
                   log: Path | None = None) -> Iterator[str]:
    out = log.open("wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, **(env or {})}, start_new_session=True,
                            preexec_fn=pinned(cores) if cores else None)
    try:
        wait_ready(url + ready_path, proc, deadline_s, log)
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if proc.poll() is None:
                os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
        if log:
            out.close()  # type: ignore[union-attr]


def wait_ready(url: str, proc: subprocess.Popen[bytes], deadline_s: float,
               log: Path | None) -> None:
    import urllib.request

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} not ready within {deadline_s:.0f} s")


def pct(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else float("nan")


# --- part 1: the ceiling --------------------------------------------------------------------


async def ceiling_point(url: str, rate: float, seconds: float) -> dict[str, float]:
    body = build_body("completions", model="fake-model", prompt="hello", max_tokens=4,
                      stream=True, ignore_eos=True, extra_body={})
    n = max(1, round(rate * seconds))
    async with aiohttp.ClientSession() as s:
        await (await s.post(url + "/timings/reset")).read()
    plan = LoadPlan(url=url + "/v1/completions", payloads=[Payload(body, 1, 4)],
                    offsets=arrival_offsets(n, request_rate=rate, seed=1),
                    request_timeout_s=30, num_warmups=min(n, 100))
    outcome = await run_load(plan)
    async with aiohttp.ClientSession() as s:
        timings = await (await s.get(url + "/timings")).json()
    first, last = [], []
    for r in outcome.records:
        truth = timings.get(r.request_id)
        if r.ok and truth and r.ttft_s is not None and r.latency_s is not None:
            sent = outcome.started_perf_s + r.start_s
            first.append(sent + r.ttft_s - truth["tokens"][0])
            last.append(sent + r.latency_s - truth["tokens"][-1])
    ok = sum(r.ok for r in outcome.records)
    send_lag = [r.start_s - r.scheduled_s for r in outcome.records]
    return {"offered": rate, "sent": len(outcome.records), "ok": ok,
            "achieved": ok / outcome.duration_s,
            "first_p50_ms": 1e3 * pct(first, 50), "first_p90_ms": 1e3 * pct(first, 90),
            "first_p99_ms": 1e3 * pct(first, 99),
            "last_p99_ms": 1e3 * pct(last, 99), "send_p50_ms": 1e3 * pct(send_lag, 50),
            "send_p99_ms": 1e3 * pct(send_lag, 99)}


def scheduler_noise(seconds: float = 2.0) -> dict[str, float]:
    """How late 0.5 ms sleeps wake on this core: the floor under any timing error here."""
    late = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(0.0005)
        late.append(time.perf_counter() - t - 0.0005)
    return {"p50_ms": 1e3 * pct(late, 50), "p90_ms": 1e3 * pct(late, 90),
            "p99_ms": 1e3 * pct(late, 99)}


def sustained(p: dict[str, float], key: str) -> bool:
    return p["ok"] == p["sent"] and p["achieved"] >= 0.95 * p["offered"] and p[key] < 1.0


def part_ceiling(rates: list[float], seconds: float, repeats: int) -> dict[str, Any]:
    port = free_port()
    cmd = [PY, "-m", "loadtest.fakes", "--port", str(port), "--output-tokens", "4",
           "--record-timings"]
    points = []
    with server_process(cmd, f"http://127.0.0.1:{port}", "/v1/models", 30, cores={1}) as url:
        own = os.sched_getaffinity(0)
        pinned({0})()
        try:
            noise = scheduler_noise()
            for rate in rates:
                # Other processes on the core only ever add error: keep the quietest repeat.
                tries = [uvloop.run(ceiling_point(url, rate, seconds)) for _ in range(repeats)]
                point = min(tries, key=lambda p: p["first_p99_ms"])
                points.append(point)
                if point["achieved"] < 0.8 * rate:
                    break  # far past the ceiling; higher rates only take longer
        finally:
            os.sched_setaffinity(0, own)
    print(f"\n1. Harness ceiling: one core, fixed 4-token stream, Poisson arrivals, "
          f"{seconds:g} s per rate, quietest of {repeats}")
    print(f"{'offered':>8}{'achieved':>10}{'ok/sent':>13}  {'token timestamp lag (ms)':^24}"
          f"  {'send lag (ms)':^13}")
    print(f"{'':>8}{'':>10}{'':>13}{'p50':>8}{'p90':>8}{'p99':>8}  {'p50':>6}{'p99':>7}")
    for p in points:
        print(f"{p['offered']:>8.0f}{p['achieved']:>10.0f}{p['ok']:>7.0f}/{p['sent']:<5.0f}"
              f"{p['first_p50_ms']:>8.3f}{p['first_p90_ms']:>8.3f}{p['first_p99_ms']:>8.3f}"
              f"  {p['send_p50_ms']:>6.3f}{p['send_p99_ms']:>7.3f}")
    print(f"Scheduling noise on this core (how late 0.5 ms sleeps wake): p50 "
          f"{noise['p50_ms']:.3f}, p90 {noise['p90_ms']:.3f}, p99 {noise['p99_ms']:.3f} ms")
    for key, what in (("first_p50_ms", "median"), ("first_p90_ms", "p90"),
                      ("first_p99_ms", "p99")):
        best = max((p["offered"] for p in points if sustained(p, key)), default=0.0)
        print(f"-> highest rate sustained (>= 95% achieved) with {what} timing error < 1 ms:"
              f" {best:.0f} req/s")
    return {"scheduler_noise": noise, "points": points}


# --- parts 2 and 3: beside vLLM's client ----------------------------------------------------


def run_harness(url: str, model: str, tokenizer: Path, args: list[str], tmp: Path,
                name: str) -> dict[str, float]:
    out = tmp / f"{name}.json"
    cmd = [PY, "-m", "loadtest", "run", "--base-url", url, "--model", model, "--tokenizer",
           str(tokenizer), "--dataset", "random", "--seed", "0", "--disable-tqdm",
           "--metric-percentiles", "50,99", "--result-json", str(out),
           "--plot-dir", str(tmp / "plots"), *args]
    subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, preexec_fn=pinned({1}))
    m = json.loads(out.read_text())["metrics"]
    return {"completed": m["completed"], "req_s": m["request_throughput"],
            "tok_s": m["output_throughput"], "ttft_p50": m["ttft_ms"]["median"],
            "ttft_p99": m["ttft_ms"]["percentiles"]["p99"], "tpot_p50": m["tpot_ms"]["median"],
            "itl_p50": m["itl_ms"]["median"], "e2el_p50": m["e2el_ms"]["median"]}


def run_vllm_bench(url: str, model: str, tokenizer: Path, args: list[str], tmp: Path,
                   name: str) -> dict[str, float]:
    out = tmp / f"{name}.json"
    cmd = [PY, "-c", VLLM_BENCH, str(out), "--base-url", url, "--model", model,
           "--tokenizer", str(tokenizer), "--dataset-name", "random", "--seed", "0",
           "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", *args]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True,
                          preexec_fn=pinned({1}), env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    if not out.exists():
        raise RuntimeError(f"vLLM's benchmark failed:\n{proc.stdout[-3000:].decode()}")
    r = json.loads(out.read_text())
    return {"completed": r["completed"], "req_s": r["request_throughput"],
            "tok_s": r["output_throughput"], "ttft_p50": r["median_ttft_ms"],
            "ttft_p99": r["p99_ttft_ms"], "tpot_p50": r["median_tpot_ms"],
            "itl_p50": r["median_itl_ms"], "e2el_p50": r["median_e2el_ms"]}


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


def side_by_side(title: str, vllm: dict[str, float], ours: dict[str, float],
                 truth: dict[str, float] | None = None) -> None:
    print(f"\n{title}")
    print(f"{'metric':<22}{'vLLM client':>13}{'harness':>10}{'harness/vLLM':>14}"
          f"{'harness-vLLM':>14}" + (f"{'truth':>8}" if truth else ""))
    names = {"completed": "completed", "req_s": "requests/s", "tok_s": "output tokens/s",
             "ttft_p50": "median TTFT (ms)", "ttft_p99": "p99 TTFT (ms)",
             "tpot_p50": "median TPOT (ms)", "itl_p50": "median ITL (ms)",
             "e2el_p50": "median E2EL (ms)"}
    for key, name in names.items():
        v, o = vllm[key], ours[key]
        t = f"{truth[key]:>8.1f}" if truth and key in truth else ""
        print(f"{name:<22}{v:>13.2f}{o:>10.2f}{o / v if v else float('nan'):>14.4f}"
              f"{o - v:>+14.2f}{t}")


def part_scripted(tokenizer: Path, tmp: Path) -> dict[str, dict[str, float]]:
    port = free_port()
    cmd = [PY, "-m", "loadtest.fakes", "--port", str(port), "--ttft-ms", "200",
           "--itl-ms", "20"]
    workload = ["--random-input-len", "64", "--random-output-len", "32", "--num-prompts",
                "50", "--request-rate", "20"]
    with server_process(cmd, f"http://127.0.0.1:{port}", "/v1/models", 30, cores={0}) as url:
        runs = abba(url, "fake-model", tokenizer, workload, tmp, "scripted")
    vllm, ours = median_of(runs["vllm"]), median_of(runs["harness"])
    side_by_side("2. Scripted server (TTFT 200 ms, 20 ms/token), 50 prompts 64 in / 32 out,"
                 " 20 req/s Poisson, median of 2 runs each (ABBA)", vllm, ours,
                 truth={"ttft_p50": 200.0, "tpot_p50": 20.0, "itl_p50": 20.0})
    return {"vllm": vllm, "harness": ours, "runs": runs}


def abba(url: str, model: str, tokenizer: Path, workload: list[str], tmp: Path,
         name: str, rounds: int = 1) -> dict[str, list[dict[str, float]]]:
    """vLLM's client, the harness, the harness, vLLM's client (``rounds`` times): slow
    drift of the machine hits both alike."""
    runs: dict[str, list[dict[str, float]]] = {"vllm": [], "harness": []}
    for i, who in enumerate(("vllm", "harness", "harness", "vllm") * rounds):
        fn = run_vllm_bench if who == "vllm" else run_harness
        runs[who].append(fn(url, model, tokenizer, workload, tmp, f"{name}-{who}-{i}"))
    return runs


def part_vllm(model_dir: Path, tmp: Path, rounds: int) -> dict[str, Any]:
    port = free_port()
    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "tiny", "--enforce-eager", "--dtype", "float32",
           "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    workload = ["--random-input-len", "64", "--random-output-len", "64", "--num-prompts",
                "160", "--max-concurrency", "16"]
    log = tmp / "vllm.log"
    with server_process(cmd, f"http://127.0.0.1:{port}", "/health", 600, env=env,
                        log=log) as url:
        run_harness(url, "tiny", model_dir, [*workload[:4], "--num-prompts", "32",
                                             "--max-concurrency", "16"], tmp, "warmup")
        runs = abba(url, "tiny", model_dir, workload, tmp, "real", rounds)
    vllm, ours = median_of(runs["vllm"]), median_of(runs["harness"])
    side_by_side("3. Real vLLM CPU replica (tiny model), 160 prompts 64 in / 64 out, "
                 f"concurrency 16, median of {2 * rounds} runs each (ABBA x {rounds})",
                 vllm, ours)
    return {"vllm": vllm, "harness": ours, "runs": runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / "build" / "tiny-llama")
    p.add_argument("--rates", default="250,500,1000,1500,2000,2500,3000,4000,5000")
    p.add_argument("--point-seconds", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3, help="runs per rate in part 1")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds in part 3")
    p.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 1 or 2,3")
    p.add_argument("--skip-vllm", action="store_true", help="leave out part 3")
    p.add_argument("--json", type=Path, help="also write every number here")
    args = p.parse_args()
    if not (args.model_dir / "tokenizer.json").exists():
        print(f"no model in {args.model_dir}: run `dpserve build-tiny-model` first",
              file=sys.stderr)
        return 1
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores, load average {load:.2f}"
          + ("  (busy: numbers will be noisy)" if load > 0.5 else ""))
    results: dict[str, Any] = {}
    parts = {int(x) for x in args.parts.split(",")} - ({3} if args.skip_vllm else set())
    with tempfile.TemporaryDirectory(prefix="loadtest-bench-") as tmp:
        if 1 in parts:
            results["ceiling"] = part_ceiling([float(r) for r in args.rates.split(",")],
                                              args.point_seconds, args.repeats)
        if 2 in parts:
            results["scripted"] = part_scripted(args.model_dir, Path(tmp))
        if 3 in parts:
            results["vllm_replica"] = part_vllm(args.model_dir, Path(tmp), args.rounds)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
