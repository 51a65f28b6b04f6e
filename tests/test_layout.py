"""The house stays in layers (issue 12): library modules stay small enough to know their room.

The import rules themselves (layers, no cycles, no Arrow/Spark in a device install) are
import-linter contracts in setup.cfg, run by `make test` and `make layers`.
"""

from __future__ import annotations

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
