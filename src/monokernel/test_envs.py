"""The settings registry: typed values, clear errors, the generated docs, and no reads of a
``MONOKERNEL_*`` variable anywhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from monokernel import envs

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_DOC = ROOT / "docs" / "settings.md"
# Where code lives that must go through the registry (tests included: they sit in src/).
SCANNED = ("src", "scripts", "tools")
BAD_TEXT = {"bool": "maybe", "int": "many", "choice": "no-such-choice"}


def test_docs_settings_md_is_current() -> None:
    assert SETTINGS_DOC.is_file(), "run: python -m monokernel.envs --markdown > docs/settings.md"
    assert SETTINGS_DOC.read_text() == envs.markdown(), (
        "docs/settings.md is stale: python -m monokernel.envs --markdown > docs/settings.md"
    )


@pytest.mark.parametrize("name", sorted(envs.SETTINGS))
def test_unset_and_blank_give_the_default(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = envs.SETTINGS[name]
    monkeypatch.delenv(name, raising=False)
    unset = getattr(envs, name)
    monkeypatch.setenv(name, "  ")
    assert getattr(envs, name) == unset
    if setting.default is None:
        assert unset is None
    elif setting.kind == "path":
        assert unset == Path(setting.default).expanduser()
    else:
        assert unset == setting.default
        assert setting.parse(setting.default_text().strip('"')) == setting.default


@pytest.mark.parametrize("name", sorted(n for n, s in envs.SETTINGS.items() if s.kind in BAD_TEXT))
def test_bad_value_names_variable_value_and_what_is_accepted(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    setting = envs.SETTINGS[name]
    monkeypatch.setenv(name, BAD_TEXT[setting.kind])
    with pytest.raises(ValueError) as info:
        getattr(envs, name)
    message = str(info.value)
    assert f"{name}={BAD_TEXT[setting.kind]!r}" in message
    assert setting.accepted() in message


def test_values_are_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONOKERNEL_PREFILL_GRAPHS", "0")
    assert envs.MONOKERNEL_PREFILL_GRAPHS is False
    monkeypatch.setenv("MONOKERNEL_PREFILL_GRAPHS", "On")
    assert envs.MONOKERNEL_PREFILL_GRAPHS is True
    monkeypatch.setenv("MONOKERNEL_PREFILL_CHUNK", " 4096 ")
    assert envs.MONOKERNEL_PREFILL_CHUNK == 4096
    monkeypatch.setenv("MONOKERNEL_PREFILL_CHUNK", "0")  # below the minimum
    with pytest.raises(ValueError, match=r"MONOKERNEL_PREFILL_CHUNK='0': expected an integer >= 1"):
        _ = envs.MONOKERNEL_PREFILL_CHUNK
    monkeypatch.setenv("MONOKERNEL_HANDOFF_SEARCH", "0")  # 0 is valid here: the search is off
    assert envs.MONOKERNEL_HANDOFF_SEARCH == 0
    monkeypatch.setenv("MONOKERNEL_CACHE", "~/mk")
    cache = envs.MONOKERNEL_CACHE
    assert cache == Path.home() / "mk"
    monkeypatch.setenv("MONOKERNEL_FIRST_TOKEN", "kernel")
    assert envs.MONOKERNEL_FIRST_TOKEN == "kernel"
    with pytest.raises(AttributeError):
        _ = envs.MONOKERNEL_NO_SUCH_SETTING


def test_overridden_sets_checks_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONOKERNEL_NVCC_FLAGS", "-DMK_A=1")
    monkeypatch.delenv("MONOKERNEL_VERBOSE_BUILD", raising=False)
    monkeypatch.delenv("MONOKERNEL_DEBUG_BUILD", raising=False)
    with envs.overridden(MONOKERNEL_NVCC_FLAGS=None, MONOKERNEL_VERBOSE_BUILD="1"):
        assert envs.MONOKERNEL_NVCC_FLAGS == ""
        assert envs.MONOKERNEL_VERBOSE_BUILD is True
        assert envs.is_set("MONOKERNEL_VERBOSE_BUILD")
    assert envs.MONOKERNEL_NVCC_FLAGS == "-DMK_A=1"
    assert not envs.is_set("MONOKERNEL_VERBOSE_BUILD")
    with pytest.raises(ValueError, match="MONOKERNEL_DEBUG_BUILD='2'"):
        envs.overridden(MONOKERNEL_DEBUG_BUILD="2").__enter__()
    assert not envs.is_set("MONOKERNEL_DEBUG_BUILD")
    with pytest.raises(KeyError):
        envs.overridden(MONOKERNEL_NOT_DECLARED="1").__enter__()


def test_defaults_agree_with_the_layers_that_name_them() -> None:
    """The registry sits below every layer, so these few defaults are written twice."""
    from monokernel.runtime.backends.monokernel import FIRST_TOKEN_SOURCES
    from monokernel.runtime.backends.monokernel.handoff_placement import DEFAULT_CANDIDATES
    from monokernel.runtime.prefill import DEFAULT_CHUNK_TOKENS, DEFAULT_PRECISION, PRECISIONS

    s = envs.SETTINGS
    assert s["MONOKERNEL_PREFILL_CHUNK"].default == DEFAULT_CHUNK_TOKENS
    assert s["MONOKERNEL_PREFILL_PRECISION"].default == DEFAULT_PRECISION
    assert s["MONOKERNEL_PREFILL_PRECISION"].choices == PRECISIONS
    assert s["MONOKERNEL_FIRST_TOKEN"].choices == tuple(FIRST_TOKEN_SOURCES)
    assert s["MONOKERNEL_FIRST_TOKEN"].default == FIRST_TOKEN_SOURCES[0]
    assert s["MONOKERNEL_HANDOFF_SEARCH"].default == DEFAULT_CANDIDATES


def _python_files() -> list[Path]:
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if p.name not in ("envs.py", "test_envs.py")]


def test_every_monokernel_name_in_the_code_is_declared() -> None:
    undeclared = {
        f"{p.relative_to(ROOT)}: {name}"
        for p in [*_python_files(), ROOT / "conftest.py"]
        for name in re.findall(r"\bMONOKERNEL_[A-Z0-9_]*[A-Z0-9]\b", p.read_text())
        if name not in envs.SETTINGS
    }
    assert not undeclared, "declare these in src/monokernel/envs.py:\n" + "\n".join(
        sorted(undeclared)
    )


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` or a bare ``environ``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id == "environ"


def _monokernel_name(node: ast.expr, constants: dict[str, str]) -> str | None:
    """The ``MONOKERNEL_*`` name ``node`` spells: a literal, or a module-level constant."""
    value = node.value if isinstance(node, ast.Constant) else None
    if isinstance(node, ast.Name):
        value = constants.get(node.id)
    return value if isinstance(value, str) and value.startswith("MONOKERNEL_") else None


def environ_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of every read of a MONOKERNEL_* variable straight from the environment:
    ``os.environ.get(N)``, ``os.getenv(N)``, ``os.environ[N]`` (loaded), ``N in os.environ``,
    where N is a literal or a module-level string constant."""
    tree = ast.parse(source)
    constants = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name) and isinstance(n.value.value, str)
    }
    found: list[tuple[int, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            getter = isinstance(f, ast.Attribute) and (
                (f.attr == "get" and _is_environ(f.value)) or f.attr == "getenv"
            )
            if getter or (isinstance(f, ast.Name) and f.id == "getenv"):
                found.append((node.lineno, _monokernel_name(node.args[0], constants)))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _is_environ(node.value):
                found.append((node.lineno, _monokernel_name(node.slice, constants)))
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], ast.In | ast.NotIn)
            and _is_environ(node.comparators[0])
        ):
            found.append((node.lineno, _monokernel_name(node.left, constants)))
    return [(line, name) for line, name in found if name is not None]


def test_environ_reads_finds_every_form() -> None:
    source = (
        "import os\nfrom os import environ, getenv\nCACHE_ENV = 'MONOKERNEL_CACHE'\n"
        "a = os.environ.get('MONOKERNEL_A', '1')\nb = os.getenv('MONOKERNEL_B')\n"
        "c = os.environ['MONOKERNEL_C']\nd = 'MONOKERNEL_D' in os.environ\n"
        "e = environ.get(CACHE_ENV)\nf = getenv('HOME')\nos.environ['MONOKERNEL_G'] = '1'\n"
    )
    assert environ_reads(source) == [
        (4, "MONOKERNEL_A"),
        (5, "MONOKERNEL_B"),
        (6, "MONOKERNEL_C"),
        (7, "MONOKERNEL_D"),
        (8, "MONOKERNEL_CACHE"),
    ]


def test_only_envs_reads_monokernel_variables() -> None:
    reads = [
        f"{p.relative_to(ROOT)}:{line}: {name}"
        for p in _python_files()
        for line, name in sorted(environ_reads(p.read_text()))
    ]
    assert not reads, "read these through monokernel.envs instead:\n" + "\n".join(reads)
