"""Build the zip that ``spark-submit --py-files`` ships to a cluster.

``python -m spark_ingest.package dist/filemq.zip`` writes the Python packages the ingest job
imports (``spark_ingest``, ``collector``, ``segments``) into one zip, source files only.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

PACKAGES = ("spark_ingest", "collector", "segments")
"""The packages the job imports; the zip holds each one's ``.py`` files."""

_ROOT = Path(__file__).resolve().parent.parent


def build_zip(destination: Path, root: Path = _ROOT) -> Path:
    """Write the ``--py-files`` zip of :data:`PACKAGES` from ``root``; return its path."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(destination, "w", zipfile.ZIP_DEFLATED) as archive:
        for package in PACKAGES:
            for source in sorted((root / package).rglob("*.py")):
                archive.write(source, source.relative_to(root).as_posix())
    return destination


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m spark_ingest.package DEST.zip", file=sys.stderr)
        return 2
    print(build_zip(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
