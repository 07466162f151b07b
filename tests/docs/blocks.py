"""The shell blocks of the docs, each with what a reader may expect of it.

Every ```bash / ```sh / ```console block in README.md, deploy/README.md and docs/ is
preceded by one marker line (an HTML comment, invisible on GitHub):

- `<!-- docs: run -->` — run as written by tests/integration/test_docs_walk.py, which
  walks every run block of the docs in the order a reader takes them, in one
  directory, with one fleet (tests/docs/walk.py says how); every command exits 0, or
  the status its `# exits N` comment shows;
- `<!-- docs: checked: WHY NOT RUN -->` — every `dpserve` / `python -m loadtest`
  command is parsed by the program's own parser and every input it names
  (`--model`, `--data`, `--tokenizer`, `--eval-data`) exists in the repository,
  unless a command before it in the block writes it (`runs/...`); not run, for the
  reason given; what it prints is shown as a real run's output and says so;
- `<!-- docs: illustration -->` — placeholders (`/models/my-model`, other hosts, a
  cluster): its commands are parsed, nothing else.

A ```text block marked `<!-- docs: output -->` right after a run block is what that
block prints, as is a run console transcript's output: each of its lines must be
printed, in order (other lines may come between), with its words and layout as shown
and its numbers, digests and `…` cuts free to differ (`matches`). Output shown
without the marker is a real run's, not checked.

The walk's directory links `.venv`, `build`, `dpserve`, `loadtest`, `benchmarks` and
what `make` needs to the repository's, so the relative paths the docs use resolve,
and its own `runs/` takes what the commands write. Only the fleet's port is
substituted.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")
MARKER = re.compile(r"^<!-- docs: (run|checked|illustration)(?:: (.+?))? -->$")
OUTPUT = "<!-- docs: output -->"
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
HEX = re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{4,}\b")
FREE = re.compile(rf"(\s*…\s*|\s+|{HEX.pattern}|{NUMBER.pattern})")
"""What a shown output line may differ in: spacing, cuts, digests, numbers."""


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    language: str
    kind: str | None
    """run, checked or illustration; None: no marker (a test fails on it)."""
    reason: str
    text: str
    output: str | None = None
    """The ```text block marked as what this block prints, if one follows."""

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def script(self) -> str:
        """The commands: the block, or the `$ ` lines of a console transcript (with their
        continuation lines, prompts removed); the rest of a transcript is output."""
        if self.language != "console":
            return self.text
        out, continuing = [], False
        for line in self.text.splitlines():
            if line.startswith("$ ") or continuing:
                out.append(line.removeprefix("$ "))
                continuing = line.rstrip().endswith("\\")
        return "\n".join(out)

    def commented(self) -> list[tuple[str, str]]:
        """Each command line, continuation lines joined, with its comment cut off and
        given beside it (`cmd   # note` -> ("cmd", " note"))."""
        found = []
        for line in re.sub(r"\\\n\s*", " ", self.script()).splitlines():
            command, _, comment = line.partition("  #")
            command = command.strip()
            if command and not command.startswith("#"):
                found.append((command, comment))
        return found

    def commands(self) -> list[str]:
        """Each command line, continuation lines joined, comments cut."""
        return [command for command, _ in self.commented()]


def blocks(doc: Path) -> list[Block]:
    found: list[Block] = []
    lines = doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        language, start = lines[i][3:].strip(), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = lines[start - 1].strip() if start else ""
        if language in SHELL:
            marker = MARKER.match(above)
            found.append(Block(str(doc.relative_to(ROOT)), start + 1, language,
                               marker.group(1) if marker else None,
                               (marker.group(2) or "") if marker else "",
                               "\n".join(lines[start + 1:end])))
        elif above == OUTPUT:
            shown = "\n".join(lines[start + 1:end])
            before = found[-1] if found else None
            if before is None or before.kind != "run" or any(
                    line.strip() and line.strip() != OUTPUT
                    for line in lines[before.line + before.text.count("\n") + 2:start]):
                raise ValueError(f"{doc}:{start + 1}: {OUTPUT} follows no run block")
            found[-1] = dataclasses.replace(before, output=shown)
        i = end + 1
    return found


def matches(shown: str, printed: str) -> list[str]:
    """The lines of `shown` not found in `printed`, in order: each must match a later
    printed line than the one before it, word for word, its numbers free (a run of
    spaces matches any, so columns may widen with their numbers), and so are hex
    digests and ids (4 or more hex digits, one a digit: `b5ff1223`, `1f7a`); `…`
    stands for anything (a line the docs cut). A shown line ending in ` \\` goes on in
    the next, as a long printed line wrapped for the page."""
    out = [line.rstrip() for line in printed.splitlines()]
    at, missing = 0, []
    for line in re.sub(r" \\\n\s*", " ", shown).splitlines():  # a long line, wrapped
        line = line.rstrip()
        if not line.strip():
            continue
        pattern = re.compile("".join(_pattern(part) for part in FREE.split(line.strip())
                                     if part))
        found = next((i for i in range(at, len(out)) if pattern.fullmatch(out[i].strip())),
                     None)
        if found is None:
            missing.append(line)
        else:
            at = found + 1
    return missing


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc)]


def _pattern(part: str) -> str:
    if "…" in part:
        return ".*"
    if part.isspace():
        return r"\s+"
    if HEX.fullmatch(part):  # a digest, or a long number (`2469` may print as `2,469`)
        return rf"(?:[0-9a-f]+|{NUMBER.pattern})"
    if NUMBER.fullmatch(part):
        return NUMBER.pattern
    return re.escape(part)
