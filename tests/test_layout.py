"""The house stays in layers (issue 12): library modules stay small enough to know their room.

The import rules themselves (layers, no cycles, no Arrow/Spark in a device install) are
import-linter contracts in setup.cfg, run by `make test` and `make layers`. The tests keep a
rule of their own: no test module imports another (issue 31, item 5); what several share is in
tests/'s helper modules (docs/LAYERS.md, "The tests' harness").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBRARY = ("segments", "filemq", "worker_agent", "collector", "spark_ingest")
MAX_LINES = 900


@pytest.mark.parametrize("package", LIBRARY)
def test_no_library_module_over_900_lines(package: str) -> None:
    too_long = {
        str(p.relative_to(REPO)): n
        for p in sorted((REPO / package).rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not too_long, f"split these by concern (docs/LAYERS.md): {too_long}"


def test_every_filemq_subpackage_says_what_it_may_import() -> None:
    """Each layer's __init__ docstring names what it may import and what it must not."""
    for init in sorted((REPO / "filemq").glob("*/__init__.py")):
        text = init.read_text(encoding="utf-8")
        assert "May import" in text and "Must not" in text, init


# ---- a test module is not a harness (issue 31, item 5) ---------------------------------------

IMPORTING_CALLS = {"import_module", "importorskip", "__import__"}


def imports_of_test_modules(path: Path, source: str) -> list[str]:
    """Each import of a ``tests.test_*`` module in ``source`` (the file ``path`` under the
    repository), as ``file:line: module``: ``import tests.test_x``, ``from tests.test_x import
    ...``, ``from tests import test_x``, the relative ``from .test_x import ...`` and
    ``from . import test_x``, and a module named in ``importlib.import_module``,
    ``pytest.importorskip`` or ``__import__``."""
    package = path.parent.relative_to(REPO).parts
    found: dict[tuple[int, str], None] = {}  # (line, module), once each, in the file's order
    for node in ast.walk(ast.parse(source, str(path))):
        if not isinstance(node, ast.Import | ast.ImportFrom | ast.Call):
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            base += node.module.split(".") if node.module else []
            names = [".".join([*base, alias.name]) for alias in node.names]
        elif node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if callee in IMPORTING_CALLS and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        for name in names:
            parts = name.split(".")
            if len(parts) >= 2 and parts[0] == "tests" and parts[1].startswith("test_"):
                found[node.lineno, ".".join(parts[:2])] = None
    return [f"{path.relative_to(REPO)}:{line}: {module}" for line, module in sorted(found)]


def test_the_check_sees_every_way_to_import_a_test_module() -> None:
    """The check finds each way a file can import a test module, and takes helper modules."""
    path = REPO / "tests" / "test_example.py"
    imports = [
        "from tests.test_codec import publishes",
        "import tests.test_codec",
        "import tests.test_codec as codec_tests",
        "from tests import test_codec",
        "from .test_codec import publishes",
        "from . import test_codec",
        "def f():\n    from tests.test_codec import publishes",
        "codec_tests = pytest.importorskip('tests.test_codec')",
        "codec_tests = importlib.import_module('tests.test_codec')",
    ]
    for source in imports:
        line = source.count("\n") + 1
        assert imports_of_test_modules(path, source) == [f"tests/test_example.py:{line}: tests.test_codec"], source
    helpers = [
        "from tests.broker_harness import Harness",
        "from tests import mosquitto",
        "from . import faults",
        "faults = pytest.importorskip('tests.faults')",
        "from filemq.mqtt import test_helpers",
    ]
    for source in helpers:
        assert imports_of_test_modules(path, source) == [], source


def test_no_file_under_tests_imports_a_test_module() -> None:
    """A test module is not a harness (issue 31, item 5): no file under tests/ imports a
    ``tests.test_*`` module. Importing one runs its module code, fixtures and importorskips in
    the importer, ties two test files' internals together (private helpers, constants a test
    may change) and hides where the shared harness is. What several test files share lives in
    a helper module named by what it holds (tests/broker_harness.py, tests/broker_process.py,
    tests/pipeline_harness.py, ...; docs/LAYERS.md, "The tests' harness")."""
    found = [hit for path in sorted((REPO / "tests").rglob("*.py"))
             for hit in imports_of_test_modules(path, path.read_text(encoding="utf-8"))]
    assert not found, "move what these import into a helper module under tests/:\n" + "\n".join(found)
