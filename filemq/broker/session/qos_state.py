"""One MQTT session's QoS 1/2 state, which outlives its network connections (MQTT 4.1): the
packet ids, the outbound in-flight window and the QoS 2 ids both ways (see the package's
docstring, :mod:`filemq.broker.session`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from filemq.broker.session.inflight import Inflight, Outbound

if TYPE_CHECKING:
    from filemq.broker.session.events import Commit


class QosState:
    """One MQTT session's QoS 1/2 state (4.1), which outlives its network connections: the
    packet ids, the outbound in-flight window (what was sent and is not completely
    acknowledged, as :mod:`filemq.broker.session.inflight` entries) and the QoS 2 ids both ways.  A
    :class:`~filemq.broker.session_state.SessionState` holds one (``state.qos``; the session
    registry writes it to the session file); the :class:`~filemq.broker.session.connection.Connection` the session is on counts
    its inbound QoS 2 ids against our Receive Maximum.

    The methods are the transitions of this state and nothing else: the broker's QoS part
    (:class:`~filemq.broker.qos.QosAcks`) calls them and carries out what a transition causes
    outside the session (a consumer group's ack, a session-file write, the window's refill),
    and the delivery planner takes its packet ids here."""

    __slots__ = ("inflight", "next_pid", "qos2_in", "qos2_offsets", "qos2_loaded", "qos2_out", "qos2_sent",
                 "resumed_offsets")

    def __init__(self) -> None:
        # Outbound: packet id -> what was sent under it, in the order first sent (re-sent in
        # that order after a reconnect, MQTT-4.4.0-1).
        self.inflight: dict[int, Inflight] = {}
        self.next_pid = 1  # where the search for a free packet id starts
        # Inbound QoS 2 ids waiting for PUBREL -> the commit of the stored record (None:
        # committed long ago, or loaded from the session file, which is exact).
        self.qos2_in: dict[int, Commit | None] = {}
        self.qos2_offsets: dict[int, int] = {}  # inbound QoS 2 id -> its record's offset
        self.qos2_loaded: set[int] = set()  # inbound ids read from the session file, not yet re-checked
        self.qos2_out: set[int] = set()  # outbound QoS 2 ids PUBREC'd, awaiting PUBCOMP (persistent)
        # Outbound QoS 2 PUBLISHes of the own group not completed: id -> offset (persistent
        # sessions; in the session file before the PUBLISH leaves, see session_store.py).
        self.qos2_sent: dict[int, int] = {}
        # Offsets of the own group put back in flight from qos2_sent at a restart (with their
        # old ids): the group's redelivery from Pending skips them (they are in flight).
        self.resumed_offsets: set[int] = set()

    # ---- packet ids: a new PUBLISH takes one not in use (MQTT-2.3.1-2) --------------------

    def free_pid(self) -> int:
        """The next free packet id from ``next_pid`` on (1..65535, wrapping), not yet taken: a
        delivery found too large to send (MQTT-3.1.2-25) takes none."""
        pid = self.next_pid
        inflight = self.inflight
        while pid in inflight:
            pid = pid % 0xFFFF + 1
        return pid

    def take_pid(self, pid: int) -> None:
        """Packet id ``pid`` (from :meth:`free_pid`) is used: the next search starts after it."""
        self.next_pid = pid % 0xFFFF + 1

    def alloc_pid(self) -> int:
        """The next free packet id, taken."""
        pid = self.free_pid()
        self.next_pid = pid % 0xFFFF + 1
        return pid

    def take_pids(self, n: int) -> int:
        """The first of ``n`` consecutive packet ids from ``next_pid`` on, taken, if all are
        free and do not wrap (the ids ``n`` calls of :meth:`alloc_pid` would give); else 0 and
        nothing taken."""
        pid = self.next_pid
        end = pid + n
        if end > 0x10000 or not self.inflight.keys().isdisjoint(range(pid, end)):
            return 0
        self.next_pid = end if end <= 0xFFFF else 1
        return pid

    # ---- outbound: PUBLISH -> PUBACK; PUBLISH -> PUBREC, PUBREL -> PUBCOMP (4.3) ------------

    @staticmethod
    def expected_ack(out: Inflight) -> str:
        """The acknowledgement in-flight entry ``out`` waits for (MQTT-4.8.0-1: any other is a
        protocol violation)."""
        return "PUBACK" if out.qos == 1 else ("PUBREC" if out.stage == 0 else "PUBCOMP")

    def refused(self, pid: int) -> bool:
        """A PUBREC with a failure reason code for QoS 2 delivery ``pid`` (still awaiting
        PUBREC): the exchange ends and the id is free again (MQTT 5, 4.3.3, MQTT-4.3.3-4).
        True if the session file named the id (it must be written again)."""
        del self.inflight[pid]
        return self.qos2_sent.pop(pid, None) is not None

    def received(self, out: Outbound, pid: int, persistent: bool) -> None:
        """PUBREC for QoS 2 delivery ``pid`` (``out``): PUBREL is next, PUBCOMP awaited.  A
        persistent session keeps the id awaiting PUBCOMP (3.1.2.4; its file is written before
        the record is acked, so after a restart the PUBREL is re-sent, 4.3.3 Method A)."""
        out.stage = 1
        if persistent:
            self.qos2_out.add(pid)

    def completed(self, pid: int) -> bool:
        """PUBCOMP for QoS 2 delivery ``pid``: the exchange is over, the id free.  True if the
        session file named the id (it must be written again)."""
        del self.inflight[pid]
        sent = self.qos2_sent.pop(pid, None) is not None
        if pid in self.qos2_out or sent:
            self.qos2_out.discard(pid)
            return True
        return False

    def release_only(self, pid: int) -> None:
        """In flight again after a restart: QoS 2 delivery ``pid``, whose PUBREL is all that is
        left to send (PUBREC'd before, its record gone, or not a group record); its PUBCOMP
        frees the id at the client (4.3.3)."""
        released = self.inflight[pid] = Outbound(-1, None, 2, "", b"", None)
        released.stage = 1

    # ---- inbound: PUBLISH -> PUBREC, PUBREL -> PUBCOMP (4.3.3) ----------------------------

    def stored_qos2(self, pid: int, commit: Commit, offset: int) -> None:
        """QoS 2 id ``pid`` was appended at ``offset``: held until PUBREL, so that a re-send is
        recognised and not stored twice."""
        self.qos2_in[pid] = commit
        self.qos2_offsets[pid] = offset

    def dropped_qos2(self, pid: int) -> None:
        """QoS 2 id ``pid`` acknowledged and not stored: held until PUBREL all the same."""
        self.qos2_in.setdefault(pid, None)

    def released_qos2(self, pid: int) -> bool:
        """PUBREL for inbound QoS 2 id ``pid``: the id is free (the client may reuse it after
        PUBCOMP).  True if it was held."""
        known = pid in self.qos2_in
        self.qos2_in.pop(pid, None)
        self.qos2_offsets.pop(pid, None)
        self.qos2_loaded.discard(pid)
        return known

    def durable_qos2_in(self) -> set[int]:
        """The inbound QoS 2 ids that may go to the session file: those whose record is
        committed (an id on disk without its record would make a re-sent PUBLISH look like a
        duplicate)."""
        return {
            pid for pid, f in self.qos2_in.items()
            if f is None or (f.done() and not f.cancelled() and f.exception() is None)
        }

    def restore(self, inbound: set[int], offsets: dict[int, int], outbound: set[int]) -> None:
        """The QoS 2 ids of a session file (a restart): inbound ids held until PUBREL, each
        re-checked against the log when re-sent (``qos2_loaded``); outbound ids PUBREC'd,
        whose PUBREL is re-sent on connect (4.4)."""
        self.qos2_in = dict.fromkeys(inbound)
        self.qos2_offsets = dict(offsets)
        self.qos2_loaded = set(inbound)
        for pid in outbound:
            self.release_only(pid)
        self.qos2_out = set(outbound)
