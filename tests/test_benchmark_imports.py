"""The benchmark scripts import only what dpserve and the benchmarks' own helpers still have.

They are run by hand, not by the suite, so a name moved between dpserve's modules,
or between the `benchmarks` package's, would otherwise break one silently. Each
`from dpserve... import names` and `from benchmarks... import names` in `benchmarks/`
(and `scripts/`) must resolve: the module imports, and has each name.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("scripts/*.py")])


def imports_from(package: str, path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.split(".")[0] == package and node.level == 0
            for alias in node.names]


def assert_names_exist(package: str, path: Path) -> None:
    for module, name in imports_from(package, path):
        imported = importlib.import_module(module)
        assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), (
            f"{path.relative_to(ROOT)} imports {name} from {module}, which has none")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dpserve_name_a_script_imports_exists(path):
    assert_names_exist("dpserve", path)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_benchmarks_name_a_script_imports_exists(path):
    assert_names_exist("benchmarks", path)
