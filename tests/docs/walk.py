"""The docs as one walk: what tests/integration/test_docs_walk.py runs.

A new user reads the README, then each doc in `ORDER`, pasting every command into one
terminal in one directory. The walk does the same with every `<!-- docs: run -->`
block: in that order, in one scratch directory (tests/docs/blocks.py says what it
links), so a block may use what an earlier block wrote (`runs/ft/step-000020`) and
two blocks writing the same path collide as they would for a reader.

One fleet serves the whole walk. A run block may start it with one command line
`dpserve serve ... &`, the only command allowed in the background: the walk starts
it (its output to a log), waits until every replica is ready, and goes on with the
block. A later block that starts a fleet must show the same command (a reader
would find the port taken otherwise); the walk leaves the running one be. At the
end the fleet gets SIGTERM and must leave no process behind.

The docs' address, port 8000, is the one substitution: the walk serves on a free
port and writes it wherever a block says `:8000` or `--port 8000`
(`DPSERVE_ROUTER_URL` too, for commands that take the default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tests.docs.blocks import DOCS, ROOT, Block, blocks

ORDER = ["README.md", "docs/workflows.md", "docs/serving.md", "docs/finetuning.md",
         "docs/deploying.md", "docs/load-testing.md", "docs/metrics.md",
         "docs/troubleshooting.md", "docs/configuration.md", "docs/kubernetes.md",
         "deploy/README.md"]
"""The order a reader takes: the README, then the page it sends them to for one
example of each job, then the reference pages."""
DOCS_PORT = 8000
_FLEET = re.compile(r"(?:^|\S/)dpserve serve\s.*&$")
_PORT = re.compile(rf"(:|--port\s+){DOCS_PORT}\b")
_NOT_BACKGROUND = re.compile(r"&&|\d?>&\d|&>>?")
"""`&&`, `2>&1`, `&>`: ampersands that run nothing in the background."""
_EXITS = re.compile(r"exits (\d+)\b")
_LOG = re.compile(r">\s*(\S+)\s+2>&1\s*$")


@dataclass(frozen=True)
class Step:
    kind: str
    """`shell`: commands run by bash in the walk's directory, each must exit 0;
    `fleet`: the command that starts the walk's fleet (without its `&`)."""
    text: str


def walk_blocks() -> list[Block]:
    """Every run block of the docs, in the walk's order."""
    named = {str(doc.relative_to(ROOT)) for doc in DOCS}
    if named != set(ORDER):
        raise ValueError(f"tests/docs/walk.py ORDER must place every doc once: "
                         f"missing {sorted(named - set(ORDER))}, "
                         f"unknown {sorted(set(ORDER) - named)}")
    return [b for doc in ORDER for b in blocks(ROOT / doc) if b.kind == "run"]


def fleet_log(command: str) -> str | None:
    """Where the fleet's command sends its output (`> runs/serve.log 2>&1`), if it says."""
    found = _LOG.search(command)
    return found.group(1) if found else None


def with_port(text: str, port: int) -> str:
    """`text` with the docs' port replaced by `port`."""
    return _PORT.sub(rf"\g<1>{port}", text)


def commands(block: Block) -> list[tuple[str, int]]:
    """Each command of the block, continuation lines joined, comments cut (as
    `Block.commands`), with the exit status the docs show it ending with: 0, unless its
    comment says `# exits N` (a refusal the docs show on purpose)."""
    return [(command, int(exits.group(1)) if (exits := _EXITS.search(comment)) else 0)
            for command, comment in block.commented()]


def shown_output(block: Block) -> str | None:
    """What the block is shown to print: its output block, or a console transcript's
    lines other than its commands."""
    if block.output is not None or block.language != "console":
        return block.output
    out, continuing = [], False
    for line in block.text.splitlines():
        if line.startswith("$ ") or continuing:
            continuing = line.rstrip().endswith("\\")
        else:
            out.append(line)
    return "\n".join(out)


def steps(block: Block) -> list[Step]:
    """The block as the walk runs it: shell steps, split around the line that starts
    the fleet. Any other command in the background is refused (ValueError): the walk
    could neither wait for it nor stop it."""
    found: list[Step] = []
    pending: list[str] = []
    for command, exits in commands(block):
        ampersands = _NOT_BACKGROUND.sub("", command)
        if not ampersands.endswith("&"):
            if "&" in ampersands:
                raise ValueError(f"{block.where}: only `dpserve serve ... &` may run in the "
                                 f"background: {command}")
            pending.append(command if not exits else _expecting(command, exits))
            continue
        if not _FLEET.search(command) or "&" in ampersands[:-1]:
            raise ValueError(f"{block.where}: only `dpserve serve ... &` may run in the "
                             f"background: {command}")
        if pending:
            found.append(Step("shell", "\n".join(pending)))
            pending = []
        found.append(Step("fleet", command.removesuffix("&").strip()))
    if pending:
        found.append(Step("shell", "\n".join(pending)))
    return found


def _expecting(command: str, exits: int) -> str:
    """`command`, run so that the script goes on when it exits `exits`, and stops saying
    so when it exits otherwise."""
    return (f"set +e; {command}\nrc=$?; set -e; [ $rc -eq {exits} ] || "
            f"{{ echo \"walk: exited $rc where the docs show {exits}\" >&2; exit 98; }}")
