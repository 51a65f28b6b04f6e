"""The vocabulary of the sans-I/O MQTT session (:mod:`filemq.broker.session.connection`): the events
:meth:`~filemq.broker.session.connection.Connection.receive_data` makes of a read, and :class:`Commit`,
what the session needs of the futures the broker's answers wait on.  Types only, no state: the
session's state is :class:`~filemq.broker.session.connection.Connection`'s and
:class:`~filemq.broker.session.connection.QosState`'s.

A packet that passed the session's checks is its own event (:class:`~filemq.mqtt.packets.Connect`,
:class:`~filemq.mqtt.packets.Publish`, the decoder's :class:`~filemq.mqtt.packets.PublishRun`,
:class:`~filemq.mqtt.packets.Puback` ...); a read's run of PUBLISHes and a read of bare PUBACKs
are one event each (:class:`Publishes`, :class:`Acks`), so batching is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from filemq.mqtt.packets import (
    Connect,
    Disconnect,
    Puback,
    Pubcomp,
    Publish,
    PublishRun,
    Pubrec,
    Pubrel,
    Subscribe,
    Unsubscribe,
)


class Commit(Protocol):
    """What a connection needs of a group commit's future (an asyncio.Future satisfies it):
    whether it resolved, and how."""

    def done(self) -> bool: ...

    def cancelled(self) -> bool: ...

    def exception(self) -> BaseException | None: ...


class Publishes:
    """Event: a run of PUBLISHes from one read, in order (MQTT 3.1.1; MQTT 5: QoS 1 ones
    without a topic alias, for which this connection's Receive Maximum has room)."""

    __slots__ = ("packets",)

    def __init__(self, packets: Sequence[Publish]) -> None:
        self.packets = packets


class Acks:
    """Event: a read of nothing but bare PUBACKs (what a subscriber sends back), as packet ids
    in order (sliced by :func:`~filemq.mqtt.pubacks.puback_ids`, not decoded one by one)."""

    __slots__ = ("ids",)

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = ids


# What :meth:`Connection.receive_data` makes of a read: each event's type names its handler.
Event = (Connect | Publish | PublishRun | Publishes | Acks | Puback | Pubrec | Pubrel | Pubcomp | Subscribe
         | Unsubscribe | Disconnect)
