"""The `dpserve` command line: bad input is one line naming the flag, exit 2, nothing started."""

from __future__ import annotations

import pytest

from dpserve.cli import main


@pytest.mark.parametrize("argv, says", [
    (["router", "--replica", "10.0.0.5:8000"], "replica: expected an http(s) URL"),
    (["router"], "replica: give at least one --replica URL, or --discover"),
    (["router", "--replica", "http://r:1", "--host", "0.0.0.0"],
     "router.admin_key: required when /admin listens beyond loopback"),
    (["router", "--replica", "http://r:1", "--trusted-proxies", "10.0.0.0/8,proxy"],
     "router.trusted_proxies: not an address or network, got 'proxy'"),
    (["router", "--replica", "http://r:1", "--admin-port", "0"],
     "router.admin_port: must be in 1..65535"),
    (["serve", "--model", "m", "--replicas", "0"], "replicas: must be >= 1"),
    (["serve", "--model", "m", "--", "--port", "9"], "vllm_args: must not set --host"),
], ids=["url", "no-replica", "exposed-admin", "proxy", "admin-port", "replicas", "vllm-args"])
def test_bad_input_is_one_line_naming_the_setting_and_exit_2(argv, says, capsys, monkeypatch):
    for name in ("DPSERVE_ADMIN_KEY", "DPSERVE_API_KEY", "DPSERVE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err
    assert err.count("\n") == 1 and "Traceback" not in err
