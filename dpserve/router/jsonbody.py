"""Client JSON the router writes again, guarded against depth.

A body is parsed once, its depth bounded by Python's recursion limit where the parse
runs. Writing it back (an adapter's model renamed, token ids asked for, a stream's
continuation) runs deeper in the stack, so a body nested just under the parser's
limit could fail there: a RecursionError, a 500 with a traceback. Every such write
goes through `encode`, and its caller decides what a body too deep to write means.
"""

from __future__ import annotations

import json
from typing import Any

TOO_DEEP = "request body is nested too deeply"
"""The words of the 400 for a body the router cannot parse or write back."""


def encode(body: dict[str, Any]) -> bytes | None:
    """`body` as compact ASCII JSON (a lone surrogate, valid JSON, is kept escaped, as
    the client sent it); None if it nests too deeply to write."""
    try:
        return json.dumps(body, separators=(",", ":")).encode()
    except RecursionError:
        return None
