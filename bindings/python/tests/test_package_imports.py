"""The package's modules import each other at the top only: an import
inside a function is how a cycle between modules hides (it works because
the other module is loaded by the time the function runs), so none is
allowed. Third-party imports inside functions (torch, numpy) are fine:
they keep those dependencies optional."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "dmaload"


def test_no_module_of_the_package_imports_another_inside_a_function() -> None:
    local = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if _imports_the_package(node):
                    local.append(f"{path.relative_to(PACKAGE)}:{node.lineno} in {function.name}()")
    assert not local, "imports of the package inside functions: " + ", ".join(local)


def _imports_the_package(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "dmaload"
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "dmaload" for alias in node.names)
    return False
