"""Which build runs: the pure-Python package or the optional compiled hot path.

``FILEMQ_COMPILE=1 pip install .`` or ``make compiled`` compile the hot-path modules with
mypyc (setup.py, docs/PERFORMANCE.md); everything else, and the whole default install, is the
interpreted source.  A module is compiled when the file it is imported from is an extension
module (``.so``) rather than its ``.py`` source: that is what :func:`compiled_modules` checks,
module by module, without importing the modules themselves (only their packages).
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os

PACKAGES = ("segments", "filemq")
"""Top-level packages whose modules may be compiled."""


def _module_names(package: str) -> list[str]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    names: list[str] = []
    for root in spec.submodule_search_locations:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if os.path.exists(os.path.join(dirpath, d, "__init__.py")))
            rel = os.path.relpath(dirpath, root)
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for filename in sorted(filenames):
                if filename.endswith(".py") and filename != "__init__.py":
                    names.append(f"{prefix}.{filename[:-3]}")
    return names


def compiled_modules() -> list[str]:
    """The modules of ``segments`` and ``filemq`` that import from an extension module."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    compiled = []
    for package in PACKAGES:
        for name in _module_names(package):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin is not None and spec.origin.endswith(suffixes):
                compiled.append(name)
    return compiled


def version() -> str:
    try:
        return importlib.metadata.version("filemq")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_description() -> str:
    """``filemq 0.1.0 (pure Python; event loop: uvloop 0.23.0)`` or ``filemq 0.1.0 (compiled
    with mypyc: 23 modules; event loop: asyncio (uvloop not installed))``: the build, and the
    loop ``broker.event_loop = "auto"`` takes."""
    from filemq.ops.eventloop import uvloop_version

    compiled = compiled_modules()
    uv = uvloop_version()
    loop = f"; event loop: uvloop {uv}" if uv else "; event loop: asyncio (uvloop not installed)"
    if not compiled:
        return f"filemq {version()} (pure Python{loop})"
    return f"filemq {version()} (compiled with mypyc: {len(compiled)} modules{loop})"
