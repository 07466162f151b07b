"""docs/configuration.md is the generated reference, and the generator misses nothing."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from dpserve.cli import build_parser, reference_sections
from dpserve.config import RouterConfig, ServeConfig
from dpserve.config import reference as config_reference
from dpserve.config.fielddocs import field_docs
from dpserve.finetune.config import FinetuneConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_hold_the_generated_reference():
    readme = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    block = config_reference.generate(build_parser(), reference_sections())
    assert config_reference.replace_block(readme, block) == readme, (
        "docs/configuration.md is stale: run "
        "`dpserve config-reference --write docs/configuration.md`")


def test_every_setting_has_a_row_with_its_variable_and_meaning():
    block = config_reference.generate(build_parser(), reference_sections())
    for cls, prefix in ((ServeConfig, ""), (RouterConfig, "router."),
                        (FinetuneConfig, "finetune.")):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name == "router":
                continue
            row = next((ln for ln in block.splitlines()
                        if ln.startswith(f"| `{prefix}{f.name}` |")), None)
            assert row is not None, f.name
            assert f"`DPSERVE_{f.name.upper()}`" in row and docs[f.name], f.name


def test_flags_come_from_the_parser():
    block = config_reference.generate(build_parser(), reference_sections())
    assert "| `router.port` | `--port` |" in block
    assert "| `finetune.max_steps` | `--max-steps` |" in block
    assert "| `router.api_key` | — |" in block  # a secret never has a flag
    assert "| `dpserve deploy` | `--watch` |" in block


def test_every_dpserve_variable_in_the_sources_is_documented():
    documented = {name for name, _, _ in config_reference.OTHER_ENVIRONMENT}
    for cls in (ServeConfig, RouterConfig, FinetuneConfig):
        documented |= {f"DPSERVE_{f.name.upper()}" for f in dataclasses.fields(cls)}
    sources = [p for folder in ("dpserve", "loadtest", "scripts", "deploy")
               for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".yaml")]
    sources += [ROOT / "Makefile", ROOT / "Dockerfile"]
    used = set()
    for path in sources:
        if path.is_file():
            used |= set(re.findall(r"\bDPSERVE_[A-Z][A-Z0-9_]*", path.read_text(errors="ignore")))
    assert used - documented == set()


def test_replace_block_refuses_a_file_without_markers():
    try:
        config_reference.replace_block("# no reference here\n", "x")
    except ValueError as exc:
        assert "config-reference" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_every_flag_the_reference_names_for_a_command_is_accepted_by_it():
    """A flag in a section's table works with every command in the section's title,
    unless its cell names the commands that take it (`--deploy-lock` is `dpserve
    router`'s only); a flag in "Other flags" works with the command of its row."""
    parsers = _subcommands()
    claimed: list[tuple[str, str]] = []
    commands: list[str] = []
    for line in config_reference.generate(build_parser(), reference_sections()).splitlines():
        if line.startswith("#### "):
            commands = re.findall(r"`dpserve ([\w-]+)`", line)
        elif line.startswith("| `dpserve ") and commands == []:  # "Other flags"
            command, flag = re.match(r"\| `dpserve ([\w-]+)` \| `([^`]+)`", line).groups()
            claimed += [(command, f) for f in flag.split(", ") if f.startswith("-")]
        elif line.startswith("| `") and commands:
            for cell in line.split(" | ")[1].split(", "):
                flag = re.match(r"`(--[\w-]+)`", cell)
                if flag is not None:
                    only = re.findall(r"`dpserve ([\w-]+)`", cell)
                    claimed += [(c, flag.group(1)) for c in only or commands]
    assert ("router", "--deploy-lock") in claimed and ("serve", "--port") in claimed
    assert ("serve", "--deploy-lock") not in claimed
    refused = [(c, f) for c, f in claimed if f not in parsers[c]._option_string_actions]
    assert refused == []


def test_a_flag_only_some_commands_of_a_section_take_is_marked_so():
    block = config_reference.generate(build_parser(), reference_sections())
    assert ("| `router.deploy_lock` | `--deploy-lock` (`dpserve router` only) |" in block)
    assert "| `router.port` | `--port` |" in block  # both commands take it


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)
