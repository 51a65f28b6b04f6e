"""Fewer wake-ups for a subscriber's one-by-one acks: ``SO_RCVLOWAT`` (Linux).

A client that answers each PUBLISH with a PUBACK in a send of its own, with ``TCP_NODELAY``
(a raw-socket client, many small MQTT libraries), sends each PUBACK as a TCP segment of its
own, and the kernel wakes the broker for nearly every few: with ten such subscribers, one read
(an event-loop turn, a ``read``, an ACK segment) per ~5 PUBACKs, ~0.19 reads per delivery
against ~0.03 with clients that ack a read's PUBLISHes in one send.  But a read of acks that
leaves the window above its refill mark (a quarter of it, :meth:`QosAcks._refill`)
writes nothing back: the broker woke for nothing it could act on.

So after such a read, :class:`AckBatcher` sets the socket's ``SO_RCVLOWAT`` to the bytes the
acks it waits for take at the least (4 per ack: a PUBACK, PUBREC or PUBCOMP without reason
code or properties, 4.1 in MQTT 5), and the kernel wakes the broker once they are all there,
for one read and one refill; back at the mark (or below), it is 1 again.  Every byte on the
wire counts towards the mark, so a client's other packets (a PINGREQ, a PUBLISH) bring the
read forward, never back.  Measured 2026-11-27 (docs/PERFORMANCE.md, "Fewer wake-ups for
one-by-one acks"): -15 % broker CPU per delivery and a higher rate, with ten such subscribers
and with one.

Only for clients whose segments are small (fewer than :data:`SMALL_SEGMENT` bytes each on
average over the last :data:`SAMPLE_READS` reads, from ``TCP_INFO``): a client that acks in
bulk (many PUBACKs per segment) already wakes the broker once per batch, and holding its acks
would only hold back the window room that lets new messages out between refills (measured:
-9 % rate with the loadgen's clients when it applied to all).  A client with Nagle's
algorithm on sends its PUBACKs, after the first, only when the broker's ACK comes, which
waits for a read (filemq.broker.pacing): its segments carry many PUBACKs, and it stays out.

Nothing waits long: a broker-wide sweep every :data:`SWEEP_S` sets the mark back to 1 on every
socket not read for that long (a client that stopped acking half-way, a PINGREQ behind the
mark, a client whose congestion window holds back its next segments until an ACK), and the
kernel then wakes the broker for whatever is there: a socket read just after one sweep is
caught by the one after next at the latest, so a stall lasts under two sweeps (4 ms) plus
however late the loop runs its timers.  A FIN wakes it at once, whatever the
mark.  Reads only move later (by at most that), so nothing changes in what is delivered,
acknowledged or stored; acks still in the kernel at a crash are re-delivered, inside the
in-flight window as before.  ``[broker] ack_batching = false`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from typing import Any

from filemq.broker.pacing import tcp_socket
from filemq.broker.qos import refill_mark

log = logging.getLogger("filemq.broker")

_RCVLOWAT: int | None = getattr(socket, "SO_RCVLOWAT", None)
_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None)
# struct tcp_info (linux/tcp.h): tcpi_bytes_received (u64) at 128, tcpi_data_segs_in (u32) at
# 152 (Linux 4.6 and later).  A shorter answer means an older kernel: no batching.
_INFO_LEN = 156
_bytes_received = struct.Struct("=Q").unpack_from
_segs_in = struct.Struct("=I").unpack_from

ACK_BYTES = 4
"""The fewest bytes an ack that frees a window slot takes (fixed header 2, packet id 2)."""
SMALL_SEGMENT = 8
"""Average bytes per received data segment below which a client counts as acking one by one
(a PUBACK alone is 4 bytes; a Nagle client's segments, held until our ACK, carry ~10-90)."""
SAMPLE_READS = 64
"""Reads between two looks at the socket's ``TCP_INFO`` (one ``getsockopt`` each)."""
SWEEP_S = 0.002
"""The longest a raised mark stands without a read: then it is set back to 1."""
MAX_MARK = ACK_BYTES * 65535  # (a window is at most 65,535 messages; the kernel caps it at half its buffer too)


class AckBatcher:
    """One connection's receive low-water mark (see the module docstring)."""

    __slots__ = ("sock", "batching", "mark", "reads", "small", "sampled_bytes", "sampled_segs", "last_read")

    def __init__(self, sock: Any, batching: AckBatching) -> None:
        self.sock = sock  # the transport's socket (asyncio's TransportSocket, uvloop's PseudoSocket)
        self.batching = batching
        self.mark = 1  # the socket's SO_RCVLOWAT as last set
        self.reads = 0
        self.small = False  # the client's segments were small at the last sample
        self.sampled_bytes = 0
        self.sampled_segs = 0
        self.last_read = 0.0

    @classmethod
    def for_transport(cls, transport: asyncio.BaseTransport, batching: AckBatching) -> AckBatcher | None:
        """The transport's batcher; None without a TCP socket under it (a Unix socket, a test's
        fake transport) or without SO_RCVLOWAT and TCP_INFO on this system."""
        if _RCVLOWAT is None or _TCP_INFO is None:
            return None
        sock = tcp_socket(transport)
        return None if sock is None else cls(sock, batching)

    def after_read(self, inflight: int, window: int, now: float) -> bool:
        """After a read of the connection's (and the refill it brought, if any): ``inflight``
        messages in flight of a ``window``, at monotonic time ``now``.  Raises, lowers or
        clears the mark.  False when the socket refuses an option (the caller then drops the
        batcher; the mark is 1 again, or was never raised)."""
        self.last_read = now
        self.reads = reads = self.reads + 1
        if not reads % SAMPLE_READS and not self._sample():
            return False
        refill_at = refill_mark(window)
        want = min(ACK_BYTES * (inflight - refill_at), MAX_MARK) if self.small and inflight > refill_at else 1
        return want == self.mark or self.set_mark(want)

    def _sample(self) -> bool:
        """Whether the client's data segments since the last sample were small on average."""
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_LEN)
        except (OSError, ValueError) as exc:
            log.debug("TCP_INFO refused (%s): no ack batching on this connection", exc)
            self.set_mark(1)
            return False
        if len(info) < _INFO_LEN:
            self.set_mark(1)
            return False
        received, = _bytes_received(info, 128)
        segs, = _segs_in(info, 152)
        new_segs = segs - self.sampled_segs
        self.small = new_segs > 0 and received - self.sampled_bytes < SMALL_SEGMENT * new_segs
        self.sampled_bytes, self.sampled_segs = received, segs
        return True

    def set_mark(self, mark: int) -> bool:
        """Set the socket's SO_RCVLOWAT to ``mark`` bytes; False when it is refused."""
        assert _RCVLOWAT is not None
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, _RCVLOWAT, mark)
        except (OSError, ValueError) as exc:
            log.debug("SO_RCVLOWAT refused (%s): no ack batching on this connection", exc)
            self.batching.raised.discard(self)
            return False
        self.mark = mark
        if mark > 1:
            self.batching.raise_(self)
        else:
            self.batching.raised.discard(self)
        return True

    def close(self) -> None:
        """The connection is gone: forget it (its socket is closed with it)."""
        self.batching.raised.discard(self)


class AckBatching:
    """The broker's raised marks and the sweep that bounds how long each stands."""

    __slots__ = ("raised", "_handle", "sweeps")

    def __init__(self) -> None:
        self.raised: set[AckBatcher] = set()
        self._handle: asyncio.TimerHandle | None = None
        self.sweeps = 0  # marks set back by the sweep (tests, logs)

    def raise_(self, batcher: AckBatcher) -> None:
        self.raised.add(batcher)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(SWEEP_S, self.sweep)

    def sweep(self) -> None:
        """Set back the marks of sockets not read for SWEEP_S; runs while any mark is raised."""
        self._handle = None
        now = time.monotonic()  # (the clock of Connection.last_rx, which after_read is given)
        for batcher in [b for b in self.raised if now - b.last_read >= SWEEP_S]:
            self.sweeps += 1
            batcher.set_mark(1)  # (the kernel wakes the broker now if anything is there)
        if self.raised:
            self._handle = asyncio.get_running_loop().call_later(SWEEP_S, self.sweep)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.raised.clear()
