"""Serving a Prometheus scrape endpoint (agent, collector, broker).

Two ways, both reading the service's own counters at scrape time (the hot path never
touches them):

* :func:`serve_metrics` serves a ``prometheus-client`` custom collector (the agent's and the
  collector's); ``prometheus-client`` is imported only here and only when a metrics port is
  given, so a device install without it still runs.
* :func:`serve_loop_metrics` needs only the standard library (``filemq broker --metrics-port``
  on a device): each scrape asks the service's event loop for the text (state owned by the
  loop is read on the loop, never from the HTTP thread) and answers 503 if the loop does not
  answer within ``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.server
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from socketserver import BaseServer
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from prometheus_client.registry import Collector as PromCollector

log = logging.getLogger("filemq.metrics")

T = TypeVar("T")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class MetricsServer:
    """A running metrics endpoint; :meth:`shutdown` stops it."""

    server: BaseServer
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


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T], timeout: float) -> T:
    """Run ``fn`` on ``loop`` (from another thread) and return its result within ``timeout``."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # handed to the waiting thread
            done.set_exception(exc)

    loop.call_soon_threadsafe(call)
    return done.result(timeout)


def serve_loop_metrics(render: Callable[[], str], port: int, addr: str = "127.0.0.1",
                       timeout: float = 5.0) -> MetricsServer:
    """Serve ``GET /metrics`` at ``addr:port`` (0 = any free port) with ``render()``'s text,
    computed on the running event loop at each scrape. Call from that loop."""
    loop = asyncio.get_running_loop()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                self.send_error(404)
                return
            try:
                body = on_loop(loop, render, timeout).encode("utf-8")
            except Exception as exc:
                log.warning("metrics scrape failed: %r", exc)
                self.send_error(503, "metrics unavailable")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.debug("metrics %s: " + format, self.address_string(), *args)

    server = http.server.ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="filemq-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread, server.server_address[1])
