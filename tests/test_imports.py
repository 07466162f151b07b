"""The import graph of `dpserve` has no cycles: not between modules, not between packages.

Built from the source's AST, counting every import (also those made only for type
checking, or inside a function), so a cycle cannot hide behind a deferred import.
A package is a folder (`dpserve.router`, `dpserve.rollout`); the modules directly in
`dpserve/` count as packages of their own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dpserve

ROOT = Path(dpserve.__file__).parent


def module_name(path: Path) -> str:
    parts = ["dpserve", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The dpserve modules `path` imports (a `from pkg import name` of a submodule
    counts as importing that submodule)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dpserve")}
        elif isinstance(node, ast.ImportFrom):
            base = (".".join(package[:len(package) - node.level + 1] + ([node.module]
                                                                       if node.module else []))
                    if node.level else node.module or "")
            if not base.startswith("dpserve"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules}


def graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) - {module_name(p)} for p in paths}


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])  # dpserve.router.forward.proxy -> dpserve.router; dpserve.config


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by depth-first search, each once, as a path."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], nxt]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    found.append(cycle)
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(graph()) == []


def test_no_package_imports_itself_through_others():
    edges: dict[str, set[str]] = {}
    for module, targets in graph().items():
        src = package_of(module)
        edges.setdefault(src, set()).update(package_of(t) for t in targets
                                            if package_of(t) != src)
    assert cycles(edges) == []


ROUTER_LAYERS = (
    ("",),  # the shared vocabulary: errors, sse, asgi, headers
    ("upstream",),
    ("fleet",),
    ("kv",),
    ("routing", "telemetry"),
    ("peers",),
    ("migration",),
    ("forward",),
    ("http",),
    ("workers",),
)
"""The router's sub-packages, bottom up: each may import its own and those below it."""


def router_part(module: str) -> str | None:
    """`fleet` for dpserve.router.fleet.pool, "" for dpserve.router.errors, None outside."""
    parts = module.split(".")
    if parts[:2] != ["dpserve", "router"]:
        return None
    if len(parts) == 3 and (ROOT / "router" / f"{parts[2]}.py").is_file():
        return ""
    return parts[2] if len(parts) > 2 else ""


def test_the_routers_sub_packages_import_only_downwards():
    rank = {name: i for i, layer in enumerate(ROUTER_LAYERS) for name in layer}
    folders = {p.name for p in (ROOT / "router").iterdir()
               if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(rank) - {""}, "a router sub-package missing from ROUTER_LAYERS"
    upward = []
    for module, targets in graph().items():
        src = router_part(module)
        if src is None:
            continue
        for target in targets:
            dst = router_part(target)
            if dst is not None and dst != src and rank[dst] >= rank[src]:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_reading_a_checkpoint_needs_nothing_of_the_writer():
    """The deploy reads checkpoints others wrote; the format it checks them against must
    not depend on how the fine-tune publishes them."""
    edges = graph()
    assert "dpserve.checkpoint.writer" not in edges["dpserve.checkpoint.format"]
    assert edges["dpserve.checkpoint.writer"] >= {"dpserve.checkpoint.format"}


def test_the_strategy_questions_and_the_flags_import_no_trainer_code():
    """`dpserve.finetune.sharding` is read by the settings and `--plan`; `dpserve.config.flags`
    by every command line: neither may pull in the training code (torch) behind them."""
    edges = graph()
    assert edges["dpserve.finetune.sharding"] == set()
    assert edges["dpserve.config.flags"] <= {"dpserve.config.fielddocs"}
