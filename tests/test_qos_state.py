"""The session's QoS state (filemq/broker/session/connection.py ``QosState``) on its own: packet ids and
the QoS 2 id sets, with no core, loop or socket.  The exchanges through the core are
tests/test_broker_qos_machine.py's; the bytes of a connection, tests/test_connection_machine.py's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.broker.session.inflight import Outbound
from filemq.broker.session.qos_state import QosState

_IDS = st.integers(min_value=1, max_value=0xFFFF)


def _entry() -> Outbound:
    return Outbound(0, None, 1, "t", b"", None)


@settings(max_examples=300, deadline=None)
@given(start=_IDS, used=st.sets(_IDS, max_size=40), n=st.integers(min_value=1, max_value=70))
def test_a_block_of_ids_is_what_one_id_at_a_time_would_give_mqtt_2_3_1_2(start: int, used: set[int], n: int) -> None:
    """``take_pids(n)`` (the delivery planner's run path) takes exactly the ids n calls of
    ``alloc_pid`` (its per-record loop) would take, or none; and no id in use is ever given
    again (MQTT-2.3.1-2: a new PUBLISH has an id not in use)."""
    block, single = QosState(), QosState()
    for q in (block, single):
        q.next_pid = start
        q.inflight.update(dict.fromkeys(used, _entry()))
    first = block.take_pids(n)
    ids = []
    for _ in range(n):
        pid = single.alloc_pid()
        assert pid not in single.inflight and 1 <= pid <= 0xFFFF
        single.inflight[pid] = _entry()
        ids.append(pid)
    if first:
        assert list(range(first, first + n)) == ids
        assert block.next_pid == single.next_pid
    else:
        # No block: one of the ids is in use or the block would wrap past 65535.
        assert start + n > 0x10000 or not used.isdisjoint(range(start, start + n))
        assert block.next_pid == start


def test_a_delivery_too_large_to_send_takes_no_id() -> None:
    """``free_pid`` looks, ``take_pid`` takes: a PUBLISH over the client's Maximum Packet
    Size (MQTT-3.1.2-25) is discarded before its id is taken, so the next one gets it."""
    q = QosState()
    q.next_pid = 0xFFFF
    q.inflight[0xFFFF] = _entry()
    assert q.free_pid() == 1 and q.free_pid() == 1  # (wraps past 65535; looking takes nothing)
    q.take_pid(1)
    assert q.next_pid == 2


class _Done:
    def __init__(self, failed: bool = False, pending: bool = False) -> None:
        self.failed, self.pending = failed, pending

    def done(self) -> bool:
        return not self.pending

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return OSError("commit failed") if self.failed else None


def test_inbound_qos2_ids_reach_the_session_file_only_once_committed_4_3_3() -> None:
    """An inbound QoS 2 id is held from its append until PUBREL; only ids whose record is
    committed go to the session file (an id on disk without its record would make the re-sent
    PUBLISH look like a duplicate and lose it)."""
    q = QosState()
    q.stored_qos2(1, _Done(), 10)
    q.stored_qos2(2, _Done(pending=True), 11)
    q.stored_qos2(3, _Done(failed=True), 12)
    q.dropped_qos2(4)  # acknowledged and dropped: no record, held all the same
    assert set(q.qos2_in) == {1, 2, 3, 4}
    assert q.durable_qos2_in() == {1, 4}
    assert q.released_qos2(1) is True and q.released_qos2(1) is False  # (a PUBREL again: unknown)
    assert 1 not in q.qos2_offsets and q.durable_qos2_in() == {4}


def test_outbound_qos2_exchange_and_the_restart_4_4() -> None:
    """PUBLISH -> PUBREC -> PUBCOMP of a persistent session's delivery, and the ids a session
    file gives back: PUBREC'd ids are in flight again, awaiting PUBCOMP, with only their PUBREL
    to re-send (4.4, MQTT-4.4.0-1)."""
    q = QosState()
    pid = q.alloc_pid()
    out = q.inflight[pid] = Outbound(5, None, 2, "t", b"m", None)
    q.qos2_sent[pid] = 5
    assert QosState.expected_ack(out) == "PUBREC"
    q.received(out, pid, persistent=True)
    assert QosState.expected_ack(out) == "PUBCOMP" and q.qos2_out == {pid}
    assert q.completed(pid) is True  # the session file named it: written again
    assert pid not in q.inflight and not q.qos2_out and not q.qos2_sent

    back = QosState()
    back.restore({7}, {7: 3}, {9})
    assert back.qos2_loaded == {7} and back.qos2_in == {7: None} and back.qos2_offsets == {7: 3}
    assert list(back.inflight) == [9] and QosState.expected_ack(back.inflight[9]) == "PUBCOMP"
    assert back.completed(9) is True and not back.inflight
