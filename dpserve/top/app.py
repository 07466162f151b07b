"""The `dpserve top` screen: a Textual app that polls the router and redraws a table.

Thin on purpose: reading is `dpserve.top.fetch`, figures are `dpserve.top.window`,
text is `dpserve.top.view`. Textual draws with ANSI escapes on the terminal it runs
in (the alternate screen, restored on exit), so it works the same over SSH; `q`
or ctrl+c quits.

One worker owns the HTTP client and loops read → draw → sleep, so refreshes never
overlap however slow the router answers; it is cancelled when the app exits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from dpserve.rollout.client import DEFAULT_ROUTER, AdminError, read_admin_key
from dpserve.top.fetch import Refresh, RouterReader
from dpserve.top.view import cells, columns, summary
from dpserve.top.window import History

FETCH_TIMEOUT_S = 5.0
STATE_STYLES = {"ready": "green", "starting": "cyan", "draining": "yellow",
                "reloading": "magenta", "down": "bold red"}


class TopApp(App[int]):
    """The live view of the replicas behind the router at `url`."""

    TITLE = "dpserve top"
    CSS = """
    #header { height: 1; background: $panel; padding: 0 1; }
    #problems { height: auto; color: $error; padding: 0 1; }
    DataTable { height: 1fr; }
    """
    # ctrl+c too, as in `top`: Textual's own ctrl+c only says to press ctrl+q.
    BINDINGS = [Binding("q", "quit", "quit"), Binding("ctrl+c", "quit", show=False)]

    def __init__(self, url: str, admin_key: str | None, *, interval_s: float) -> None:
        super().__init__()
        self.url = url.rstrip("/")
        self._admin_key = admin_key
        self.interval_s = interval_s
        self.history = History()
        self._columns: tuple[str, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static(f"dpserve top · {self.url} · connecting…", id="header")
        yield DataTable(id="replicas", show_cursor=False, zebra_stripes=True)
        yield Static("", id="problems")

    def on_mount(self) -> None:
        self._set_columns(columns(kv_aware=False))
        self.run_worker(self._poll(), exclusive=True, exit_on_error=True)

    async def _poll(self) -> None:
        # Not tied to --interval: the router gives each replica 2 s on a scrape of
        # /metrics/engines, and 1 s here cut scrapes of two busy CPU replicas.
        async with RouterReader(self.url, self._admin_key, timeout_s=FETCH_TIMEOUT_S) as reader:
            while True:
                started = time.monotonic()
                self.show(await reader.read())
                await asyncio.sleep(max(0.0, started + self.interval_s - time.monotonic()))

    def _set_columns(self, headings: tuple[str, ...]) -> None:
        """Redo the table's columns when they change (the router's policy did)."""
        if headings != self._columns:
            table = self.query_one(DataTable)
            table.clear(columns=True)
            table.add_columns(*headings)
            self._columns = headings

    def show(self, refresh: Refresh) -> None:
        """Draw one refresh: new rows if it has a snapshot, else the last ones kept."""
        clock = time.strftime("%H:%M:%S")
        if refresh.snapshot is not None:
            self.history.add(refresh.snapshot)
            rows, kv = self.history.rows(), self.history.kv_summary()
            table = self.query_one(DataTable)
            table.clear()
            self._set_columns(columns(kv_aware=kv is not None))
            for row in rows:
                text = cells(row, kv_aware=kv is not None)
                table.add_row(Text(text[0], style="bold"),
                              Text(text[1], style=STATE_STYLES.get(row.state, "")),
                              *text[2:], key=row.id)
            head = f"{self.url} · {summary(rows, self.history.span_s, kv)} · {clock}"
        else:
            head = f"{self.url} · no answer at {clock}"
        self.query_one("#header", Static).update(
            Text(f"{head} · every {self.interval_s:g} s · q quits"))
        problems = list(refresh.problems)
        if refresh.snapshot is None:
            problems.append(f"retrying every {self.interval_s:g} s"
                            + (" (the rows above are from the last answer)"
                               if len(self.history) else ""))
        self.query_one("#problems", Static).update(Text("\n".join(problems)))


def run_top(ns: argparse.Namespace) -> int:
    """`dpserve top` from parsed arguments; the exit code."""
    try:
        key = read_admin_key(ns.admin_key_file)
    except (OSError, AdminError) as exc:
        print(f"dpserve top: cannot read the admin key: {exc}", file=sys.stderr)
        return 2
    if not ns.interval > 0:
        print(f"dpserve top: --interval must be above 0, got {ns.interval:g}", file=sys.stderr)
        return 2
    app = TopApp(ns.router or DEFAULT_ROUTER, key, interval_s=ns.interval)
    app.run()
    return app.return_code or 0
