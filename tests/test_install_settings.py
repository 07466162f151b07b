"""scripts/pip_settings.py: uv must find the packages pip would (the machine's wheel
folder, indexes and constraints), whatever sections set them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "pip_settings.py"
spec = importlib.util.spec_from_file_location("pip_settings", SCRIPT)
assert spec is not None and spec.loader is not None
pip_settings = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pip_settings)


def test_the_variables_win_over_the_files_and_each_url_is_its_own_value():
    listing = "\n".join([
        "global.index-url='https://files.example/simple'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        ":env:.index-url='https://env.example/simple'",
        "install.find-links='/opt/wheels'",
        "global.find-links='/elsewhere'",
        "global.constraint='/etc/pip/constraints.txt'",
        "global.cert='/etc/ssl/certs/ca.crt'",  # not a package source: left to uv's own
        ":env:.default-timeout='180'",
        "malformed line without a section",
    ])
    assert pip_settings.settings(listing) == {
        "index-url": ["https://env.example/simple"],
        "extra-index-url": ["file:///opt/a/simple", "file:///opt/b/simple"],
        "find-links": ["/opt/wheels"],
        "constraint": ["/etc/pip/constraints.txt"],
    }


def test_nothing_configured_gives_no_flags():
    assert pip_settings.settings("") == {}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": "/dev/null"})
    assert (done.returncode, done.stdout) == (0, ""), done.stderr
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": "/dev/null",
                               "PIP_FIND_LINKS": "/opt/wheels /opt/more"})
    assert done.stdout.split() == ["--find-links", "/opt/wheels", "--find-links", "/opt/more"]
