"""The docstring under each field of a settings dataclass, and the same text as a help line.

A setting's documentation is written once, under its field; the configuration
reference, `dpserve --help` and the torchrun entry's `--help` all read it from there.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, as one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def as_help(doc: str) -> str:
    """A field's docstring as a help line, written like the hand-written ones (`steps
    between ...`, no final period); `%` escaped, argparse formats help with it."""
    first = doc.split(" ", 1)[0]
    if first[1:].isalpha() and first[1:].islower():  # `Steps`, not `LoRA` or `AdamW`
        doc = doc[0].lower() + doc[1:]
    return doc.removesuffix(".").replace("%", "%%")
