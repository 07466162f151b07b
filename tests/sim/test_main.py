"""`python -m dpserve.sim` prints one URL per replica, serves, and stops on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request

import pytest

from dpserve.sim.__main__ import main


def test_the_command_prints_urls_serves_them_and_stops_on_sigterm(tmp_path):
    config = tmp_path / "sim.yaml"
    config.write_text("model: yaml-model\nmax_num_seqs: 4\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpserve.sim", "--replicas", "2", "--config", str(config),
         "--step-base-s", "0.002"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        urls = [proc.stdout.readline().strip() for _ in range(2)]  # type: ignore[union-attr]
        assert all(u.startswith("http://127.0.0.1:") for u in urls), urls
        for url in urls:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                assert b'"yaml-model"' in resp.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]


@pytest.mark.parametrize(("args", "named"), [(["--max-num-seqs", "0"], "max_num_seqs"),
                                             (["--replicas", "0"], "--replicas")])
def test_bad_settings_exit_2_naming_them(args, named, capsys):
    assert main(args) == 2
    assert named in capsys.readouterr().err
