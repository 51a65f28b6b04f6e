"""Admission: which accepted sockets the broker (and the collector) takes, and when it stops
accepting (issue 30 items 1 and 2; docs/BROKER.md, "Admission").

The broker owns its listening sockets and accepts from them itself, so that it can *stop
accepting*: while :class:`Admission`'s half-open set (sockets accepted, CONNECT not yet read
or its password still being checked) is full, the listening sockets are not read and the
kernel's listen backlog (``broker.listen_backlog``) holds the rest of a burst, each socket's
CONNECT waiting in its receive buffer.  Accepting resumes as soon as a CONNECT is read.
At most :data:`ACCEPT_PER_PASS` sockets are accepted per event-loop pass, so the CONNECTs
of the sockets just accepted are read before more are accepted.

A burst of real devices therefore never closes anyone: every socket in it has sent its
CONNECT, so no member of the set is *silent*.  Room is made only from sockets that have
sent nothing for :data:`SILENT_GRACE_S` (a CONNECT not begun, or begun and stalled): at the
limit, the socket silent the longest gives way, the sockets still in the listen backlog
included -- the kernel tells how long a socket accepted now has been silent since its
handshake (``TCP_INFO``), so a silent socket that waited in the backlog longer than every
member of the set is closed at its accept without taking a slot.  Sockets re-opened as fast
as they are closed therefore cycle through the backlog at the accept rate, and a device
behind them waits about :data:`SILENT_GRACE_S`, not until the attack stops.  When every
member is checking a password, the oldest check gives way once it has run that long.
Silence is the kernel's view (time since the last byte arrived; bytes waiting unread count
as speech), so a loaded loop that has not read a CONNECT yet never makes its sender silent.

Nothing here parses MQTT: a member is anything with ``state``, ``closed``, ``last_rx``,
``connected_at`` and ``close()`` (:class:`filemq.broker.session.connection.Connection`, a TLS
handshake).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable
from typing import Protocol

from filemq.broker.session.connection import AUTHENTICATING, AWAITING_CONNECT

log = logging.getLogger("filemq.broker")

SILENT_GRACE_S = 2.0
"""A half-open socket that sent nothing for this long may be closed to make room (a device
sends its CONNECT right after its handshake; a loaded client a little later)."""

ACCEPT_PER_PASS = 64
"""Sockets accepted per readiness event of a listening socket (then the loop reads)."""

RECHECK_S = 0.005
"""While not accepting: how often to look whether a slot came free."""

EMFILE_PAUSE_S = 0.1
"""Out of file descriptors: accepting pauses this long (the backlog holds the sockets)."""

CLOCK_SLACK_S = 0.05
"""Silences that differ by less than this count as equal (TCP_INFO's clock is coarse)."""


_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None)
# struct tcp_info (linux/tcp.h): tcpi_last_data_recv (u32, ms) at 52; tcpi_bytes_received
# (u64) at 128 (Linux >= 4.1).  For a socket that never received data, last_data_recv counts
# from the handshake (the child socket's creation).
_INFO_LEN = 136
_last_data_recv_ms = struct.Struct("=I").unpack_from
_unpack_i = struct.Struct("i").unpack
_INT0 = b"\0\0\0\0"
_bytes_received = struct.Struct("=Q").unpack_from


class HalfOpenMember(Protocol):
    """What admission needs of a socket it holds."""

    state: str
    closed: bool
    last_rx: float
    connected_at: float

    def close(self, reason: str, *, will: bool, level: int = logging.INFO) -> None: ...


class SocketLike(Protocol):
    """A transport's socket (asyncio's TransportSocket, uvloop's pseudo-socket)."""

    def fileno(self) -> int: ...

    def getsockopt(self, level: int, optname: int, buflen: int) -> bytes: ...


def last_byte_at(sock: SocketLike, now: float) -> float | None:
    """When the kernel last received a byte on ``sock`` (its handshake if none yet), on the
    ``time.monotonic`` clock of ``now``; ``now`` while bytes wait unread in its buffer (the
    client spoke, the loop has not read it yet); None without ``TCP_INFO``."""
    if _TCP_INFO is None:
        return None
    try:
        if _unpack_i(fcntl.ioctl(sock.fileno(), termios.FIONREAD, _INT0))[0] > 0:
            return now
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_LEN)
    except (OSError, TypeError, ValueError):
        return None
    if len(info) < _INFO_LEN:
        return None
    ms: int = _last_data_recv_ms(info, 52)[0]
    return now - ms / 1000


def silent_since(sock: socket.socket, now: float) -> float | None:
    """When ``sock`` (just accepted) completed its handshake, if it has received no byte
    since; None when it has received data, or without ``TCP_INFO`` (not Linux)."""
    if _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_LEN)
    except OSError:
        return None
    if len(info) < _INFO_LEN or _bytes_received(info, 128)[0] != 0:
        return None
    ms: int = _last_data_recv_ms(info, 52)[0]
    return now - ms / 1000


