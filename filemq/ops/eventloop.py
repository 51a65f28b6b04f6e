"""Which asyncio event loop a service runs on (``broker.event_loop``, docs/CONFIG.md).

``auto`` (the default) runs the broker on uvloop, the libuv event loop written in C, where it
is installed, and on the standard library's loop otherwise; ``uvloop`` insists on it (a
configuration error, exit 2, where it is missing); ``asyncio`` always takes the standard one.
uvloop is a dependency of the package on Linux x86_64 and aarch64 (pre-built wheels: no
compiler); elsewhere ``auto`` quietly uses asyncio.  The broker's code is the same on both:
it only uses the asyncio API (transports, protocols, ``call_soon``, ``to_thread``).

Why (docs/PERFORMANCE.md, "Event loop"): a broker serving many small reads and writes spends
much of its CPU in the loop itself.  The standard selector loop allocates a 256 KiB buffer
for every ``recv`` (which glibc serves with ``mmap`` and gives back with ``mremap`` and
``munmap``), and dispatches each event through Python code; uvloop reads into a reused
buffer and dispatches in C.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from filemq.common.config import Config, ConfigError, broker_listeners

CHOICES = ("auto", "uvloop", "asyncio")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def uvloop_version() -> str | None:
    """uvloop's version when it is installed and imports, else None."""
    try:
        import uvloop
    except ImportError:
        return None
    return str(getattr(uvloop, "__version__", "unknown"))  # (not importlib.metadata: a path scan)


def loop_factory(choice: str, *, tls: bool = False) -> tuple[str, LoopFactory | None]:
    """The loop for ``choice``: ``("uvloop 0.23.0", uvloop.new_event_loop)`` or ``("asyncio",
    None)`` (None: :class:`asyncio.Runner`'s default).  ``tls``: the service has a TLS
    listener, which takes the standard loop: the broker starts TLS on an accepted socket
    itself (``loop.start_tls`` behind a paused transport, so handshakes count in
    ``max_connecting``) and uvloop 0.23 never completes that handshake
    (tests/test_eventloop.py).  Raises :class:`ConfigError` for ``uvloop`` when it is not
    installed or with ``tls``, and for an unknown choice."""
    if choice not in CHOICES:
        raise ConfigError(f"event_loop must be one of {', '.join(CHOICES)}, not {choice!r}", key="broker.event_loop")
    if choice == "asyncio":
        return "asyncio", None
    if tls:
        if choice == "uvloop":
            raise ConfigError("event_loop = \"uvloop\" cannot serve a TLS listener (its start_tls never "
                              "completes a server handshake); use \"auto\" or \"asyncio\"", key="broker.event_loop")
        return "asyncio (a TLS listener is configured)", None
    version = uvloop_version()
    if version is None:
        if choice == "uvloop":
            raise ConfigError("event_loop = \"uvloop\" needs the uvloop package: pip install uvloop "
                              "(or event_loop = \"auto\" to fall back to asyncio)", key="broker.event_loop")
        return "asyncio", None
    import uvloop

    return f"uvloop {version}", uvloop.new_event_loop


def serves_tls(config: Config) -> bool:
    """Whether the broker of ``config`` has a TLS listener (the ``tls`` of :func:`loop_factory`)."""
    return any(listener.tls for listener in broker_listeners(config))


def running_loop_name() -> str:
    """``uvloop 0.23.0`` or ``asyncio``: the loop this coroutine runs on (for the ready line)."""
    loop = asyncio.get_running_loop()
    if type(loop).__module__.startswith("uvloop"):
        return f"uvloop {uvloop_version()}"
    return "asyncio"
