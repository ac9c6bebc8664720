"""The layout keeps the design visible: imports run only down the floors (the benchmarks on
top, clients of duet's load generator; duet; app and index_builder beside each other; store;
models at the bottom), what the service loads never imports training, and no file or
function outgrows the size rules."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

# each top-level package and the project packages it may import (its own included)
MAY_IMPORT = {
    "models": {"models"},
    "store": {"store", "models"},
    "app": {"app", "store", "models"},
    "index_builder": {"index_builder", "store", "models"},
    "benchmarks": {"benchmarks", "duet", "store", "models"},  # duet.loadgen, duet bench's
    "duet": {"duet", "app", "index_builder", "store", "models"},
}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sources(*roots: str) -> Iterator[Path]:
    for root in roots:
        yield from sorted((REPO / root).rglob("*.py"))


def _imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of every absolute import in `path`, lazy ones included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.partition(".")[0]


def test_imports_run_only_down_the_floors() -> None:
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {top}"
        for pkg, allowed in MAY_IMPORT.items()
        for path in _sources(pkg)
        for line, top in _imported(path)
        if top in MAY_IMPORT and top not in allowed
    ]
    assert not wrong, "imports that run back up a floor:\n" + "\n".join(wrong)


def test_serving_never_loads_training_code() -> None:
    """A fresh interpreter that imports the service and its model loading holds none of the
    trainer, its losses, the synthetic world generator or the evaluator."""
    code = (
        "import sys, app.main, models.loading, models.builtin, models.rerankers\n"
        "prefixes = ('models.train', 'models.losses', 'models.world', 'models.ce_negatives',"
        " 'models.eval', 'models.tune_fusion', 'index_builder', 'duet')\n"
        "print(sorted(m for m in sys.modules if m.startswith(prefixes)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("root", [*MAY_IMPORT, "tests"])
def test_files_and_functions_within_the_size_rules(root: str) -> None:
    too_long = []
    for path in _sources(root):
        text = path.read_text()
        if (n := text.count("\n")) > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {n} lines")
        functions = (
            node
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        )
        for f in functions:
            if (n := (f.end_lineno or f.lineno) - f.lineno + 1) > MAX_FUNCTION_LINES:
                too_long.append(f"{path.relative_to(REPO)}:{f.lineno} {f.name}: {n}")
    assert not too_long, (
        f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function:\n"
        + "\n".join(too_long)
    )
