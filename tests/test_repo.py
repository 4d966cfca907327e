"""Repository-level checks: lint, the README's commands staying what CI runs, and imports that
follow the package's layers."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_clean() -> None:
    proc = subprocess.run(
        ["ruff", "check", "src", "tests", "conftest.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    assert len(blocks) >= 2, "the quick start needs its two commands"
    test_command = blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_command


# The package's layers, bottom first: a module may import its own layer and those below,
# never one above (the architecture flows models -> weights -> kernels -> runtime -> shells).
# ``testing`` (helpers for tests at every layer) and the package root (whose __init__
# re-exports the runtime's Engine) sit outside the order.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "envs"),
    ("models",),
    ("weights", "tokenizer"),
    ("kernels",),
    ("runtime",),
    ("serve", "cli", "bench", "roofline", "workloads", "parallel"),
)
UNLAYERED = ("testing", "__init__")
PACKAGE = ROOT / "src" / "monokernel"


def _tops() -> set[str]:
    """The package's top-level modules and subpackages, tests aside."""
    return {
        p.stem
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and not p.name.startswith("test_")) or (p / "__init__.py").is_file()
    }


def _layer_of(top: str) -> int:
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"src/monokernel/{top} is in no layer: add it to LAYERS in {__file__}")


def _imported_tops(tree: ast.AST, tops: set[str]) -> list[tuple[int, str]]:
    """(line, top-level module of ours) of every import of ours, lazy ones included. The
    package root (``import monokernel``, ``from monokernel import Engine``) counts as the
    runtime, whose API it re-exports."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            is_root = node.module == "monokernel"
            names = [f"monokernel.{a.name}" for a in node.names] if is_root else [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "monokernel":
                top = parts[1] if len(parts) > 1 else "runtime"
                found.append((node.lineno, top if top in tops else "runtime"))
    return found


def upward_imports() -> list[str]:
    """Every import, in a module of src/monokernel (tests and conftests aside: they may use
    any layer's helpers), of a layer above the module's own."""
    tops = _tops()
    bad: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        top = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if path.name.startswith("test_") or path.name == "conftest.py" or top in UNLAYERED:
            continue
        own = _layer_of(top)
        for line, target in _imported_tops(ast.parse(path.read_text()), tops):
            if target not in UNLAYERED and _layer_of(target) > own:
                bad.append(f"src/monokernel/{rel}:{line}: {top} imports {target}")
    return bad


def test_layers_cover_the_package() -> None:
    layered = {n for names in LAYERS for n in names} | set(UNLAYERED)
    assert _tops() <= layered, f"place these in LAYERS: {sorted(_tops() - layered)}"


def test_imports_of_ours_are_found_lazy_ones_too() -> None:
    tree = ast.parse(
        "from monokernel.errors import MonokernelError\nimport monokernel.runtime.engine\n"
        "def f():\n    from monokernel import Engine, envs\n"
    )
    tops = {"errors", "envs", "runtime"}
    assert _imported_tops(tree, tops) == [
        (1, "errors"),
        (2, "runtime"),
        (4, "runtime"),
        (4, "envs"),
    ]


def test_no_import_points_up_the_layers() -> None:
    bad = upward_imports()
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)
