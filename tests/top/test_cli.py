"""`dpserve top`'s flags: refused before any screen is drawn when they cannot work."""

from __future__ import annotations

from dpserve.cli import build_parser, main


def test_top_finds_the_router_and_key_as_dpserve_status_does(monkeypatch):
    monkeypatch.setenv("DPSERVE_ROUTER_URL", "http://10.0.0.5:8000")
    ns = build_parser().parse_args(["top"])
    assert (ns.router, ns.admin_key_file, ns.interval) == ("http://10.0.0.5:8000", None, 2.0)


def test_a_bad_interval_or_an_unreadable_key_file_is_one_line_and_status_2(tmp_path, capsys):
    assert main(["top", "--interval", "0"]) == 2
    assert "--interval must be above 0" in capsys.readouterr().err
    assert main(["top", "--admin-key-file", str(tmp_path / "missing")]) == 2
    assert "dpserve top: cannot read the admin key" in capsys.readouterr().err
