"""The built-in tiny Llama model: served by the demo and tests, built offline on first use.

The exports resolve lazily: importing ``build`` here would make
``python -m dpserve.tinymodel.build`` warn that the module was imported twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpserve.tinymodel.build import TINY_MODEL_NAME, build_tiny_model

__all__ = ["TINY_MODEL_NAME", "build_tiny_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dpserve.tinymodel import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
