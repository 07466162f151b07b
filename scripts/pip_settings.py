"""pip's index settings, one uv flag or value per line: what `install.sh` gives uv so
that both find the same packages (a machine's local wheel folder among them).

Read from `pip config list` (files and PIP_* variables, the variables winning); only
the settings that choose packages are taken: index-url, extra-index-url, find-links,
constraint."""

from __future__ import annotations

import shlex
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint"}
ORDER = {"global": 0, "install": 1, ":env:": 2}
"""Which section wins when several set a key: pip's own order."""


def settings(listing: str) -> dict[str, list[str]]:
    """`pip config list` lines (`section.key='value'`) -> key: values of the winner."""
    chosen: dict[str, tuple[int, list[str]]] = {}
    for line in listing.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if key not in FLAGS or section not in ORDER:
            continue
        rank = ORDER[section]
        if key not in chosen or rank >= chosen[key][0]:
            chosen[key] = (rank, shlex.split(value)[0].split() if value else [])
    return {key: values for key, (_, values) in chosen.items()}


def main() -> None:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=False).stdout
    for key, values in settings(listing).items():
        for value in values:
            print(FLAGS[key])
            print(value)


if __name__ == "__main__":
    main()
