"""Prompt TCP ACKs for a subscriber's acknowledgements (PUBACK, PUBREC, PUBCOMP): TCP_QUICKACK.

The broker refills a subscriber's in-flight window in batches: once at most a quarter of it is
still in flight (:meth:`QosAcks._refill`), not after every ack.  So most reads of acks
write nothing back to the client, and the kernel sends its ACK of the client's segment when
its delayed-ACK timer runs out (40 ms on Linux), not at once on a PUBLISH.

A client that leaves Nagle's algorithm on (no ``TCP_NODELAY``: the socket default) and sends
each PUBACK in a send of its own holds its next PUBACKs until that ACK comes.  Before this
module every refill of such a client waited for the timer: 8,500 deliveries/s to ten of them,
against mosquitto's 170,000 (mosquitto writes a PUBLISH back for each PUBACK, and the ACK
rides on it).  Now, after a read of acks that shrank the window, :class:`AckPacer` sets
``TCP_QUICKACK`` on the socket, which sends the pending ACK at once: one system call per such
read, and the client's held PUBACKs come in one segment.

(``SO_RCVLOWAT``, to be woken once per refill instead of once per few PUBACKs, was tried
with this and not kept at first: with a 20 ms sweep to lower it, a client's congestion window,
counted in segments, held its PUBACKs back for that long at every start of a burst, since the
kernel ACKs small segments nobody reads only on its delayed-ACK timer.  It came back later
the same day in :mod:`filemq.broker.batching`, with a 2 ms sweep, a mark that follows each
read, and only for clients with small segments: not for Nagle clients, which wait for our
ACK and so for a read.)

This changes nothing in what is delivered or acknowledged, or when.  ``TCP_QUICKACK`` is a
Linux socket option; where it is missing (another system) or fails, the connection goes
without it.  ``[broker] ack_pacing = false`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

log = logging.getLogger("filemq.broker")

_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


def tcp_socket(transport: asyncio.BaseTransport) -> Any | None:
    """The TCP socket under ``transport`` (TLS included: the raw one); None for a Unix
    socket or a transport without one (a test's fake)."""
    sock = transport.get_extra_info("socket")
    if sock is None or getattr(sock, "type", None) != socket.SOCK_STREAM or \
            getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return None
    return sock


class AckPacer:
    """One connection's prompt ACKs (see the module docstring)."""

    __slots__ = ("sock",)

    def __init__(self, sock: Any) -> None:
        self.sock = sock  # the transport's socket (asyncio's TransportSocket, uvloop's PseudoSocket)

    @classmethod
    def for_transport(cls, transport: asyncio.BaseTransport) -> AckPacer | None:
        """The transport's pacer; None where there is no TCP socket under it (a Unix socket,
        a test's fake transport) or no TCP_QUICKACK on this system."""
        if _QUICKACK is None:
            return None
        sock = tcp_socket(transport)
        return None if sock is None else cls(sock)

    def acks_read(self, client_id: str) -> bool:
        """A read of acks shrank the window: send the kernel's pending ACK now.  False when
        the socket refuses the option (the caller then stops asking)."""
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
        except (OSError, ValueError) as exc:
            log.debug("client %r: TCP_QUICKACK refused (%s); its ACKs are left to the kernel", client_id, exc)
            return False
        return True
