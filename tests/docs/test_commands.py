"""Every `dpserve` and `python -m loadtest` command the docs show is one the programs
accept: each is parsed by the real argument parser (flags, choices, required
arguments), so a renamed or removed flag fails here, not on a reader's terminal; the
inputs a command names exist (unless the block is an illustration); every shell
block says whether it is run (tests/docs/blocks.py); and each command is run for
real by a test named in `RUN_BY`."""

from __future__ import annotations

import itertools
import re
import shlex

import pytest

from dpserve.cli import build_parser
from loadtest.cli import build_parser as loadtest_parser
from tests.docs.blocks import DOCS, ROOT, Block, all_blocks, blocks, matches

COMMAND = re.compile(r"(?:^|^\$ |\S/|\s--\s)(dpserve|python -m loadtest)\s+(.*)$")
INPUTS = {"dpserve": ("--model", "--data", "--eval-data", "--eval"),
          "python -m loadtest": ("--tokenizer",)}
"""Flags naming a file or directory a command reads (loadtest's `--model` is the
served name)."""
BUILT = "build/tiny-llama"
"""What `make model` builds (the Makefile's MODEL_DIR); tests/docs/test_run.py runs
the blocks with the suite's tiny model there."""


def parsed(block: Block) -> list[tuple[str, list[str]]]:
    """(program, argv) for each `dpserve` / `python -m loadtest` command of the block;
    lines with placeholders (`...`, `$(...)`) are left out."""
    found = []
    for line in block.commands():
        for part in re.split(r"\s(?:&&|\|)\s", line):
            part = part.strip().removesuffix("&").strip()  # run in the background
            match = COMMAND.search(part)
            if match and "$(" not in part and " ... " not in f" {part} ":
                argv = shlex.split(match.group(2).replace("$KEY", "--admin-key-file=k"))
                found.append((match.group(1), argv))
    return found


def commands() -> list[tuple[str, str, list[str]]]:
    """(block, program, argv) for each command of every shell block of the docs."""
    return [(b.where, program, argv) for b in all_blocks() for program, argv in parsed(b)]


BLOCKS = all_blocks()


FOUND = commands()


def test_the_docs_show_commands_at_all():
    assert len(FOUND) >= 10  # the scan works: the README alone shows a dozen
    assert len(BLOCKS) >= 20


def test_every_shell_block_says_whether_it_is_run():
    unmarked = [b.where for b in BLOCKS if b.kind is None]
    assert not unmarked, ("shell blocks without a `<!-- docs: run | checked: why | "
                          f"illustration -->` line above them: {unmarked}")
    assert all(b.reason for b in BLOCKS if b.kind == "checked"), "checked: say why not run"


def test_every_fenced_block_names_its_language():
    """A bare ``` block could hide commands from the checks: outputs are ```text."""
    for doc in DOCS:
        inside = False
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                assert inside or line[3:].strip(), (
                    f"{doc.relative_to(ROOT)}:{n}: ``` without a language")
                inside = not inside


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind in ("run", "checked")],
                         ids=lambda b: b.where)
def test_the_inputs_a_command_names_exist(block: Block):
    """`--data train.jsonl` where the file is dpserve/demo_data/train.jsonl fails here;
    an input that a command before it writes (under `runs/`) is allowed, and the tiny
    model `make model` builds."""
    for program, argv in parsed(block):
        for flag, value in itertools.pairwise(argv):
            if flag in INPUTS[program] and not value.startswith(("runs/", "/", BUILT)):
                assert (ROOT / value).exists(), (
                    f"{block.where}: `{program} {argv[0]} ... {flag} {value}`: "
                    f"no {value} in the repository")


@pytest.mark.parametrize("where, program, argv", FOUND,
                         ids=[f"{w}:{' '.join(a[:2])}" for w, _, a in FOUND])
def test_a_command_in_the_docs_parses(where, program, argv):
    vllm_args = argv.index("--") if "--" in argv else None
    if vllm_args is not None:
        argv = argv[:vllm_args]  # after `--`: vLLM's flags, not ours
    parser = build_parser() if program == "dpserve" else loadtest_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `{program} {' '.join(argv)}` does not parse (exit {exc.code})")


RUN_BY = {
    ("dpserve", "serve"): "tests/integration/conftest.py::start_deployment",
    ("dpserve", "router"): "tests/router/fleet/test_discovery.py::"
                           "test_dpserve_router_discovers_a_replica_by_resolving_localhost",
    ("dpserve", "finetune"): "tests/finetune/test_train.py::"
                             "test_sigterm_saves_at_the_next_step_and_exits_cleanly",
    ("dpserve", "export-merged"): "tests/integration/test_docs_walk.py::"
                                  "test_the_docs_walked_in_order_in_one_directory_with_one_fleet",
    ("dpserve", "deploy"): "tests/integration/test_deploy.py::"
                           "test_a_gated_deploy_under_mixed_load_fails_no_request_and_serves_the_checkpoint",
    ("dpserve", "status"): "tests/rollout/test_client.py::"
                           "test_deploy_prints_each_replica_and_exits_0",
    ("dpserve", "demo"): "tests/integration/test_docs_walk.py::"
                         "test_the_docs_walked_in_order_in_one_directory_with_one_fleet",
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


def test_shown_output_matches_word_for_word_with_its_numbers_free():
    printed = ("noise\n  ddp                       139.72 GiB  does NOT fit\n"
               "  zero1     87.37 GiB  does NOT fit\nstep 10/20 loss 6.4697\n")
    assert matches("ddp   125.74 GiB  does NOT fit\nzero1 73.39 GiB  does NOT fit", printed) == []
    assert matches("zero1 1 GiB does NOT fit\nddp 2 GiB does NOT fit", printed) == [
        "ddp 2 GiB does NOT fit"]  # in order
    assert matches("ddp 139.72 GiB  fits", printed) == ["ddp 139.72 GiB  fits"]  # words count
    assert matches("step 10/20 loss 6.5", printed) == []
    assert matches("step 10/20 loss", printed) == ["step 10/20 loss"]  # whole lines


def test_shown_output_matches_with_digests_and_cuts_free():
    printed = ("deploy 20261129-090112-03bc: runs/ft/step-000020\n"
               "succeeded in 0.2 s: step-000020@0e9d7c11 is deployed\n"
               '{"id":"chatcmpl-1","model":"support","choices":[{"content":"four five eight"}]}\n')
    assert matches("deploy 20261129-082742-1f7a: runs/ft/step-000020\n"
                   "succeeded in 0.3 s: step-000020@b5ff1223 is deployed\n"
                   '{… "model":"support",…"content":"four five eight"…', printed) == []
    assert matches("succeeded in 0.3 s: step-000020@b5ff1223 is rolled back",
                   printed) == ["succeeded in 0.3 s: step-000020@b5ff1223 is rolled back"]
    assert matches('{… "content":"four five nine"…', printed) == [
        '{… "content":"four five nine"…']  # the words outside the cuts still count
    assert matches("total 2469 examples", "total 2,470 examples") == []
    assert matches("$ dpserve serve --model m \\\n    --port 1 -- --enforce-eager",
                   "$ dpserve serve --model m --port 8 -- --enforce-eager") == []


def test_every_shown_output_follows_a_block_that_is_run(tmp_path):
    for doc in DOCS:  # blocks() refuses an output marker after anything else
        blocks(doc)
    stray = tmp_path / "stray.md"
    stray.write_text("Some prose.\n\n<!-- docs: output -->\n```text\nhello\n```\n")
    with pytest.raises(ValueError, match="follows no run block"):
        blocks(stray)
