"""The ``filemq broker`` process: run a :class:`~filemq.broker.server.Broker` until a signal.

:func:`run_broker` returns the process exit code: 0 after a clean shutdown (SIGTERM or
SIGINT: stop accepting, close clients, persist sessions, offsets and the retained snapshot,
commit the log), 2 for a configuration problem (bad password/ACL file, TLS files), 1 for a
runtime failure (e.g. the port is in use).  Problems are logged in words a person can act on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from filemq.broker.server import Broker
from filemq.config import Config, ConfigError

log = logging.getLogger("filemq.broker")

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_CONFIG = 2


async def serve(config: Config, ready: Callable[[str], None] | None = None,
                stop: asyncio.Event | None = None) -> int:
    """Start the broker, call ``ready(line)`` once listening, run until ``stop`` or a signal."""
    try:
        broker = Broker(config)
        await broker.start()
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return EXIT_CONFIG
    except OSError as exc:
        b = config.broker
        log.error("cannot start the broker on %s:%d (data dir %s): %s", b.host, b.port, config.data_dir, exc)
        return EXIT_RUNTIME
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Not possible outside the main thread (tests run serve() in one): Ctrl-C still works.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    assert broker.queue is not None
    lg = broker.queue.log
    tls = f" (TLS on port {broker.tls_port})" if broker.tls_port else ""
    line = (f"filemq broker listening on {broker.listening}{tls}, data dir {broker.data_dir}, "
            f"{lg.next_offset - lg.first_offset} records, recovered in {broker.recovery_seconds * 1000:.0f} ms")
    log.info("%s", line)
    if ready is not None:
        ready(line)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        try:
            await broker.stop()
        except Exception:
            log.exception("error during shutdown")
            return EXIT_RUNTIME
    return EXIT_OK


def run_broker(config: Config, ready: Callable[[str], None] | None = None) -> int:
    """Run the broker in a new event loop until SIGTERM/SIGINT; returns the exit code."""
    try:
        return asyncio.run(serve(config, ready))
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return EXIT_RUNTIME
    except Exception:
        log.exception("the broker failed")
        return EXIT_RUNTIME
