"""The collector's operations HTTP port (``collector.metrics_port``, on ``collector.ops_host``).

Routes (all ``GET``):

``/metrics``
    Prometheus text: the door and lander counters and the fleet aggregates
    (:mod:`collector.metrics`).
``/api/fleet``
    JSON: ``devices`` (one object per device, :meth:`collector.fleet.FleetRegistry.summary`),
    ``counts`` by state, ``collector_id``, ``generated_at`` and ``landing_rate`` (rows landed
    per second over the last hour, one point per 10 s).
``/api/fleet/<device>``
    JSON: one device with its streams, latest health report and recent history; 404 if unknown.
``/fleet``
    The fleet page (``collector/assets/``: no CDN, nothing fetched from elsewhere).

What a caller may rely on:

* **Same logins as the devices.** With ``collector.password_file`` set, every route needs
  HTTP Basic credentials of a user in that file (401 otherwise), checked by the same
  :class:`filemq.broker.auth.PasswordFile` as MQTT logins; the file is read again when it
  changes. With a TLS certificate configured (``broker.tls_cert``/``tls_key``), the port
  speaks HTTPS only, so the password never crosses the network in clear.
* **Loopback by default**: ``collector.ops_host`` is ``127.0.0.1`` unless set.
* The registry is read on the collector's event loop (never from the HTTP threads); a loop
  that does not answer within 5 s gives 503.
* ``/api/fleet``'s body is built on the loop when asked for, at most every 2 s
  (:class:`collector.fleet.CachedBody`), and served as bytes from the HTTP thread; a request
  that finds it older waits up to 20 ms for a new one, and a loop too busy with thousands of
  devices to build it by then gets the last one (up to 60 s old; ``generated_at`` says when)
  while the new one is built. A client that accepts gzip (a browser) gets it gzip-compressed,
  once per body, in the HTTP thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import http.server
import json
import logging
import os
import ssl
import threading
import urllib.parse
from importlib import resources
from typing import TYPE_CHECKING

from collector.metrics import CollectorMetrics
from filemq.broker.auth import PasswordFile
from filemq.common.config import is_loopback
from filemq.ops.metrics_http import CONTENT_TYPE, MetricsServer, on_loop

if TYPE_CHECKING:
    from collector.server import Collector

log = logging.getLogger("collector.ops")

LOOP_TIMEOUT_S = 5.0
FRESH_WAIT_S = 0.02  # how long /api/fleet waits for a new body before it serves the last one
ASSETS = {"fleet.html": "text/html; charset=utf-8", "fleet.js": "text/javascript; charset=utf-8",
          "fleet.css": "text/css; charset=utf-8"}


def _asset(name: str) -> bytes:
    return resources.files("collector").joinpath("assets", name).read_bytes()


class _Logins:
    """The password file, read again when its modification time changes."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: float | None = None
        self._file: PasswordFile | None = None
        if path is not None:
            self._current()  # a broken file fails start-up, as for the MQTT listener

    def _current(self) -> PasswordFile:
        assert self.path is not None
        stamp = os.stat(self.path).st_mtime
        with self._lock:
            if self._file is None or stamp != self._stamp:
                self._file = PasswordFile.load(self.path)
                self._stamp = stamp
            return self._file

    def allowed(self, header: str | None) -> bool:
        if self.path is None:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        try:
            return self._current().check(user, password)
        except Exception as exc:  # an unreadable file refuses everyone, loudly
            log.error("ops port: password file %s unreadable: %s", self.path, exc)
            return False


def start_ops_server(collector: Collector, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve the operations port for ``collector`` on ``addr:port`` (0 = any free port); call
    from the collector's event loop. Raises ConfigError for a bad password file, OSError if
    the port cannot be bound."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    loop = asyncio.get_running_loop()
    registry = CollectorRegistry()
    registry.register(CollectorMetrics(collector, loop))
    c = collector.config.collector
    logins = _Logins(c.password_file)
    b = collector.config.broker

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "filemq-collector"
        timeout = 30  # a socket idle this long (mid-handshake or mid-request) is closed

        def _send(self, code: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _json(self, value: object) -> None:
            self._send(200, json.dumps(value, separators=(",", ":")).encode(), "application/json")

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if not logins.allowed(self.headers.get("Authorization")):
                self._send(401, b"login required\n", "text/plain; charset=utf-8",
                           {"WWW-Authenticate": 'Basic realm="filemq collector", charset="UTF-8"'})
                return
            path = urllib.parse.urlsplit(self.path).path
            try:
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE)
                elif path == "/api/fleet":
                    cache = collector.fleet_api
                    body, fresh = cache.get()
                    if not fresh:
                        build = cache.build_on(loop)
                        try:
                            body = build.result(LOOP_TIMEOUT_S if body is None else FRESH_WAIT_S)
                        except TimeoutError:
                            # A loop busy with thousands of devices: the last body now (the new
                            # one is for a later request); none yet: 503 below.
                            if body is None:
                                raise
                    assert body is not None  # (fresh means there is one)
                    if "gzip" in (self.headers.get("Accept-Encoding") or ""):
                        self._send(200, cache.gzipped(body), "application/json",
                                   {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
                    else:
                        self._send(200, body, "application/json", {"Vary": "Accept-Encoding"})
                elif path.startswith("/api/fleet/"):
                    device = urllib.parse.unquote(path[len("/api/fleet/"):])
                    found = on_loop(loop, lambda: collector.fleet.detail(device), LOOP_TIMEOUT_S)
                    if found is None:
                        self._send(404, json.dumps({"error": f"unknown device {device!r}"}).encode(),
                                   "application/json")
                    else:
                        self._json(found)
                elif path in ("/", "/fleet", "/fleet/"):
                    self._send(200, _asset("fleet.html"), ASSETS["fleet.html"])
                elif path.startswith("/fleet/") and path[len("/fleet/"):] in ASSETS:
                    name = path[len("/fleet/"):]
                    self._send(200, _asset(name), ASSETS[name])
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
            except TimeoutError:
                self._send(503, b"the collector's event loop did not answer\n", "text/plain; charset=utf-8")
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.debug("ops %s: " + format, self.address_string(), *args)

    server = http.server.ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    if b.tls_cert is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(b.tls_cert, b.tls_key)
        # The handshake on the first read, in the request's own thread: a client that never
        # finishes it must not hold up the accepting thread and with it every other client.
        server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    if not is_loopback(addr) and (c.password_file is None or b.tls_cert is None):
        log.warning("collector %s: the operations port on %s:%d is reachable off this host %s: anyone who can"
                    " reach it reads the fleet; set collector.password_file and broker.tls_cert", collector.collector_id,
                    addr, server.server_address[1],
                    "without logins" if c.password_file is None else "with logins in clear text (no TLS)")
    thread = threading.Thread(target=server.serve_forever, name="filemq-collector-ops", daemon=True)
    thread.start()
    log.info("collector %s: operations port on %s://%s:%d (/metrics, /api/fleet, /fleet)%s", collector.collector_id,
             "https" if b.tls_cert else "http", addr, server.server_address[1],
             ", logins from " + c.password_file if c.password_file else "")
    return MetricsServer(server, thread, server.server_address[1])


start_metrics_server = start_ops_server
