"""systemd readiness and watchdog: the ``NOTIFY_SOCKET`` datagram protocol, spoken directly.

A service started by systemd with ``Type=notify`` gets ``NOTIFY_SOCKET`` (a path, or an
abstract socket name starting with ``@``) and, with ``WatchdogSec=``, ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``). It sends newline-separated ``KEY=VALUE`` assignments in one datagram per
message: ``READY=1``, ``STOPPING=1``, ``STATUS=...``, ``WATCHDOG=1`` (sd_notify(3)). Outside
systemd (no ``NOTIFY_SOCKET``) every call is a no-op, so nothing here needs systemd or a
library on the device.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("filemq.ops.sdnotify")


def notify(*assignments: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``assignments`` (``"READY=1"``, ``"STATUS=..."``) to ``$NOTIFY_SOCKET`` as one datagram.

    Returns True when sent; False when there is no socket to tell (not under systemd) or the
    send failed (logged at debug level: a service must not fail because systemd went away).
    Never blocks: the call runs on the event loop, and a datagram socket whose queue is full
    (a stalled listener) would otherwise wedge it; such a message is dropped.
    """
    address = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not address or address[0] not in "/@":
        return False  # unset, or a vsock address (not used for services on a device)
    target = "\0" + address[1:] if address[0] == "@" else address
    message = "\n".join(a.replace("\n", " ") for a in assignments).encode("utf-8")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.connect(target)
            sock.sendall(message)
    except OSError as exc:
        log.debug("sd_notify to %s failed: %s", address, exc)
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC``, or None when the
    watchdog is off (unset, not a positive number, or ``$WATCHDOG_PID`` names another process)."""
    env = os.environ if env is None else env
    pid = env.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None
