"""The work directory of one bench run: where its data lives and when it goes away."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def bench_workdir(
    data_dir: str | None, name: str, keep: bool, progress: Callable[[str], None]
) -> Iterator[Path]:
    """A fresh ``<name>-XXXX`` directory under ``data_dir`` (or under a new temporary one).

    Removed afterwards unless ``keep``; a ``data_dir`` the user gave is never removed itself,
    only the run's own directory inside it.
    """
    root = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="filemq-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    try:
        yield work
    finally:
        if keep:
            progress(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            if not data_dir:
                shutil.rmtree(root, ignore_errors=True)
