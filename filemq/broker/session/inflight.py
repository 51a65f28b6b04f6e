"""The entries of an MQTT session's outbound in-flight window (4.1: "QoS 1 and QoS 2 messages
which have been sent to the Client, but have not been completely acknowledged"), held by
:class:`~filemq.broker.session.connection.QosState`: what was sent under each packet id, so that an
acknowledgement can complete it and a reconnect can re-send it (4.4).

Three shapes of one thing: :class:`Outbound` (any delivery, QoS 1 or 2, of a group record or a
retained message), :class:`SentRecord` and :class:`SentRun` (the QoS 1 deliveries of a run, as
the delivery planner's C-loop path makes them: a tuple per record, or one object for a gap-free
run).  They read alike (``qos``, ``stage``, ``retain``, ``headers``, ``group``, ``share``);
:func:`message_of` gives any entry's topic and payload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, NamedTuple

from filemq.common.native import mypyc_attr
from segments.record import Record

if TYPE_CHECKING:
    from filemq.queue.groups import ConsumerGroup


class Outbound:
    """A QoS 1/2 PUBLISH sent to the client and not yet completed."""

    __slots__ = ("offset", "group", "qos", "topic", "payload", "share", "stage", "retain", "headers")

    def __init__(
        self, offset: int, group: ConsumerGroup | None, qos: int, topic: str, payload: bytes,
        share: str | None, retain: bool = False, headers: bytes = b"",
    ) -> None:
        self.offset = offset
        self.group = group  # None: a retained-message delivery, not a group record
        self.qos = qos
        self.topic = topic
        self.payload = payload
        self.share = share
        self.stage = 0  # 0: PUBLISH sent; 1: PUBREC received, PUBREL sent (QoS 2)
        self.retain = retain
        self.headers = headers  # the record's MQTT 5 message properties (re-sent with it)


class _SentFields(NamedTuple):
    offset: int
    group: ConsumerGroup | None
    topic: str
    payload: bytes
    share: str | None


@mypyc_attr(native_class=False)  # a tuple subclass (compiled builds cannot make it native)
class SentRecord(_SentFields):
    """A QoS 1 PUBLISH of a group record sent to the client and not yet acknowledged, as
    :meth:`~filemq.broker.delivery.Delivery._deliver`'s run path builds it: a tuple, so a run of them is made
    in C (``tuple.__new__`` over ``zip``) instead of one :class:`Outbound` ``__init__`` per
    record.  It reads like an :class:`Outbound`; what the run path never varies (QoS 1, stage
    0: never a QoS 2 delivery; not retained; no properties) are class attributes, not fields."""

    __slots__ = ()
    qos: ClassVar[int] = 1
    stage: ClassVar[int] = 0
    retain: ClassVar[bool] = False
    headers: ClassVar[bytes] = b""


class SentRun:
    """The QoS 1 PUBLISHes of one gap-free run of a group's records, sent to the client with
    consecutive packet ids and not yet all acknowledged: ``QosState.inflight`` maps each of
    the run's ids to this one object, so a run costs one object, not one :class:`SentRecord`
    per message (:meth:`~filemq.broker.delivery.Delivery._deliver_run`).  The message with packet id ``pid`` is
    ``records[pid - first_pid]`` at offset ``pid + delta``.  Like a SentRecord: QoS 1, stage
    0, not retained, no properties."""

    __slots__ = ("delta", "group", "records", "first_pid", "share")
    qos: ClassVar[int] = 1
    stage: ClassVar[int] = 0
    retain: ClassVar[bool] = False
    headers: ClassVar[bytes] = b""

    def __init__(self, delta: int, group: ConsumerGroup, records: list[Record], first_pid: int,
                 share: str | None) -> None:
        self.delta = delta
        self.group = group
        self.records = records
        self.first_pid = first_pid
        self.share = share

    def record(self, pid: int) -> Record:
        """The record sent with packet id ``pid`` (one of this run's ids)."""
        return self.records[pid - self.first_pid]


Inflight = Outbound | SentRecord | SentRun



def message_of(out: Inflight, pid: int) -> tuple[str, bytes]:
    """(topic, payload) of in-flight entry ``out`` under packet id ``pid``."""
    if type(out) is SentRun:
        r = out.record(pid)
        return r.topic, r.payload
    return out.topic, out.payload  # type: ignore[union-attr]