class AdmissionStats:
    """Counters (read only): what admission closed, and how often it stopped accepting."""

    __slots__ = ("silent_closed_at_accept", "evicted_silent", "evicted_authenticating", "paused")

    def __init__(self) -> None:
        self.silent_closed_at_accept = 0
        self.evicted_silent = 0
        self.evicted_authenticating = 0
        self.paused = 0


class Admission:
    """The half-open set (at most ``limit`` = ``max_connecting`` members, oldest first) and
    the listening sockets it gates.  One per broker, shared by all its listeners."""

    def __init__(self, limit: int, grace_s: float = SILENT_GRACE_S) -> None:
        self.limit = limit
        self.grace_s = grace_s
        # -> (silent since, its socket): since = the accept, or the handshake of a socket
        # accepted silent; the socket, when there is one, tells when its last byte arrived.
        self.members: dict[HalfOpenMember, tuple[float, SocketLike | None]] = {}
        self.accepting = 0  # accepted, connection_made not yet run
        self.stats = AdmissionStats()
        self._acceptors: list[Acceptor] = []
        self._paused = False
        self._recheck: asyncio.TimerHandle | None = None

    # ---- the set -------------------------------------------------------------------------

    def admit(self, member: HalfOpenMember, sock: SocketLike | None = None) -> None:
        """Register a socket the broker now serves (its protocol's ``connection_made``;
        ``sock``: its transport's socket, for the kernel's view of its silence).  Never
        closes anyone: room was made before the accept (a socket made outside an
        :class:`Acceptor`, as in tests, may take the set over its limit until it prunes)."""
        self.members[member] = (member.connected_at, sock)

    def _prune(self) -> None:
        for m in [m for m in self.members
                  if m.closed or (m.state != AWAITING_CONNECT and m.state != AUTHENTICATING)]:
            del self.members[m]

    def _activity(self, m: HalfOpenMember, now: float) -> float:
        """When ``m``'s last byte arrived (its handshake if none): the kernel's time where
        it has one (bytes still unread count: a loaded loop must not make a client that
        sent its CONNECT look silent), else the last read.  The kernel is asked only when
        the last read (or the accept) is more than the grace ago: a member read or accepted
        since cannot be silent that long (no system call in a burst of fresh sockets)."""
        since, sock = self.members[m]
        last = m.last_rx
        # A Connection's last_rx starts at its accept; it is later once a byte arrived.
        ours = last if last > m.connected_at else since
        if sock is not None and ours <= now - self.grace_s:
            arrived = last_byte_at(sock, now)
            if arrived is not None:
                return arrived
        return ours

    def _candidate(self, now: float) -> HalfOpenMember | None:
        """The member to close for a new socket: the one silent the longest, once silent
        for the grace; else, when every member is checking a password, the oldest check
        once it has run that long; else None (wait)."""
        best: HalfOpenMember | None = None
        best_at = now - self.grace_s
        authenticating = 0
        for m in self.members:
            if m.state == AWAITING_CONNECT:
                at = self._activity(m, now)
                # (the kernel's clock is coarse: near-ties go to the member accepted first)
                if at <= best_at if best is None else at < best_at - CLOCK_SLACK_S:
                    best, best_at = m, at
            else:
                authenticating += 1
        if best is None and authenticating == len(self.members) and self.members:
            oldest = next(iter(self.members))
            if oldest.last_rx <= now - self.grace_s:
                return oldest
        return best

    def room(self, now: float) -> bool:
        """Whether one more socket can be accepted now (pruning the set first)."""
        if len(self.members) + self.accepting < self.limit:
            return True
        self._prune()
        return len(self.members) + self.accepting < self.limit

    def make_room(self, now: float, newcomer_silent_since: float | None) -> bool:
        """At the limit, for a socket just accepted (``newcomer_silent_since``: since when it
        has been silent, None when it sent bytes): close the member silent the longest and
        return True (admit the newcomer); return False when the newcomer has been silent
        longer than every member that may give way (the caller closes it)."""
        if self.room(now):
            return True
        victim = self._candidate(now)
        if victim is None:
            return newcomer_silent_since is None
        if victim.state == AWAITING_CONNECT:
            victim_since = self._activity(victim, now)
            # (clearly longer: the kernel's clock counts in jiffies, up to 10 ms; on a tie the
            # member, accepted first, gives way, as the oldest did before)
            if newcomer_silent_since is not None and newcomer_silent_since < victim_since - CLOCK_SLACK_S:
                return False
            self.stats.evicted_silent += 1
            reason = (f"max_connecting ({self.limit}) half-open sockets reached; this one sent nothing "
                      f"for {now - victim_since:.1f} s and makes room for a new one")
        else:
            if newcomer_silent_since is not None:
                return False  # a silent socket does not cut a password check short
            self.stats.evicted_authenticating += 1
            reason = (f"max_connecting ({self.limit}) half-open sockets reached, all checking passwords; "
                      f"the oldest check makes room for a new socket")
        del self.members[victim]
        victim.close(reason, will=False, level=logging.INFO)
        return True

    def can_accept(self, now: float) -> bool:
        """Whether to accept now: a free slot, or a member that may give way."""
        return self.room(now) or self._candidate(now) is not None

    # ---- the listening sockets -----------------------------------------------------------

    def add(self, acceptor: Acceptor) -> None:
        self._acceptors.append(acceptor)

    def pause(self) -> None:
        """Stop reading every listening socket; look again every :data:`RECHECK_S`."""
        if not self._paused:
            self._paused = True
            self.stats.paused += 1
            for a in self._acceptors:
                a.stop_reading()
        self._schedule_recheck(RECHECK_S)

    def _schedule_recheck(self, delay: float) -> None:
        if self._recheck is None:
            self._recheck = asyncio.get_running_loop().call_later(delay, self._on_recheck)

    def _on_recheck(self) -> None:
        self._recheck = None
        if not self._paused:
            return
        if self.can_accept(time.monotonic()):
            self._paused = False
            for a in self._acceptors:
                a.start_reading()
        else:
            self._schedule_recheck(RECHECK_S)

    def pause_for(self, seconds: float) -> None:
        """Stop accepting for ``seconds`` (out of file descriptors)."""
        if not self._paused:
            self._paused = True
            self.stats.paused += 1
            for a in self._acceptors:
                a.stop_reading()
        self._schedule_recheck(seconds)

    def close(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        for a in self._acceptors:
            a.close()


def bind_listening_sockets(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening TCP sockets for ``host``:``port`` as ``loop.create_server`` binds them
    (every address ``host`` resolves to, all interfaces for ``""``; ``SO_REUSEADDR``;
    ``IPV6_V6ONLY``), listening with ``backlog`` (the kernel caps it at
    ``net.core.somaxconn``).  Raises OSError."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, type_, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, type_, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                raise OSError(exc.errno, f"error while attempting to bind on address {addr!r}: "
                              f"{(exc.strerror or str(exc)).lower()}") from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


class Acceptor:
    """Accepts from listening sockets while :class:`Admission` has room and hands each
    socket to ``factory(accepted_at)``'s protocol (``loop.connect_accepted_socket``: the
    same transports ``create_server`` makes, on asyncio and on uvloop).  ``accepted_at`` is
    now, or for a socket that has sent nothing yet its handshake: a socket's CONNECT
    deadline and its silence count from there, not from when the backlog gave it up."""

    def __init__(self, socks: list[socket.socket], factory: Callable[[float], asyncio.Protocol],
                 admission: Admission) -> None:
        self.sockets = socks
        self.factory = factory
        self.admission = admission
        self._loop = asyncio.get_running_loop()
        self._reading = False
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        admission.add(self)

    def start_reading(self) -> None:
        if not self._reading and not self._closed:
            self._reading = True
            for s in self.sockets:
                self._loop.add_reader(s.fileno(), self._on_readable, s)

    def stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            for s in self.sockets:
                self._loop.remove_reader(s.fileno())

    def _on_readable(self, listening: socket.socket) -> None:
        admission = self.admission
        for _ in range(ACCEPT_PER_PASS):
            now = time.monotonic()
            if not admission.can_accept(now):
                admission.pause()
                return
            try:
                sock, _addr = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("accepting a connection failed: %s; not accepting for %.1f s (the listen "
                                "backlog holds the sockets meanwhile)", exc, EMFILE_PAUSE_S)
                    admission.pause_for(EMFILE_PAUSE_S)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue  # gone before the accept
                raise
            since = silent_since(sock, now)
            if not admission.make_room(now, since):
                admission.stats.silent_closed_at_accept += 1
                _abort(sock)
                continue
            sock.setblocking(False)
            admission.accepting += 1
            task = self._loop.create_task(self._serve(sock, now if since is None else min(since, now)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket, accepted_at: float) -> None:
        try:
            protocol = self.factory(accepted_at)
            await self._loop.connect_accepted_socket(lambda: protocol, sock)
        except Exception as exc:  # noqa: BLE001 - one socket failing must not stop accepting
            log.info("setting up an accepted connection failed: %s", exc)
            with contextlib.suppress(OSError):
                sock.close()
        finally:
            self.admission.accepting -= 1

    def close(self) -> None:
        """Stop accepting and close the listening sockets (served connections stay)."""
        self.stop_reading()
        self._closed = True
        for s in self.sockets:
            s.close()


_LINGER_0 = struct.pack("ii", 1, 0)


def _abort(sock: socket.socket) -> None:
    """Close with a reset (no TIME_WAIT left here for a socket that never spoke)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
    sock.close()
