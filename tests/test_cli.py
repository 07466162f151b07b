"""The `dpserve` command line: bad input is one line naming the flag, exit 2, nothing started."""

from __future__ import annotations

import argparse
import re

import pytest

from dpserve.cli import build_parser, main


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


def test_every_flag_of_every_command_has_a_help_line():
    for name, sub in _subcommands().items():
        for action in sub._actions:
            assert action.help and action.help.strip(), (name, action.option_strings)


def test_help_shows_each_default_worth_showing():
    subs = _subcommands()
    assert _help_of(subs["serve"], "--port") == "port of the OpenAI API (default 8000)"
    assert _help_of(subs["serve"], "--policy").endswith("(default prefix-affinity)")
    assert _help_of(subs["serve"], "--startup-timeout-s").endswith("(default 900)")
    assert _help_of(subs["router"], "--max-attempts").endswith("(default 3)")
    assert _help_of(subs["finetune"], "--lr") == "peak learning rate (AdamW) (default 0.0001)"
    assert _help_of(subs["finetune"], "--seed").endswith("(default 0)")
    assert _help_of(subs["finetune"], "--reshard-after-forward").endswith("(default on)")
    assert _help_of(subs["deploy"], "--interval-s").endswith("(default 10)")
    for sub in subs.values():
        for action in sub._actions:
            assert not re.search(r"\(default (None|False|\[\])\)", action.help or "")
    text = subs["serve"].format_help()
    assert "(default 8000)" in text and "(default 900)" in text


def test_the_key_minimums_are_in_the_help():
    serve = _subcommands()["serve"]
    assert "at least 8 characters" in _help_of(serve, "--api-key-file")
    assert "at least 16 characters" in _help_of(serve, "--admin-key-file")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _help_of(parser: argparse.ArgumentParser, flag: str) -> str:
    return " ".join(parser._option_string_actions[flag].help.split())
