"""A leading underscore means "this module's (or this package's) own": no module imports such a
name from another package, and bench/ imports none from another module at all (issue 31
item 5).  Inside one package (the MQTT codec's wire helpers, the broker's ack bytes) modules
may share them: they change together."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("segments", "filemq", "worker_agent", "collector", "spark_ingest", "bench", "demo")


def _private_imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, name) for every ``from X import _name``."""
    out: list[tuple[str, str, str]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    out.extend((module, node.module, a.name) for a in node.names
                               if a.name.startswith("_") and not a.name.startswith("__"))
    return out


def _package(module: str) -> str:
    return module.rsplit(".", 1)[0]


def test_the_walk_sees_imports_of_private_names() -> None:
    found = _private_imports()
    assert found, "no private import found at all: the walk is broken"
    assert all(m.split(".")[0] in PACKAGES for m, _, _ in found)


def test_no_private_name_is_imported_from_another_package() -> None:
    crossing = [(m, src, name) for m, src, name in _private_imports()
                if _package(m) != _package(src) and src.split(".")[0] in PACKAGES]
    assert crossing == []


def test_bench_imports_no_private_name_from_another_module() -> None:
    assert [(m, src, name) for m, src, name in _private_imports() if m.startswith("bench.")] == []
