"""`python -m loadtest run|sweep` end to end against the scripted fake server."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from loadtest.cli import main
from loadtest.fakes import Script
from tests.waiting import wait_for_sync

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n"
                            for i in range(10)))
    return path


def run(*argv, plots=False):
    return main(["run", *argv, "--disable-tqdm", *([] if plots else ["--no-plots"])])


def test_a_run_prints_a_summary_and_writes_results_and_a_plot(
        threaded_server, prompts, tmp_path, capsys):
    server = threaded_server(Script(ttft_s=0.02, itl_s=0.002))
    out = tmp_path / "out" / "run.json"
    code = run("--base-url", server.url, "--dataset", "jsonl", "--dataset-path", str(prompts),
               "--output-len", "8", "--num-prompts", "12", "--max-concurrency", "4",
               "--result-json", str(out), "--save-detailed", "--metadata", "build=abc",
               plots=True)
    printed = capsys.readouterr().out
    assert code == 0
    assert "Median TTFT (ms):" in printed and "Successful requests:" in printed
    doc = json.loads(out.read_text())
    assert list(doc) == ["schema", "config", "metadata", "metrics", "requests"]
    assert doc["schema"] == "dpserve-loadtest/1"
    assert doc["config"]["model"] == "fake-model"  # the first model the server lists
    assert doc["config"]["request_rate"] == "inf"
    assert doc["metadata"]["labels"] == {"build": "abc"}
    m = doc["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (12, 0, 96)
    assert m["peak_concurrency"] == 4
    assert set(m["ttft_ms"]) == {"count", "mean", "median", "std", "percentiles"}
    assert set(m["ttft_ms"]["percentiles"]) == {"p90", "p95", "p99"}
    # the scripted 20 ms, not the whole answer (20 + 7 x 2 ms): room for a busy machine
    assert 20 <= m["ttft_ms"]["median"] < 34
    assert len(doc["requests"]) == 12 and doc["requests"][0]["output_tokens"] == 8
    assert (tmp_path / "out" / "run-latency-cdf.png").read_bytes().startswith(PNG)


def test_the_random_dataset_uses_the_models_tokenizer(threaded_server, tokenizer_dir,
                                                      tmp_path):
    server = threaded_server()
    out = tmp_path / "run.json"
    code = run("--base-url", server.url, "--model", "fake-model", "--tokenizer",
               str(tokenizer_dir), "--random-input-len", "32", "--random-output-len", "6",
               "--num-prompts", "5", "--request-rate", "100", "--result-json", str(out),
               "--plot-dir", str(tmp_path / "plots"), plots=True)
    doc = json.loads(out.read_text())
    assert code == 0
    assert doc["config"]["ignore_eos"] is True
    assert doc["metrics"]["total_output_tokens"] == 30
    assert all(b["ignore_eos"] and b["max_tokens"] == 6 for b in server.server.bodies)
    assert (tmp_path / "plots" / "run-latency-cdf.png").exists()


def test_failed_requests_are_counted_and_the_exit_status_says_so(
        threaded_server, prompts, tmp_path, capsys):
    server = threaded_server(Script(faults={1: "error500", 2: "cut", 4: "error500"}))
    out = tmp_path / "run.json"
    code = run("--base-url", server.url, "--dataset", "jsonl", "--dataset-path", str(prompts),
               "--num-prompts", "6", "--max-concurrency", "1", "--output-len", "3",
               "--result-json", str(out))
    assert code == 1
    assert json.loads(out.read_text())["metrics"]["failures"] == {
        "http_500": 2, "incomplete_stream": 1}
    err = capsys.readouterr().err
    assert "3 of 6 requests failed: http_500 2, incomplete_stream 1" in err
    assert "the first (http_500): scripted 500" in err  # what the server said, once


def test_the_per_replica_breakdown_reads_the_routers_header(
        threaded_server, prompts, tmp_path, capsys):
    server = threaded_server(Script(replicas=["r0", "r1"]))
    out = tmp_path / "run.json"
    run("--base-url", server.url, "--dataset", "jsonl", "--dataset-path", str(prompts),
        "--num-prompts", "8", "--output-len", "2", "--result-json", str(out))
    per = json.loads(out.read_text())["metrics"]["per_replica"]
    assert {rid: (r["completed"], r["share"]) for rid, r in per.items()} == {
        "r0": (4, 0.5), "r1": (4, 0.5)}
    assert "Per replica" in capsys.readouterr().out


def test_a_repeated_base_url_sends_to_each_in_turn(threaded_server, prompts, tmp_path):
    a, b = threaded_server(Script()), threaded_server(Script())
    out = tmp_path / "run.json"
    assert run("--base-url", a.url, "--base-url", b.url, "--dataset", "jsonl",
               "--dataset-path", str(prompts), "--num-prompts", "5", "--output-len", "2",
               "--result-json", str(out)) == 0
    assert (a.server.received, b.server.received) == (3, 2)
    config = json.loads(out.read_text())["config"]
    assert (config["base_url"], config["other_base_urls"]) == (a.url, [b.url])


def test_goodput_counts_requests_within_the_slos(threaded_server, prompts, tmp_path):
    server = threaded_server(Script(ttft_s=0.03, itl_s=0.001))
    results = {}
    for slo in ("10", "500"):
        out = tmp_path / f"{slo}.json"
        run("--base-url", server.url, "--dataset", "jsonl", "--dataset-path", str(prompts),
            "--num-prompts", "4", "--output-len", "2", "--goodput", f"ttft:{slo}", "e2el:9000",
            "--result-json", str(out))
        results[slo] = json.loads(out.read_text())["metrics"]["good_requests"]
    assert results == {"10": 0, "500": 4}


def test_a_sweep_writes_one_point_per_rate_and_a_sweep_plot(threaded_server, prompts,
                                                            tmp_path, capsys):
    server = threaded_server(Script(ttft_s=0.2, itl_s=0.001))
    out = tmp_path / "sweep.json"
    code = main(["sweep", "--base-url", server.url, "--dataset", "jsonl", "--dataset-path",
                 str(prompts), "--num-prompts", "6", "--output-len", "2",
                 "--request-rates", "50,200,inf", "--result-json", str(out), "--disable-tqdm"])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "dpserve-loadtest-sweep/1"
    assert doc["sweep"] == {"parameter": "request_rate", "values": [50.0, 200.0, "inf"]}
    assert [p["config"]["request_rate"] for p in doc["points"]] == [50.0, 200.0, "inf"]
    assert all(p["metrics"]["completed"] == 6 for p in doc["points"])
    assert (tmp_path / "sweep-sweep.png").read_bytes().startswith(PNG)
    assert (tmp_path / "sweep-latency-cdf.png").read_bytes().startswith(PNG)
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["rate", "ok", "fail"])
    assert [line.split()[0] for line in lines[header + 1:header + 4]] == ["50.00", "200.00", "inf"]
    # 6 requests sent in ~0.03 s, answered 0.2 s later: the point is mostly drain, said so
    notes = [line for line in lines[header + 4:] if line.startswith("note: ")]
    assert any(n.startswith("note: at 200.00 req/s the 6 requests were sent over ")
               and "--num-prompts" in n for n in notes), notes
    assert any(n.startswith("note: inf sends all 6 requests at once") for n in notes), notes


def test_a_concurrency_sweep(threaded_server, prompts, tmp_path):
    server = threaded_server(Script(ttft_s=0.01))
    out = tmp_path / "sweep.json"
    main(["sweep", "--base-url", server.url, "--dataset", "jsonl", "--dataset-path",
          str(prompts), "--num-prompts", "6", "--output-len", "2", "--max-concurrencies",
          "1,3", "--result-json", str(out), "--disable-tqdm", "--no-plots"])
    points = json.loads(out.read_text())["points"]
    assert [p["metrics"]["peak_concurrency"] for p in points] == [1, 3]


def one_error_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_an_unreachable_url_is_one_clear_line(capsys):
    code = run("--base-url", "http://127.0.0.1:1", "--model", "m", "--dataset", "jsonl",
               "--dataset-path", "unused.jsonl")
    assert code == 2
    assert one_error_line(capsys) == (
        "loadtest: error: cannot connect to http://127.0.0.1:1: Connection refused")


def test_a_model_the_server_does_not_serve_is_a_clear_error(threaded_server, prompts, capsys):
    server = threaded_server()
    code = run("--base-url", server.url, "--model", "other", "--dataset", "jsonl",
               "--dataset-path", str(prompts))
    assert code == 2
    assert "does not serve model 'other' (it serves: fake-model)" in one_error_line(capsys)


def test_the_random_dataset_without_a_tokenizer_is_a_clear_error(threaded_server, capsys):
    server = threaded_server()
    assert run("--base-url", server.url) == 2
    assert "pass --tokenizer DIR" in one_error_line(capsys)


@pytest.mark.parametrize(("flags", "message"), [
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--goodput", "ttft=5"], "--goodput: expected METRIC:MILLISECONDS"),
    (["--goodput", "itl:5"], "--goodput metrics are"),
    (["--dataset", "jsonl"], "--dataset-path is required with --dataset jsonl"),
    (["--duration", "5"], "--duration needs --request-rate or --max-concurrency"),
    (["--header", "novalue"], "--header: expected KEY=VALUE"),
])
def test_a_bad_setting_names_its_flag(capsys, flags, message):
    assert run("--base-url", "http://127.0.0.1:1", *flags) == 2
    assert message in one_error_line(capsys)


@pytest.mark.parametrize(("flags", "timed"), [
    (["--endpoint", "chat"], True),
    (["--no-stream"], False),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "50", "--ramp-up-end-rps", "200"],
     True),
    (["--request-rate", "100", "--burstiness", "0.5", "--num-warmups", "2"], True),
])
def test_other_endpoints_and_arrival_shapes(threaded_server, prompts, tmp_path, flags, timed):
    server = threaded_server(Script(ttft_s=0.005, itl_s=0.001))
    out = tmp_path / "run.json"
    code = run("--base-url", server.url, "--dataset", "jsonl", "--dataset-path", str(prompts),
               "--num-prompts", "5", "--output-len", "3", "--result-json", str(out), *flags)
    m = json.loads(out.read_text())["metrics"]
    assert (code, m["completed"], m["total_output_tokens"]) == (0, 5, 15)
    assert (m["ttft_ms"]["count"] == 5) is timed


def _start_cli(url: str, prompts, out) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "loadtest", "run", "--base-url", url, "--dataset", "jsonl",
         "--dataset-path", str(prompts), "--output-len", "4", "--request-rate", "20",
         "--duration", "120", "--result-json", str(out), "--save-detailed", "--no-plots",
         "--disable-tqdm"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_first_interrupt_stops_sending_and_reports_what_was_sent(threaded_server, prompts,
                                                                   tmp_path):
    server = threaded_server(Script(ttft_s=0.3, itl_s=0.01))
    out = tmp_path / "run.json"
    proc = _start_cli(server.url, prompts, out)
    try:
        wait_for_sync(lambda: server.server.received >= 10, "ten requests sent")
        signalled = time.time()
        proc.send_signal(signal.SIGINT)
        printed, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, printed
    assert "stopping: no new requests" in printed and "Successful requests:" in printed
    doc = json.loads(out.read_text())
    m, zero = doc["metrics"], doc["metadata"]["time_zero_unix_s"]
    # every request sent before the signal, and each one answered in full
    assert m["failed"] == 0 and m["completed"] == len(doc["requests"]) >= 10
    assert max(zero + r["start_s"] for r in doc["requests"]) < signalled + 0.2
    assert all(r["output_tokens"] == 4 for r in doc["requests"])


def test_a_second_interrupt_aborts_without_results(threaded_server, prompts, tmp_path):
    server = threaded_server(Script(ttft_s=60))  # answers nothing for a minute
    out = tmp_path / "run.json"
    proc = _start_cli(server.url, prompts, out)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for_sync(lambda: server.server.received >= 2, "two requests sent")
        proc.send_signal(signal.SIGINT)
        wait_for_sync(lambda: any("stopping" in ln for ln in lines), "the first interrupt")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    reader.join(timeout=10)
    assert "loadtest: interrupted" in "".join(lines) and not out.exists()
