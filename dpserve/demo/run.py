"""`dpserve demo`: serve, fine-tune and hot-deploy the built-in tiny model, offline.

1. build the tiny model if needed and start `dpserve serve` (CPU or GPU replicas
   behind the router);
2. ask held-out questions of the bundled dataset (`dpserve.demo_data`): the
   random-weight base model answers nonsense;
3. `dpserve finetune` on the training split, data-parallel (2 ranks), with a
   progress bar;
4. start a bounded load test (`python -m loadtest run`), let it run STEADY_S, then
   `dpserve deploy` the checkpoint (a rolling hot-load, replica by replica) and stop
   the load once the deploy is done; print TTFT during the deploy beside before it;
5. ask the same questions: now answered right; the load test reports no failure;
6. show where the metrics, the admin API and the result files are, stop `serve`
   with SIGTERM and check that every process it started is gone.

Everything the run writes goes to `RUN_DIR/demo-YYYYmmdd-HHMMSS/`. The exit
status is 0 only if every check held.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from dpserve.demo.deploy_window import TtftWindows, ttft_windows
from dpserve.demo.processes import poll, shutdown, stop_group
from dpserve.demo.tiny import DEFAULT_STEPS, printable, serve_command, wait_ready
from dpserve.replicas.launcher import free_port, visible_gpus

PASS_ACCURACY = 0.8
"""Share of held-out questions the fine-tuned model must answer exactly."""

FINETUNE_FLAGS = (
    "--micro-batch-size", "16", "--lr", "3e-3", "--warmup-steps", "20", "--save-every", "0",
    "--log-every", "1", "--seed", "0",
)
ANSWER_TOKENS = 16
STEADY_S = 10.0
"""Seconds of load before the deploy: the steady state its TTFT is compared with."""

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}
_PROGRESS = re.compile(r"^step\s+(\d+)/(\d+)\s+loss\s+(\S+)")


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    model_dir: Path
    replicas: int = 2
    port: int = 0
    run_dir: Path = Path("runs")
    """The demo writes into a new `demo-<timestamp>/` folder here."""
    steps: int = DEFAULT_STEPS
    """Fine-tuning steps (global batch 32 on 2 ranks)."""
    questions: int = 9
    """Held-out questions asked before and after (at most the 45 held out)."""
    load_duration_s: float = 120.0
    """The most the load test may send; it is stopped once the deploy is done (the
    deploy starts STEADY_S after its first answers)."""
    load_rate: float = 8.0
    """Load-test requests per second (Poisson arrivals, at most 8 in flight)."""


@dataclass(frozen=True)
class DeployRun:
    load: dict[str, Any]
    """The load test's result document."""
    deploy_code: int
    """`dpserve deploy`'s exit status."""
    during: int
    """Load-test requests answered while the deploy ran."""
    windows: TtftWindows | None
    """TTFT during the deploy and before it (None: no per-request results)."""


@dataclass(frozen=True)
class Answer:
    question: str
    expected: str
    answer: str
    replica: str

    @property
    def right(self) -> bool:
        return self.answer.strip() == self.expected


