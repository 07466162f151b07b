"""A setting is one field: its flag, type, choices and help follow from it."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

import pytest

from dpserve.config.flags import add_setting_flags, flag_name


@dataclasses.dataclass(frozen=True, kw_only=True)
class Knobs:
    max_body_bytes: int = 1024
    """Largest body accepted."""
    ratio: float | None = None
    """A fraction, when set."""
    label: str = "a"
    """What it is called: 100% plain."""
    mode: Literal["fast", "slow"] = "fast"
    """How to run."""
    verbose: bool = False
    """Say more."""
    prefetch: bool = True
    """Fetch ahead."""
    hosts: list[str] | None = None
    """Addresses, comma-separated."""


def parser(names: list[str] | None = None, **kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_setting_flags(p, Knobs, names, **kwargs)
    return p


def action(p: argparse.ArgumentParser, dest: str) -> argparse.Action:
    (found,) = [a for a in p._actions if a.dest == dest]
    return found


def test_a_field_gets_a_flag_named_after_it_with_its_docstring_as_help():
    a = action(parser(), "max_body_bytes")
    assert a.option_strings == ["--max-body-bytes"] == [flag_name("max_body_bytes")]
    assert (a.type, a.default, a.help) == (int, None, "largest body accepted")
    assert action(parser(), "label").help == "what it is called: 100%% plain"  # argparse's %


def test_an_optional_number_keeps_its_type_and_a_string_or_list_takes_text():
    assert action(parser(), "ratio").type is float
    assert action(parser(), "label").type is None
    assert parser().parse_args(["--hosts", "a,b"]).hosts == "a,b"  # the CLI splits it


def test_a_literal_gets_its_choices_in_order():
    p = parser()
    assert action(p, "mode").choices == ("fast", "slow")
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "medium"])


def test_a_bool_is_a_switch_with_no_default_of_its_own():
    p = parser()
    verbose, prefetch = action(p, "verbose"), action(p, "prefetch")
    assert isinstance(verbose, argparse._StoreTrueAction) and verbose.default is None
    assert isinstance(prefetch, argparse.BooleanOptionalAction) and prefetch.default is None
    assert prefetch.option_strings == ["--prefetch", "--no-prefetch"]
    assert vars(p.parse_args([])) == dict.fromkeys(
        ("max_body_bytes", "ratio", "label", "mode", "verbose", "prefetch", "hosts"))
    assert p.parse_args(["--verbose", "--no-prefetch"]).prefetch is False


def test_only_the_named_fields_in_their_order_and_overrides_win():
    p = parser(["mode", "hosts", "label"], skip={"label"},
               overrides={"hosts": {"flags": ("--host",), "action": "append",
                                    "metavar": "ADDR"}, "mode": {"help": "short"}})
    assert [a.dest for a in p._actions[1:]] == ["mode", "hosts"]
    assert action(p, "mode").help == "short"
    assert p.parse_args(["--host", "a", "--host", "b"]).hosts == ["a", "b"]


def test_a_name_that_is_no_field_is_refused():
    with pytest.raises(ValueError, match="no field speed"):
        parser(["speed"])
    with pytest.raises(ValueError, match="no field speed"):
        parser(overrides={"speed": {}})


def test_a_field_added_to_the_settings_becomes_a_finetune_flag():
    """`dpserve finetune` and the torchrun entry take every FinetuneConfig field."""
    from dpserve.cli import build_parser
    from dpserve.finetune.config import LAUNCH_ONLY, FinetuneConfig
    from dpserve.finetune.train import build_parser as train_parser

    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction)).choices["finetune"]
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    assert names <= {a.dest for a in sub._actions}
    assert names - LAUNCH_ONLY <= {a.dest for a in train_parser()._actions}
    assert not LAUNCH_ONLY & {a.dest for a in train_parser()._actions}
