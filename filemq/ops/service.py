"""Running one long-lived service (broker, agent, collector) in a process until a signal.

The one place that owns the process contract the commands share: start, install
SIGTERM/SIGINT handlers, announce a ready line, wait, stop cleanly, and map what happened to
the exit code — 0 after a clean shutdown, 2 for a configuration problem, 1 for a runtime
failure (port in use, metrics port taken, an error while stopping). Problems are logged in
words a person can act on. SIGHUP calls the service's ``reload()`` where it has one and never
ends it.

Under systemd (``Type=notify``, docs/DEPLOYMENT.md) it sends ``READY=1`` once the service has
recovered and listens (and its metrics endpoint is up), ``STATUS=`` with the backlog every
few seconds, ``WATCHDOG=1`` from the event loop at half of ``WatchdogSec=`` (so a wedged loop
stops pinging and systemd restarts it) and ``STOPPING=1`` when shutdown begins
(:mod:`filemq.ops.sdnotify`; tests/test_sdnotify.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from filemq.common.config import ConfigError
from filemq.ops import sdnotify
from filemq.ops.eventloop import loop_factory

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_CONFIG = 2
STATUS_INTERVAL_S = 10.0  # STATUS= refresh period when the watchdog does not ping more often


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Sidecar(Protocol):
    """Something started next to the service (the metrics HTTP server) and shut down after it."""

    def shutdown(self) -> None: ...


S = TypeVar("S", bound=Service)


async def serve_until_signalled(
    make: Callable[[], S],
    *,
    name: str,
    where: str,
    describe: Callable[[S], str],
    log: logging.Logger,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    sidecar: Callable[[S], Sidecar | None] | None = None,
    status: Callable[[S], str] | None = None,
) -> int:
    """Build and start the service, call ``ready(describe(service))`` once it is up, run until
    ``stop`` is set or SIGTERM/SIGINT arrives, then stop it; returns the exit code.

    ``where`` says what the service tried to bind (``"127.0.0.1:1883 (data dir /x)"``) for the
    error a person reads when start-up fails; ``sidecar`` starts an optional companion after the
    service (an ``OSError`` from it stops the service and exits 1); ``status`` gives the
    one-line ``STATUS=`` systemd shows (the backlog).
    """
    loop = asyncio.get_running_loop()
    early_hup: list[bool] = []  # a SIGHUP while starting: never fatal; reloaded once up
    if hasattr(signal, "SIGHUP"):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, early_hup.append, True)
    try:
        service = make()
        await service.start()
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return EXIT_CONFIG
    except OSError as exc:
        log.error("cannot start the %s on %s: %s", name, where, exc)
        return EXIT_RUNTIME
    extra: Sidecar | None = None
    if sidecar is not None:
        try:
            extra = sidecar(service)
        except OSError as exc:
            log.error("cannot start the %s's metrics server: %s", name, exc)
            await service.stop()
            return EXIT_RUNTIME
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Not possible outside the main thread (tests serve in one): Ctrl-C still works there.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    reload = getattr(service, "reload", None)
    if callable(reload) and hasattr(signal, "SIGHUP"):
        # SIGHUP (`systemctl reload`) re-reads the files the service names; it never ends it.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, _reload, reload, name, log)
        if early_hup:
            _reload(reload, name, log)
    elif hasattr(signal, "SIGHUP"):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGHUP)
    line = describe(service)
    log.info("%s", line)
    if ready is not None:
        ready(line)
    pinger = _start_systemd_pings(service, line, status, log)
    try:
        await stop.wait()
    finally:
        log.info("%s shutting down", name)
        if pinger is not None:
            pinger.cancel()
            sdnotify.notify("STOPPING=1", f"STATUS={name} shutting down")
        try:
            await service.stop()
        except Exception:
            log.exception("error during %s shutdown", name)
            return EXIT_RUNTIME
        finally:
            if extra is not None:
                extra.shutdown()
    return EXIT_OK


def _reload(reload: Callable[[], object], name: str, log: logging.Logger) -> None:
    log.info("SIGHUP: the %s reloads its files", name)
    try:
        reload()
    except Exception:
        log.exception("reloading the %s failed; what was in force stays in force", name)


def _start_systemd_pings(service: S, line: str, status: Callable[[S], str] | None,
                         log: logging.Logger) -> asyncio.Task[None] | None:
    """Tell systemd we are ready; keep STATUS= fresh and ping the watchdog from this loop."""
    def status_line() -> str:
        try:
            return status(service) if status is not None else line
        except Exception:  # a status is information, never a reason to stop
            log.exception("computing the systemd status failed")
            return line

    if not sdnotify.notify("READY=1", f"STATUS={status_line()}"):
        return None  # not under systemd (or it does not listen): nothing to ping
    watchdog = sdnotify.watchdog_interval()
    period = min(watchdog, STATUS_INTERVAL_S) if watchdog is not None else STATUS_INTERVAL_S

    async def ping() -> None:
        while True:
            await asyncio.sleep(period)
            if watchdog is not None:
                sdnotify.notify("WATCHDOG=1", f"STATUS={status_line()}")
            else:
                sdnotify.notify(f"STATUS={status_line()}")

    if watchdog is not None:
        log.info("systemd watchdog: pinging every %.1f s", watchdog)
    return asyncio.create_task(ping(), name="filemq-systemd-notify")


def run_until_signalled(main: Coroutine[Any, Any, int], *, name: str, log: logging.Logger,
                        event_loop: str = "asyncio", tls: bool = False) -> int:
    """Run ``main`` (a :func:`serve_until_signalled` call) in a new event loop, the one
    ``event_loop`` names (:func:`filemq.ops.eventloop.loop_factory`: ``auto`` = uvloop where
    installed; ``tls``: the service has a TLS listener); the exit code (2 if that loop cannot
    be had)."""
    try:
        loop_name, factory = loop_factory(event_loop, tls=tls)
    except ConfigError as exc:
        main.close()  # never awaited
        log.error("%s", exc)
        return EXIT_CONFIG
    log.info("%s: event loop %s", name, loop_name)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return EXIT_RUNTIME
    except Exception:
        log.exception("the %s failed", name)
        return EXIT_RUNTIME