def run_demo(options: DemoOptions) -> int:
    from openai import OpenAI

    from dpserve import demo_data
    from dpserve.tinymodel import TINY_MODEL_NAME, build_tiny_model

    for noisy in ("httpx", "httpx2"):  # the openai client logs every request at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    t_start = time.monotonic()
    timings: dict[str, float] = {}
    out = (options.run_dir / time.strftime("demo-%Y%m%d-%H%M%S")).absolute()
    out.mkdir(parents=True)
    model_dir = build_tiny_model(options.model_dir)
    questions = demo_data.load(demo_data.HELDOUT_FILE)[: options.questions]
    env = {**os.environ, **OFFLINE_ENV}
    port = options.port or free_port()
    base = f"http://127.0.0.1:{port}"
    ok = True

    cmd = serve_command(model_dir, replicas=options.replicas, port=port,
                        served_name=TINY_MODEL_NAME, run_dir=out / "serve",
                        checkpoint_root=out)  # the fine-tune writes its checkpoints there
    _section(f"1. serving {model_dir.name} on {options.replicas} replicas")
    print(_shown(f"$ dpserve {' '.join(cmd[3:])}\n  (log: {out / 'serve.log'})"), flush=True)
    with (out / "serve.log").open("wb") as log:
        serve = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
    helpers: list[subprocess.Popen[bytes]] = []
    try:
        with _phase(timings, "serve ready"):
            waited = wait_ready(base, serve, deadline_s=600)
        print(f"{options.replicas} replicas ready after {waited:.0f} s; router on {base}")
        client = OpenAI(base_url=base + "/v1", max_retries=0,
                        api_key=os.environ.get("DPSERVE_API_KEY", "none"))

        _section(f"2. {len(questions)} held-out questions for the base model (greedy)")
        before = _ask(client, TINY_MODEL_NAME, questions)
        _print_answers(before)

        ranks = min(2, len(visible_gpus())) or 2  # one per GPU (at most 2), else 2 on CPU
        _section(f"3. fine-tuning on {demo_data.TRAIN_FILE} (DDP, {ranks} ranks, "
                 f"{options.steps} steps)")
        with _phase(timings, "finetune"):
            checkpoint = _finetune(model_dir, demo_data.path(demo_data.TRAIN_FILE),
                                   out / "finetune", options.steps, ranks, env, helpers)

        _section("4. rolling deploy under load")
        with _phase(timings, "load test + deploy"):
            deployed = _deploy_under_load(
                checkpoint, base, model_dir, TINY_MODEL_NAME, options, out, env, helpers)
        ok &= _report_deploy(deployed, base, out, env)

        _section("5. the same questions for the fine-tuned model")
        after = _ask(client, TINY_MODEL_NAME, questions)
        _print_answers(after)
        ok &= _record_answers(out / "answers.json", checkpoint, before, after) >= PASS_ACCURACY

        _section("6. where things are")
        _print_locations(base, out, checkpoint)
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
        print(f"\ndemo: {exc}", file=sys.stderr, flush=True)
        ok = False
    finally:
        for proc in helpers:  # only left running if something above failed
            stop_group(proc)
        _section("shutting down (SIGTERM)")
        code, leftover = shutdown(serve)
        print(f"dpserve serve exited with code {code}; "
              + (f"processes left: {leftover}" if leftover else "no process left behind"))
    ok &= code == 0 and not leftover
    timings["total"] = time.monotonic() - t_start
    print("\ntimings: " + " · ".join(f"{k} {_fmt(v)}" for k, v in timings.items()))
    print(_shown("demo " + ("passed" if ok else "FAILED") + f"; results in {out}"))
    return 0 if ok else 1


# -- the steps ------------------------------------------------------------------------------


def _report_deploy(run: DeployRun, base: str, out: Path, env: dict[str, str]) -> bool:
    """Print how the load test fared during the deploy and `dpserve status`; whether the
    deploy succeeded with no failed request and some answered while it ran."""
    load_metrics = run.load.get("metrics", {})
    print(_shown(f"load test: {load_metrics.get('completed', '?')} requests succeeded, "
                 f"{load_metrics.get('failed', '?')} failed; {run.during} answered while the "
                 f"deploy ran (full report: {out / 'loadtest.log'})"))
    if run.windows is not None:
        print(run.windows.line())
    status = subprocess.run([sys.executable, "-m", "dpserve", "status", "--router", base],
                            capture_output=True, text=True, env=env, timeout=60)
    print(status.stdout.rstrip())
    return run.deploy_code == 0 and load_metrics.get("failed") == 0 and run.during > 0


def _record_answers(path: Path, checkpoint: Path, before: list[Answer],
                    after: list[Answer]) -> float:
    """Write both sets of answers to `path`; the accuracy after fine-tuning."""
    accuracy = sum(a.right for a in after) / len(after)
    path.write_text(json.dumps({
        "checkpoint": str(checkpoint), "before": [asdict(a) for a in before],
        "after": [asdict(a) for a in after], "accuracy_before":
        sum(a.right for a in before) / len(before), "accuracy_after": accuracy,
    }, indent=2) + "\n")
    return accuracy


