"""docs/configuration.md is the generated reference, and the generator misses nothing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from dpserve import config_reference
from dpserve.cli import build_parser
from dpserve.config import RouterConfig, ServeConfig
from dpserve.finetune.config import FinetuneConfig

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_hold_the_generated_reference():
    readme = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    block = config_reference.generate(build_parser())
    assert config_reference.replace_block(readme, block) == readme, (
        "docs/configuration.md is stale: run "
        "`dpserve config-reference --write docs/configuration.md`")


def test_every_setting_has_a_row_with_its_variable_and_meaning():
    block = config_reference.generate(build_parser())
    for cls, prefix in ((ServeConfig, ""), (RouterConfig, "router."),
                        (FinetuneConfig, "finetune.")):
        docs = config_reference.field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name == "router":
                continue
            row = next((ln for ln in block.splitlines()
                        if ln.startswith(f"| `{prefix}{f.name}` |")), None)
            assert row is not None, f.name
            assert f"`DPSERVE_{f.name.upper()}`" in row and docs[f.name], f.name


def test_flags_come_from_the_parser():
    block = config_reference.generate(build_parser())
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
