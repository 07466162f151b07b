"""A terminal a test can read and type into: one command in a pane of a private tmux server.

What a person sees (`capture`) and presses (`keys`), on a real pseudo-terminal, so a
full-screen program is exercised as it is used, over SSH included. The pane's shell
writes its pid (the pane's process group) and the command's exit status to files, so
a test can assert how the program ended and that it left nothing running.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import uuid
from pathlib import Path

TMUX = "/usr/bin/tmux"


class Terminal:
    """`command` in a `width` x `height` pane; `close()` kills the tmux server."""

    def __init__(self, workdir: Path, command: list[str], *, width: int = 200,
                 height: int = 20) -> None:
        self.socket = f"dpserve-test-{uuid.uuid4().hex[:8]}"
        self._pid_file = workdir / "pane.pid"
        self._rc_file = workdir / "pane.rc"
        script = (f"echo $$ > {shlex.quote(str(self._pid_file))}; "
                  f"{shlex.join(command)}; echo $? > {shlex.quote(str(self._rc_file))}")
        self._tmux("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height),
                   "sh", "-c", script)

    def _tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, "-f", "/dev/null", *args],
                              check=True, capture_output=True, text=True, timeout=10,
                              env={**os.environ, "TERM": "xterm-256color"}).stdout

    def capture(self) -> str:
        """The pane's text now; empty once the pane has closed."""
        try:
            return self._tmux("capture-pane", "-p", "-t", "top")
        except subprocess.CalledProcessError:
            return ""

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    @property
    def pane_pid(self) -> int | None:
        text = self._pid_file.read_text().strip() if self._pid_file.exists() else ""
        return int(text) if text else None

    def exit_status(self) -> int | None:
        """The command's exit status once it has ended, else None."""
        text = self._rc_file.read_text().strip() if self._rc_file.exists() else ""
        return int(text) if text else None

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=10, check=False)
