"""`python -m dpserve.sim` prints one URL per replica, serves, and stops on SIGTERM,
in one process or spread over several; bad settings get a one-line error naming them."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from dpserve.sim.__main__ import main
from dpserve.sim.processes import shares


def test_the_command_spreads_replicas_over_processes_and_stops_them_on_sigterm(tmp_path):
    config = tmp_path / "sim.yaml"
    config.write_text("model: yaml-model\nmax_num_seqs: 4\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpserve.sim", "--replicas", "3", "--processes", "2",
         "--config", str(config), "--step-base-s", "0.002", "--kv-events"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        urls = [proc.stdout.readline().strip() for _ in range(3)]  # type: ignore[union-attr]
        assert all(u.startswith("http://127.0.0.1:") for u in urls), urls
        ids = []
        for url in urls:
            request = urllib.request.Request(
                url + "/v1/completions", data=json.dumps({"prompt": "hi", "max_tokens": 1,
                                                         "model": "yaml-model"}).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                ids.append(json.load(resp)["id"])
        assert [i.rsplit("-", 1)[0] for i in ids] == ["cmpl-sim0", "cmpl-sim1", "cmpl-sim2"]
        endpoints = []
        for url in urls:  # every replica publishes on ports of its own
            with urllib.request.urlopen(url + "/kv_event_sources", timeout=10) as resp:
                source = json.load(resp)["0"]
            endpoints += [source["endpoint"], source["replay_endpoint"]]
        assert len(set(endpoints)) == 6
        assert all(e.startswith("tcp://*:") for e in endpoints)  # as vLLM reports a bind
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        for url in urls:  # the child processes are gone too
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]


def test_replicas_are_shared_out_evenly_in_order():
    assert shares(8, 3) == [(0, 3), (3, 3), (6, 2)]
    assert shares(2, 4) == [(0, 1), (1, 1)]


@pytest.mark.parametrize(("args", "named"), [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--replicas", "0"], "--replicas"),
    (["--processes", "0"], "--processes"),
    (["--kv-events-buffer-steps", "0"], "--kv-events-buffer-steps"),
    (["--kv-events-hwm", "-1"], "--kv-events-hwm"),
    (["--kv-events", "--kv-events-port", "65534"], "--kv-events-port"),
    (["--kv-events", "--replicas", "2", "--base-port", "20000", "--kv-events-port", "20001"],
     "--kv-events-port"),
])
def test_bad_settings_exit_2_with_one_line_naming_them(args, named, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1, err
