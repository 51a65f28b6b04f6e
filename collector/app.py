"""The ``filemq collector`` process: a :class:`~collector.server.Collector` run until
SIGTERM/SIGINT (SIGHUP reloads), with its operations HTTP port (/metrics, /api/fleet, /fleet,
:mod:`collector.ops`) when ``metrics_port`` is set.

Kept apart from :mod:`collector.server` so that the metrics module, which reads a collector's
counters, and the server never import each other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from collector.server import Collector
from filemq.broker.metrics import backlog_status
from filemq.common.config import Config
from filemq.ops.gctune import tune_gc
from filemq.ops.service import Sidecar, run_until_signalled, serve_until_signalled

log = logging.getLogger("collector.server")


async def serve_collector(
    config: Config,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Run a collector until ``stop`` or SIGTERM/SIGINT; returns the exit code."""

    def metrics(collector: Collector) -> Sidecar | None:
        c = config.collector
        if c.metrics_port is None:
            return None
        from collector.ops import start_ops_server

        return start_ops_server(collector, c.metrics_port, c.ops_host)

    c = config.collector
    return await serve_until_signalled(
        lambda: Collector(config), name="collector", where=f"{c.host}:{c.port} (data dir {config.data_dir})",
        describe=lambda collector: (f"filemq collector {collector.collector_id} listening on "
                                    f"{collector.broker.listening}, landing in {collector.landing_dir},"
                                    f" serving up to {collector.broker.config.broker.max_connections}"
                                    " device connections"),
        log=log, ready=ready, stop=stop, sidecar=metrics, status=lambda c: backlog_status(c.broker))


def run_collector(config: Config, ready: Callable[[str], None] | None = None) -> int:
    """``filemq collector``: run until SIGTERM/SIGINT in a new event loop; the exit code.

    The garbage collector is tuned as the broker's (filemq/ops/gctune.py): with thousands of
    devices connected a full collection walks every connection's objects while it holds the
    GIL, which the operations port's thread then waits for, and it costs CPU per landed row."""
    tune_gc()
    return run_until_signalled(serve_collector(config, ready), name="collector", log=log)