def _ask(client: Any, model: str, questions: list[Any]) -> list[Answer]:
    answers = []
    for q in questions:
        raw = client.chat.completions.with_raw_response.create(
            model=model, temperature=0, max_tokens=ANSWER_TOKENS,
            messages=[{"role": "user", "content": q.question}])
        text = raw.parse().choices[0].message.content or ""
        answers.append(Answer(q.question, q.answer, text,
                              raw.headers.get("x-dpserve-replica", "?")))
    return answers


def _print_answers(answers: list[Answer]) -> None:
    width = max(len(a.question) for a in answers)
    for a in answers:
        shown = printable(a.answer.strip())
        shown = shown if len(shown) <= 32 else shown[:31] + "…"
        print(f"  {'✓' if a.right else '✗'} {a.question:<{width}}  → {shown!r:<36} "
              f"(want {a.expected!r}, {a.replica})")
    right = sum(a.right for a in answers)
    print(f"  {right}/{len(answers)} right ({right / len(answers):.0%})", flush=True)


def _finetune(model_dir: Path, data: Path, output: Path, steps: int, ranks: int,
              env: dict[str, str], helpers: list[subprocess.Popen[bytes]]) -> Path:
    """Run `dpserve finetune` on `ranks` processes, drawing its progress lines as a bar."""
    from tqdm import tqdm

    from dpserve.checkpoint import latest_checkpoint

    cmd = [sys.executable, "-m", "dpserve", "finetune", "--model", str(model_dir),
           "--data", str(data), "--output", str(output), "--nproc-per-node", str(ranks),
           "--max-steps", str(steps), *FINETUNE_FLAGS]
    log_path = output.with_suffix(".log")
    print(_shown(f"$ dpserve {' '.join(cmd[3:])}\n  (log: {log_path})"), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    helpers.append(proc)
    assert proc.stdout is not None
    # A bar on a terminal; in a log (CI, a pipe), one of finetune's own lines in ten.
    tty = sys.stdout.isatty()
    with log_path.open("wb") as log, tqdm(total=steps, unit="step", desc="finetune",
                                          file=sys.stdout, dynamic_ncols=True,
                                          disable=not tty) as bar:
        for raw in proc.stdout:
            log.write(raw)
            line = raw.decode(errors="replace").rstrip()
            if m := _PROGRESS.match(line):
                bar.update(int(m[1]) - bar.n)
                bar.set_postfix(loss=m[3], refresh=False)
                if not tty and int(m[1]) % max(1, steps // 10) == 0:
                    print("  " + line, flush=True)
            elif line.startswith(("finetune:", "checkpoint ")):
                bar.write("  " + _shown(line))
    code = proc.wait()
    helpers.remove(proc)
    checkpoint = latest_checkpoint(output)
    if code != 0 or checkpoint is None:
        raise RuntimeError(f"dpserve finetune exited with code {code}; see {log_path}")
    return checkpoint


def _deploy_under_load(checkpoint: Path, base: str, model_dir: Path, model: str,
                       options: DemoOptions, out: Path, env: dict[str, str],
                       helpers: list[subprocess.Popen[bytes]]) -> DeployRun:
    """Load test, steady for STEADY_S, `dpserve deploy`, then the load test stopped (it
    finishes the requests under way): the load spans the whole deploy."""
    load_cmd = [sys.executable, "-m", "loadtest", "run", "--base-url", base, "--model", model,
                "--tokenizer", str(model_dir), "--random-input-len", "32",
                "--random-output-len", "16", "--request-rate", str(options.load_rate),
                "--max-concurrency", "8", "--duration", str(options.load_duration_s),
                "--result-json", str(out / "loadtest.json"), "--save-detailed",
                "--disable-tqdm"]
    load_env = dict(env)
    if key := os.environ.get("DPSERVE_API_KEY"):
        load_env["OPENAI_API_KEY"] = key
    print(_shown(f"$ python -m {' '.join(load_cmd[2:])} &"), flush=True)
    served_before = _completions_served(base)
    with (out / "loadtest.log").open("wb") as log:
        load = subprocess.Popen(load_cmd, stdout=log, stderr=subprocess.STDOUT, env=load_env,
                                start_new_session=True)
    helpers.append(load)
    poll(lambda: load.poll() is not None or _completions_served(base) > served_before, 60,
          "the load test's first answers")
    time.sleep(STEADY_S)  # the steady state the deploy is compared with
    if load.poll() is not None:
        raise RuntimeError(f"the load test ended early; see {out / 'loadtest.log'}")

    cmd = [sys.executable, "-m", "dpserve", "deploy", str(checkpoint), "--router", base]
    print(_shown(f"$ dpserve {' '.join(cmd[3:])}"), flush=True)
    at_deploy, t_deploy = _completions_served(base), time.time()
    deploy = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    t_done = time.time()
    during = _completions_served(base) - at_deploy
    print(("  " + deploy.stdout.rstrip().replace("\n", "\n  ")) if deploy.stdout else "",
          deploy.stderr.rstrip(), sep="\n" if deploy.stderr else "", flush=True)
    spanned = load.poll() is None
    if spanned:
        load.send_signal(signal.SIGINT)  # stop sending; those under way finish
    else:
        print("note: the load test ended before the deploy did; raise --load-duration-s")
    try:
        load.wait(timeout=120)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the load test did not end; see {out / 'loadtest.log'}") from None
    helpers.remove(load)
    result = out / "loadtest.json"
    doc = json.loads(result.read_text()) if result.exists() else {}
    windows = (ttft_windows(doc, t_deploy, t_done, steady_s=STEADY_S)
               if doc.get("requests") else None)
    return DeployRun(doc, deploy.returncode, during, windows)


def _completions_served(base: str) -> int:
    """Completions (the load test's route; the questions are chats) answered so far."""
    text = httpx.get(base + "/metrics", timeout=10).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("dpserve_requests_total{")
                   and 'route="/v1/completions"' in line))


