"""Serving a Prometheus scrape endpoint for one custom collector (agent or collector).

``prometheus-client`` is imported only here and only when ``--metrics-port`` is given, so a
device install without it still runs. Values are read from the service's own counters at
scrape time; the hot path never touches prometheus-client.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.registry import Collector as PromCollector


@dataclass
class MetricsServer:
    """A running metrics endpoint; :meth:`shutdown` stops it."""

    server: WSGIServer
    thread: threading.Thread
    port: int

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(metrics: PromCollector, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``/metrics`` with ``metrics`` on a private registry at ``addr:port`` (0 = any free port)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(metrics)
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread, server.server_port)
