"""mypyc's class markers for the optional compiled build, without a runtime dependency.

The hot-path modules can be compiled with mypyc (``FILEMQ_COMPILE=1 pip install .``,
``make compiled``; docs/PERFORMANCE.md).  mypyc makes every class of a compiled module a
native class unless it is marked ``@mypyc_attr(native_class=False)``; the classes that must
stay ordinary Python classes (an exception derived from ``RuntimeError``, the broker core's
parts whose methods tests and benches replace on an instance) carry that marker.  mypy and mypyc see
``mypy_extensions.mypyc_attr`` (they resolve the name through this module); at run time the
marker is the real one when ``mypy_extensions`` is installed and a no-op otherwise, so the
default, pure-Python install needs nothing beyond its dependencies.  This module itself is
never compiled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["mypyc_attr"]

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:  # the pure-Python install: the marker changes nothing at run time

        def mypyc_attr(*attrs: str, **kwattrs: Any) -> Any:
            return lambda x: x