def _print_locations(base: str, out: Path, checkpoint: Path) -> None:
    metrics = httpx.get(base + "/metrics", timeout=10).text
    shown = [ln for ln in metrics.splitlines()
             if ln.startswith(("dpserve_deploys_total{", "dpserve_replica_weight_info{",
                               "dpserve_replicas_ready "))]
    rows = [
        ("OpenAI API", f"{base}/v1  (model list: {base}/v1/models)"),
        ("metrics", f"{base}/metrics  (engines' own: {base}/metrics/engines)"),
        ("admin API", f"{base}/admin/replicas · {base}/admin/deploy  (loopback or admin key)"),
        ("checkpoint", str(checkpoint)),
        ("loss curve", f"{out / 'finetune' / 'loss.csv'} · loss.png"),
        ("load test", f"{out / 'loadtest.json'} · loadtest-latency-cdf.png · loadtest.log"),
        ("answers", str(out / "answers.json")),
        ("logs", f"{out / 'serve.log'} · {out / 'serve'}/*/replica-r*.log · finetune.log"),
    ]
    for name, where in rows:
        print(_shown(f"  {name:<11} {where}"))
    print("  a scrape of /metrics, now:")
    for line in shown:
        print(f"    {line}")
    print(_shown("  (the router stops below; `dpserve serve --model "
                 f"{checkpoint}` serves the checkpoint again)"), flush=True)


# -- output ---------------------------------------------------------------------------------


def _section(title: str) -> None:
    print(f"\n== {title}", flush=True)


@contextlib.contextmanager
def _phase(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        timings[name] = time.monotonic() - start


def _fmt(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def _shown(text: str) -> str:
    """`text` with the paths below the working directory relative to it, as a user
    would type them (the demo runs its commands on absolute paths)."""
    return text.replace(f"{Path.cwd()}{os.sep}", "")
