"""The `dpserve` command line: bad input is one line naming the flag, exit 2, nothing started."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time

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


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if `serve` or `router` got as far as starting anything."""
    def started(*args, **kwargs):
        raise AssertionError("the command started although a check failed")

    monkeypatch.setattr("dpserve.serve.run_serve", started)
    monkeypatch.setattr("dpserve.serve.run_router", started)
    for name in ("DPSERVE_ADMIN_KEY", "DPSERVE_API_KEY", "DPSERVE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_serve_refuses_a_model_path_that_is_not_there_before_starting_anything(
        nothing_starts, capsys):
    assert main(["serve", "--model", "/no/such/dir"]) == 2
    assert capsys.readouterr().err == "dpserve serve: --model /no/such/dir: no such directory\n"


def test_serve_names_every_problem_at_once_one_line_each(nothing_starts, busy_port, tmp_path,
                                                         capsys):
    assert main(["serve", "--model", str(tmp_path), "--port", str(busy_port)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dpserve serve: --model {tmp_path}: no config.json in it (not a Hugging Face "
        "model directory)",
        f"dpserve serve: --port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: Address "
        "already in use (another process listens there; pick another port, or 0 for a free "
        "one)",
    ]


def test_a_busy_admin_port_is_named_as_such(nothing_starts, busy_port, tiny_model, capsys):
    assert main(["serve", "--model", str(tiny_model), "--port", "0",
                 "--admin-port", str(busy_port)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"dpserve serve: --admin-port {busy_port}: cannot listen on")


def test_router_checks_its_base_model_and_port_before_starting(nothing_starts, busy_port,
                                                               tmp_path, capsys):
    assert main(["router", "--replica", "http://r:1", "--port", str(busy_port),
                 "--base-model", str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"dpserve router: --base-model {tmp_path / 'model'}: no such directory"
    assert err[1].startswith(f"dpserve router: --port {busy_port}: cannot listen")
    assert len(err) == 2


def test_router_checks_its_tokenizer_before_starting(nothing_starts, tmp_path, capsys):
    assert main(["router", "--replica", "http://r:1", "--port", "0", "--policy", "kv-aware",
                 "--tokenizer", str(tmp_path / "tok")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dpserve router: --tokenizer {tmp_path / 'tok'}: no such directory"]


def test_gpus_that_are_not_there_are_refused(nothing_starts, tiny_model, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert main(["serve", "--model", str(tiny_model), "--gpus", "1,2", "--port", "0"]) == 2
    assert capsys.readouterr().err == ("dpserve serve: --gpus 1,2: no GPU 2 here "
                                       "(visible: 0,1)\n")


def test_a_short_api_key_is_refused_naming_where_it_came_from(nothing_starts, tiny_model,
                                                             tmp_path, capsys):
    keys = tmp_path / "keys"
    keys.write_text("# clients\nlong-enough-key\nshort\n")
    assert main(["serve", "--model", str(tiny_model), "--api-key-file", str(keys)]) == 2
    err = capsys.readouterr().err
    assert err == ("dpserve serve: invalid configuration: router.api_key: must be at least 8 "
                   f"characters (the key from line 3 of {keys}), got '<hidden>'\n")


def test_the_real_entry_point_refuses_a_missing_model_in_a_moment(tmp_path):
    """The case a new user meets first: without the check, both replicas started and
    48 s later vLLM printed a 40-line traceback."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "dpserve", "serve", "--model", "/no/such/dir",
         "--run-dir", str(tmp_path / "runs"), "--port", "0"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == "dpserve serve: --model /no/such/dir: no such directory\n"
    assert not (tmp_path / "runs").exists()  # no replica was given a log
    assert time.monotonic() - started < 30


def test_every_flag_of_every_command_has_a_help_line():
    for name, sub in _subcommands().items():
        for action in sub._actions:
            assert action.help and action.help.strip(), (name, action.option_strings)


def test_every_flag_of_the_torchrun_entry_has_a_help_line():
    """`torchrun -m dpserve.finetune.train --help` (multi-node runs start it directly)."""
    from dpserve.finetune.train import build_parser

    parser = build_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings
    assert " ".join(parser._option_string_actions["--eval-every"].help.split()) == (
        "steps between two evaluations (and at the end)")


def test_help_shows_each_default_worth_showing():
    subs = _subcommands()
    assert _help_of(subs["serve"], "--port") == "port of the OpenAI API (default 8000)"
    assert _help_of(subs["serve"], "--policy").endswith("(default auto)")
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
