"""Every `dpserve` and `python -m loadtest` command the docs show is one the programs
accept: each is parsed by the real argument parser (flags, choices, required
arguments), so a renamed or removed flag fails here, not on a reader's terminal; and
each command is run for real by a test named in `RUN_BY`."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dpserve.cli import build_parser
from loadtest.cli import build_parser as loadtest_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:^|^\$ |\S/|\s--\s)(dpserve|python -m loadtest)\s+(.*)$")


def fenced_blocks(text: str) -> list[str]:
    """The shell blocks (``` bash/sh or none) of a Markdown text, and the `$ ` lines of
    its console blocks (the rest of a console block is output, not commands)."""
    blocks: list[str] = []
    current: list[str] | None = None
    language = ""
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, language = [], line[3:].strip()
            else:
                if language in ("", "bash", "sh", "shell"):
                    blocks.append("\n".join(current))
                elif language == "console":
                    blocks.append(_console_commands(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _console_commands(lines: list[str]) -> str:
    """The `$ ` lines of a console transcript, with their continuation lines."""
    out, continuing = [], False
    for line in lines:
        if line.startswith("$ ") or continuing:
            out.append(line)
            continuing = line.rstrip().endswith("\\")
    return "\n".join(out)


def commands() -> list[tuple[str, str, list[str]]]:
    """(doc, program, argv) for each command line in a shell block of the docs; lines
    with placeholders (`...`, `$(...)`) are left out."""
    found = []
    for doc in DOCS:
        for block in fenced_blocks(doc.read_text(encoding="utf-8")):
            text = re.sub(r"\\\n\s*", " ", block)  # join continued lines
            for line in text.splitlines():
                line = line.split("  #", 1)[0].strip()
                for part in re.split(r"\s(?:&&|\|)\s", line):
                    part = part.strip().removesuffix("&").strip()  # run in the background
                    match = COMMAND.search(part)
                    if match and "$(" not in part and " ... " not in f" {part} ":
                        argv = shlex.split(match.group(2).replace("$KEY", "--admin-key-file=k"))
                        found.append((str(doc.relative_to(ROOT)), match.group(1), argv))
    return found


FOUND = commands()


def test_the_docs_show_commands_at_all():
    assert len(FOUND) >= 10  # the scan works: the README alone shows a dozen


@pytest.mark.parametrize("doc, program, argv", FOUND,
                         ids=[f"{d}:{' '.join(a[:2])}" for d, _, a in FOUND])
def test_a_command_in_the_docs_parses(doc, program, argv):
    vllm_args = argv.index("--") if "--" in argv else None
    if vllm_args is not None:
        argv = argv[:vllm_args]  # after `--`: vLLM's flags, not ours
    parser = build_parser() if program == "dpserve" else loadtest_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `{program} {' '.join(argv)}` does not parse (exit {exc.code})")


RUN_BY = {
    ("dpserve", "serve"): "tests/integration/conftest.py::start_deployment",
    ("dpserve", "router"): "tests/router/test_discovery.py::"
                           "test_dpserve_router_discovers_a_replica_by_resolving_localhost",
    ("dpserve", "finetune"): "tests/finetune/test_train.py::"
                             "test_sigterm_saves_at_the_next_step_and_exits_cleanly",
    ("dpserve", "export-merged"): "tests/integration/test_finetune_serving.py::"
                                  "test_a_merged_lora_adapter_is_served_by_vllm_as_peft_runs_the_adapter",
    ("dpserve", "deploy"): "tests/integration/test_deploy.py::"
                           "test_a_deploy_under_mixed_load_fails_no_request_and_serves_the_checkpoint",
    ("dpserve", "status"): "tests/rollout/test_client.py::"
                           "test_deploy_prints_each_replica_and_exits_0",
    ("dpserve", "demo"): "tests/integration/test_demo.py::"
                         "test_the_demo_fine_tunes_and_deploys_right_answers_without_failing_a_request",
    ("python -m loadtest", "run"): "tests/loadtest/test_cli.py::"
                                   "test_a_run_prints_a_summary_and_writes_results_and_a_plot",
    ("python -m loadtest", "sweep"): "tests/loadtest/test_cli.py::"
                                     "test_a_sweep_writes_one_point_per_rate_and_a_sweep_plot",
}
"""For each command the docs show, the test that runs it for real (a process or the
command's own function), beyond parsing it."""


def test_every_command_the_docs_show_is_run_by_a_named_test():
    shown = {(program, argv[0]) for _, program, argv in FOUND if argv}
    assert not shown - set(RUN_BY), f"commands in the docs that no test runs: {shown - set(RUN_BY)}"
    for where in RUN_BY.values():
        path, name = where.split("::")
        source = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^(async )?def {name}\(", source, re.M), f"{where} does not exist"
