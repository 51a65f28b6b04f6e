"""Which build runs: ``filemq --version`` names it (pure Python, or compiled with mypyc), and
the run of the hot-path tests against the compiled copy (``make test-compiled``, with
``FILEMQ_EXPECT_COMPILED=1``) fails unless their modules really are compiled.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import os
import re
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import cli
from filemq.ops import build

ROOT = Path(__file__).resolve().parent.parent
EXPECT_COMPILED = os.environ.get("FILEMQ_EXPECT_COMPILED") == "1"


def _hot_path() -> list[str]:
    """setup.py's HOT_PATH, read without running setup()."""
    tree = _parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "HOT_PATH":
            return [str(v) for v in ast.literal_eval(node.value)]
    raise AssertionError("setup.py has no HOT_PATH")


def _module(path: str) -> str:
    return path[: -len(".py")].replace("/", ".")


def _have_c_compiler() -> bool:
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()


def test_version_names_the_build() -> None:
    result = CliRunner().invoke(cli.main, ["--version"])
    assert result.exit_code == 0, result.output
    line = result.output.strip()
    assert re.fullmatch(r"filemq \S+ \((pure Python|compiled with mypyc: \d+ modules); "
                        r"event loop: (uvloop \S+|asyncio \(uvloop not installed\))\)", line), line
    compiled = build.compiled_modules()
    if compiled:
        assert f"(compiled with mypyc: {len(compiled)} modules;" in line
    else:
        assert "(pure Python;" in line
    from filemq.ops.eventloop import uvloop_version

    uv = uvloop_version()
    assert line.endswith(f"event loop: uvloop {uv})" if uv else "event loop: asyncio (uvloop not installed))")


def test_hot_path_lists_existing_modules() -> None:
    hot = _hot_path()
    assert hot and len(set(hot)) == len(hot)
    for path in hot:
        assert (ROOT / path).is_file(), path


def test_this_run_is_the_build_it_expects() -> None:
    """With ``FILEMQ_EXPECT_COMPILED=1`` (make test-compiled) every module of setup.py's
    HOT_PATH is imported from an extension module and ``--version`` says so; without it, the
    working tree's run is the pure-Python build (the tree stays pure: make compiled builds in
    a copy)."""
    hot = {_module(p) for p in _hot_path()}
    compiled = set(build.compiled_modules())
    if EXPECT_COMPILED:
        if not compiled and not _have_c_compiler():
            pytest.skip("FILEMQ_EXPECT_COMPILED=1 but this machine has no C compiler or Python headers: "
                        "the compiled build cannot be built here (the pure-Python build is tested)")
        assert compiled == hot, (sorted(hot - compiled), sorted(compiled - hot))
        codec = importlib.import_module("filemq.mqtt.codec")
        assert str(codec.__file__).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), codec.__file__
        assert f"(compiled with mypyc: {len(hot)} modules;" in build.build_description()
    else:
        assert compiled == set(), sorted(compiled)
        assert "(pure Python;" in build.build_description()


def test_mypyc_marker_is_a_no_op_without_mypy_extensions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pure-Python install does not depend on mypy_extensions: without it the class
    marker returns the class unchanged."""
    import filemq.common.native as native

    real_import = builtins.__import__

    def no_mypy_extensions(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "mypy_extensions":
            raise ImportError("no mypy_extensions")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mypy_extensions)
    try:
        reloaded = importlib.reload(native)

        class Plain(RuntimeError):
            pass

        assert reloaded.mypyc_attr(native_class=False)(Plain) is Plain
    finally:
        monkeypatch.undo()
        importlib.reload(native)


def _parse(source: str) -> ast.Module:
    """``ast.parse``, again (three tries) on CPython 3.11's ``SystemError: AST constructor
    recursion depth mismatch`` (gh-106905, fixed in 3.11.8): the converter's depth counter is
    shared by every thread of the process, and another thread formatting a traceback at that
    moment (3.11 parses the line for its carets), e.g. a broker thread another test left in this
    pytest-xdist worker, trips it. The parse itself is deterministic."""
    for attempt in range(3):
        try:
            return ast.parse(source)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_hot_path_except_variables_keep_one_type() -> None:
    """mypyc gives a local variable one type per function: an ``except B as exc`` after an
    ``except A as exc`` (B not a subclass of A) is cast to A in the compiled build and raises
    TypeError instead of running the handler (it did, in SUBSCRIBE's full-disk path).  In
    the compiled modules every later handler binding a name catches a subclass of the first."""
    problems = []
    for path in _hot_path():
        module = importlib.import_module(_module(path))
        tree = _parse((ROOT / path).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first: dict[str, type] = {}
            handlers = sorted((n for n in ast.walk(fn) if isinstance(n, ast.ExceptHandler)), key=lambda n: n.lineno)
            for node in handlers:
                if node.name and node.type is not None:
                    caught = eval(compile(ast.Expression(node.type), path, "eval"), vars(module))  # noqa: S307
                    kinds = caught if isinstance(caught, tuple) else (caught,)
                    if node.name not in first:
                        first[node.name] = kinds[0] if len(kinds) == 1 else BaseException
                        continue
                    if not all(issubclass(k, first[node.name]) for k in kinds):
                        problems.append(f"{path}:{node.lineno} {fn.name}: {node.name}")
    assert problems == []
