"""The layers of DESIGN.md: each package imports only the ones below it."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "nanofn"

# package -> the nanofn packages its modules may import (besides itself)
MAY_IMPORT = {
    "state": set(),
    "kernels": set(),
    "model": {"kernels"},
    "runner": {"model", "kernels", "state"},
    "engine": {"runner", "state"},
    "server": {"engine", "state"},
}
# modules held to less than their package allows
NARROWER = {
    "engine/loop.py": {"state"},  # the loop runs without torch, a model or a tokenizer
}


def nanofn_imports(path: pathlib.Path) -> set[str]:
    """The nanofn packages a module imports (``nanofn.x.y`` -> ``x``), lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "nanofn" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_no_package_imports_upwards(package):
    for path in sorted((PACKAGE / package).rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        allowed = NARROWER.get(relative, MAY_IMPORT[package]) | {package}
        assert nanofn_imports(path) <= allowed, f"{relative} imports {nanofn_imports(path) - allowed}"
