"""The ``filemq broker`` process: run a :class:`~filemq.broker.server.Broker` until a signal.

:func:`run_broker` returns the process exit code: 0 after a clean shutdown (SIGTERM or
SIGINT: stop accepting, close clients, persist sessions, offsets and the retained snapshot,
commit the log), 2 for a configuration problem (bad password/ACL file, TLS files), 1 for a
runtime failure (e.g. the port is in use).  Problems are logged in words a person can act on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from filemq.broker.metrics import backlog_status, broker_families, render_text
from filemq.broker.server import Broker
from filemq.common.config import Config
from filemq.ops.eventloop import running_loop_name, serves_tls
from filemq.ops.gctune import tune_gc
from filemq.ops.service import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_RUNTIME,
    Sidecar,
    run_until_signalled,
    serve_until_signalled,
)

log = logging.getLogger("filemq.broker")

__all__ = ["EXIT_CONFIG", "EXIT_OK", "EXIT_RUNTIME", "run_broker", "serve"]


async def serve(config: Config, ready: Callable[[str], None] | None = None,
                stop: asyncio.Event | None = None) -> int:
    """Start the broker, call ``ready(line)`` once listening, run until ``stop`` or a signal."""

    def describe(broker: Broker) -> str:
        assert broker.queue is not None
        lg = broker.queue.log
        tls = f" (TLS on port {broker.tls_port})" if broker.tls_port else ""
        return (f"filemq broker listening on {broker.listening}{tls}, data dir {broker.data_dir}, "
                f"{lg.next_offset - lg.first_offset} records, recovered in {broker.recovery_seconds * 1000:.0f} ms, "
                f"event loop {running_loop_name()}")

    def metrics(broker: Broker) -> Sidecar | None:
        if config.broker.metrics_port is None:
            return None
        from filemq.ops.metrics_http import serve_loop_metrics

        return serve_loop_metrics(lambda: render_text(broker_families(broker)), config.broker.metrics_port)

    b = config.broker
    return await serve_until_signalled(
        lambda: Broker(config), name="broker", where=f"{b.host}:{b.port} (data dir {config.data_dir})",
        describe=describe, log=log, ready=ready, stop=stop, sidecar=metrics, status=backlog_status)


def run_broker(config: Config, ready: Callable[[str], None] | None = None) -> int:
    """Run the broker in a new event loop (``broker.event_loop``: uvloop where installed) until
    SIGTERM/SIGINT; returns the exit code (2 for ``event_loop = "uvloop"`` without uvloop)."""
    tune_gc()
    return run_until_signalled(serve(config, ready), name="broker", log=log, event_loop=config.broker.event_loop,
                               tls=serves_tls(config))
