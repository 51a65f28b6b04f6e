"""`QosAcks.on_pubacks`' bulk path is the per-PUBACK path, only faster (issue 16).

A read of more than ``_SMALL_READ`` (8) PUBACKs whose in-flight entries are all gap-free
run-path deliveries (:class:`SentRun`, one object per run) of one consumer group, or of at
least ``_BULK_ACKS`` (16) whose entries are all run-path deliveries with gaps
(:class:`SentRecord`, one per message) of one group, is acked with C-level maps and one
``ConsumerGroup.ack_many`` (filemq/broker/qos.py); a read of 2 to ``_SMALL_READ``
PUBACKs takes the per-id loop, whatever its entries, as one-id reads do.  These tests drive two brokers (the
``Harness`` of tests/broker_harness.py) through the same packets in lockstep: one as it
is, one whose ``on_pubacks`` acks the ids of each read one at a time (a one-id call never
takes the bulk path).  After every read both must hold the same in-flight messages, the same
group offsets (pending, doing) and outstanding records, and must have sent the subscriber the
same next deliveries: for random ack orders, repeated ids, unknown ids (MQTT 4.3.2: a PUBACK
completes the QoS 1 delivery it names; one for an id not in flight is ignored), PUBACK bytes
split into reads of random sizes, QoS 0/1 mixes and reconnects (redeliveries with DUP,
MQTT-3.3.1-1).  A shared subscription (a second group in the same read) has its own example
test: after a commit the broker wakes the session's group and the share's in an order it
leaves open (a set), so two brokers may give the two groups' messages different packet ids
and only a comparison by message holds there.

Not compared: a group's acks-since-last-write count (reset by the timed offset writes) and
its lazily trimmed order deque (``pending_offset`` is).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from filemq.broker import qos as qos_module
from filemq.broker.qos import QosAcks
from filemq.broker.session.connection import Connection
from filemq.broker.session.inflight import SentRecord, SentRun, message_of
from filemq.mqtt.codec import encode
from filemq.mqtt.packets import Puback, Publish, Subscribe
from filemq.queue.groups import ConsumerGroup
from tests.broker_harness import Client, Harness, run

TOPICS = ("t/a", "t/b", "s/a")  # s/...: also the shared subscription's, when there is one
SHARE = "$share/g/s/#"


def _bulk_reads(h: Harness) -> list[tuple[str, int]]:
    """Note, on ``h``'s core, the short reads of run-path ids that take the per-id loop
    ("short": 2 to _SMALL_READ PUBACKs, the first of a run) and the reads that qualify for
    the bulk path ("bulk") (the same calls)."""
    core = h.core
    bulk: list[tuple[str, int]] = []

    def on_pubacks(conn: Connection, pids: Sequence[int]) -> None:
        state = conn.session
        if state is not None and len(pids) > 1:
            outs = [state.qos.inflight.get(pid) for pid in pids]
            kind = {type(o) for o in outs}
            one_group = len({o.group for o in outs if o is not None}) == 1
            if len(pids) <= qos_module._SMALL_READ:
                if type(outs[0]) is SentRun:
                    bulk.append(("short", len(pids)))
            elif one_group and (kind == {SentRun} or (kind == {SentRecord} and len(pids) >= qos_module._BULK_ACKS)):
                bulk.append(("bulk", len(pids)))
        QosAcks.on_pubacks(core.qos, conn, pids)

    core.on_pubacks = on_pubacks
    return bulk


def _one_at_a_time(h: Harness) -> None:
    """Make ``h``'s core ack each id of a read of PUBACKs with its own call."""
    core = h.core

    def on_pubacks(conn: Connection, pids: Sequence[int]) -> None:
        for pid in pids:
            QosAcks.on_pubacks(core.qos, conn, (pid,))

    core.on_pubacks = on_pubacks


def _group_state(h: Harness) -> dict[str, Any]:
    """Each consumer group's offsets (pending, doing), outstanding records (and who holds
    them) and records due for redelivery.  (Not its acks-since-persist count: the periodic
    offset writes, timed, reset it.)"""
    return {name: (g.pending_offset, g.doing_offset, dict(g._outstanding), sorted(g._again))
            for name, g in sorted(h.queue._groups.items())}


def _message(o: Any, pid: int) -> tuple[Any, ...]:
    """The in-flight entry ``o`` under packet id ``pid``, without the id (a SentRun, one
    object for a whole run, as the one message it holds under ``pid``)."""
    offset = pid + o.delta if type(o) is SentRun else o.offset
    topic, payload = message_of(o, pid)
    return (type(o).__name__, offset, o.group.name if o.group is not None else None, o.qos, topic, payload,
            o.share, o.stage, o.retain, o.headers)


def _state(h: Harness, s: Client, keyed: bool) -> dict[str, Any]:
    """What an ack may change, and what the next deliveries depend on.  ``keyed``: in-flight
    messages by (group, offset) instead of by packet id (two groups' deliveries interleave
    in an order the broker leaves open, so their ids may differ between two brokers)."""
    state = s.conn.session
    assert state is not None
    if keyed:
        inflight: dict[Any, Any] = {(m[2], m[1]): m for m in map(_message, state.qos.inflight.values(), state.qos.inflight)}
    else:
        inflight = {pid: _message(o, pid) for pid, o in state.qos.inflight.items()}
    return {"inflight": inflight, "groups": _group_state(h), "next_pid": None if keyed else state.qos.next_pid,
            "closed": s.conn.closed, "close_reason": s.conn.close_reason}


def deliveries(packets: list[Any], keyed: bool) -> Any:
    out = [(type(p).__name__, p.packet_id, p.topic, p.payload, p.qos, p.dup) if isinstance(p, Publish)
           else repr(p) for p in packets]
    if not keyed:
        return out
    # Per group (t/...: the session's own, s/...: the shared one), in order, without ids.
    return {prefix: [d[2:] for d in out if isinstance(d, tuple) and d[2].startswith(prefix)] for prefix in "ts"}


class Pair:
    """The same subscriber on two brokers: ``bulk`` as built, ``single`` acking one id at a time."""

    def __init__(self, tmp: Path, window: int, share: bool) -> None:
        self.share = share
        self.sides: list[tuple[Harness, Client, Client]] = []
        for one_at_a_time in (False, True):
            h = Harness(Path(tempfile.mkdtemp(dir=tmp)), max_inflight=window)
            if one_at_a_time:
                _one_at_a_time(h)
            else:
                self.bulk_reads = _bulk_reads(h)
            self.sides.append((h, self._subscriber(h), h.connected("p")))
        self.published = 0
        self.last: Any = None

    def inflight(self, side: int) -> dict[int, Any]:
        state = self.sides[side][1].conn.session
        assert state is not None
        inflight: dict[int, Any] = state.qos.inflight
        return inflight

    @property
    def pending(self) -> list[int]:
        """The packet ids in flight to the subscriber on the bulk side."""
        return list(self.inflight(0))

    def unknown(self, pid: int) -> bool:
        return pid not in self.inflight(0) and pid not in self.inflight(1)

    def _subscriber(self, h: Harness) -> Client:
        c = h.client()
        c.connect("s", False)
        filters = [("t/#", 1)] + ([(SHARE, 1)] if self.share else [])
        c.send(Subscribe(1, filters))
        c.received()
        return c

    def _ids(self, side: int, ids: list[int]) -> list[int]:
        """``ids`` (the bulk side's) for ``side``: the same messages, by (group, offset)."""
        if side == 0 or not self.share:
            return ids
        mine = {(m[2], m[1]): pid for pid, m in ((pid, _message(o, pid)) for pid, o in self.inflight(1).items())}
        theirs = self.inflight(0)
        return [mine[_message(theirs[i], i)[2], _message(theirs[i], i)[1]] if i in theirs else i for i in ids]

    async def step(self, action: Any) -> None:
        """Apply ``action`` to both sides, settle, compare what each subscriber got and holds.

        ("publish", [(topic, qos), ...]), ("acks", ids, read sizes) or ("reconnect",)."""
        got: list[Any] = []
        journal: list[list[bool]] = [[], []]  # per read: did it mark the acks for the progress journal?
        # Both sides' ids for the acked messages, mapped before either side acks them.
        side_ids = [self._ids(i, action[1]) for i in range(2)] if action[0] == "acks" else []
        for i, (h, s, p) in enumerate(self.sides):
            if action[0] == "publish":
                for k, (topic, qos) in enumerate(action[1]):
                    p.send(Publish(topic, b"%d" % (self.published + k), qos,
                                   packet_id=self.published + k + 1 if qos else None))
                await h.commit()
            elif action[0] == "acks":
                data = b"".join(encode(Puback(pid)) for pid in side_ids[i])
                pos = 0
                for size in action[2]:
                    s.send_bytes(data[pos:pos + size])
                    pos += size
                    journal[i].append(h.core.delivery._acked or h.core.delivery._journal_scheduled)
                assert pos >= len(data)
            else:  # reconnect: the session's in-flight messages are re-sent with DUP
                s.conn.connection_lost()
                s = h.client()
                s.connect("s", False)
                self.sides[i] = (h, s, p)
            await h.settle()
            got.append(deliveries(s.received(), self.share))
        if action[0] == "publish":
            self.published += len(action[1])
        bulk, single = (_state(h, s, self.share) for h, s, _ in self.sides)
        assert got[0] == got[1], action
        assert bulk == single, (action, {k: (bulk[k], single[k]) for k in bulk if bulk[k] != single[k]})
        assert journal[0] == journal[1], action
        self.last = got[0]


@st.composite
def _acks(draw: st.DrawFn, pair: Pair) -> tuple[str, list[int], list[int]]:
    """PUBACKs for a random selection of the ids in flight in random order, with repeated and
    unknown ids mixed in, as bytes cut into reads of random sizes (mostly whole PUBACKs, so
    Connection.receive_data's fast path and the bulk path get them)."""
    pending = pair.pending
    some = st.lists(st.sampled_from(pending), unique=True) if pending else st.just([])
    chosen = draw(st.permutations(draw(st.one_of(st.just(pending), some))))
    extra = draw(st.one_of(st.just([]), st.lists(st.one_of(st.sampled_from(chosen) if chosen else st.nothing(),
                                                           st.integers(1, 0xFFFF).filter(pair.unknown)),
                                                 max_size=3)))
    ids = list(chosen)
    for x in extra:
        ids.insert(draw(st.integers(0, len(ids))), x)
    sizes: list[int] = []
    while sum(sizes) < 4 * len(ids):
        sizes.append(draw(st.one_of(st.just(4 * len(ids)), st.integers(1, 40).map(lambda n: 4 * n),
                                    st.integers(1, 7))))
    return "acks", ids, sizes


# All QoS 1 (the run path's SentRuns, SentRecords where s/a records leave gaps) or a mix
# (the per-record loop's Outbounds).
_publish = st.tuples(st.just("publish"), st.one_of(
    st.lists(st.tuples(st.sampled_from(TOPICS), st.just(1)), min_size=1, max_size=40),
    st.lists(st.tuples(st.sampled_from(TOPICS), st.sampled_from([0, 1, 1, 1])), min_size=1, max_size=40)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), window=st.integers(8, 80))  # (reads above session._PUBACK_RUN = 64 too)
def test_bulk_pubacks_leave_the_state_of_one_at_a_time_acks(tmp_path: Path, data: st.DataObject,
                                                             window: int) -> None:
    """MQTT 4.3.2 / 4.4: whatever the read boundaries, order, repeats and unknown ids, a read
    of PUBACKs acked on the bulk path leaves what acking its ids one at a time leaves: the
    same in-flight messages under the same ids, group offsets, and next deliveries."""
    async def main() -> None:
        pair = Pair(tmp_path, window, share=False)
        # A full window of run-path deliveries first, then anything.
        await pair.step(("publish", [("t/a", 1)] * data.draw(st.integers(window, window + 20), label="first")))
        for _ in range(data.draw(st.integers(1, 8), label="steps")):
            kind = data.draw(st.sampled_from(["publish", "acks", "acks", "acks", "reconnect"]), label="kind")
            if kind == "publish":
                await pair.step(data.draw(_publish, label="publish"))
            elif kind == "acks":
                await pair.step(data.draw(_acks(pair), label="acks"))
            else:
                await pair.step(("reconnect",))
        event(f"bulk path taken: {any(k == 'bulk' for k, _ in pair.bulk_reads)}")
        event(f"short read of a run taken: {any(k == 'short' for k, _ in pair.bulk_reads)}")
    run(main())


def test_a_read_of_fanout_pubacks_takes_the_bulk_path(tmp_path: Path) -> None:
    """The property above is not vacuous: a read of 20 PUBACKs (in shuffled order, one id
    repeated) of run-path deliveries goes through one ``ack_many`` and no per-record ``ack``,
    and leaves the same state and next deliveries as acking them one at a time."""
    async def main() -> None:
        pair = Pair(tmp_path, 40, False)
        await pair.step(("publish", [("t/a", 1)] * 50))
        bulk_state = pair.sides[0][1].conn.session
        assert bulk_state is not None and len(pair.pending) == 40
        assert all(type(o) is SentRun for o in bulk_state.qos.inflight.values())  # gap-free runs
        ids = pair.pending[:20]
        ids = ids[5:] + ids[:5] + ids[:1]
        with mock.patch.object(ConsumerGroup, "ack_many", autospec=True,
                               side_effect=ConsumerGroup.ack_many) as ack_many, \
                mock.patch.object(ConsumerGroup, "ack", autospec=True, side_effect=ConsumerGroup.ack) as ack:
            await pair.step(("acks", ids, [4 * len(ids)]))
        assert len(ids) >= qos_module._BULK_ACKS
        assert ack_many.call_count == 1  # the bulk side
        assert ack.call_count == 20  # the one-at-a-time side (its repeated id: not in flight any more)
    run(main())


def test_a_read_across_two_runs_and_a_short_read_take_one_ack_many_each(tmp_path: Path) -> None:
    """Gap-free runs (SentRun) are acked in bulk from _SMALL_READ + 1 PUBACKs a read on, also
    when a read names ids of two runs (the second sent when three quarters of the window were
    acked); a shorter read, or one with an unknown id among them, takes the per-id loop.
    Same state either way."""
    async def main() -> None:
        pair = Pair(tmp_path, 20, False)
        await pair.step(("publish", [("t/a", 1)] * 60))
        bulk_state = pair.sides[0][1].conn.session
        assert bulk_state is not None
        first = list(pair.pending)
        await pair.step(("acks", first[:15], [60]))  # 3/4 of the window: refilled with a new run
        runs = {id(o) for o in bulk_state.qos.inflight.values()}
        assert len(runs) == 2 and all(type(o) is SentRun for o in bulk_state.qos.inflight.values())
        both = list(pair.pending)[-20:][::-1]  # the new run's 15 ids, then the old run's last 5
        with mock.patch.object(ConsumerGroup, "ack_many", autospec=True,
                               side_effect=ConsumerGroup.ack_many) as ack_many, \
                mock.patch.object(ConsumerGroup, "ack", autospec=True, side_effect=ConsumerGroup.ack) as ack:
            await pair.step(("acks", both[8:], [48]))  # 7 of the new run, the 5 old, in reverse
            assert ack_many.call_count == 1 and ack.call_count == 12  # bulk side / one-at-a-time side
            rest = list(pair.pending)[:3]
            await pair.step(("acks", rest, [12]))  # a short read: the per-id loop, one ack each
            assert ack_many.call_count == 1 and ack.call_count == 12 + 2 * 3
            assert pair.bulk_reads[-1] == ("short", 3)
            unknown = list(pair.pending)[:2] + [60000]
            await pair.step(("acks", unknown, [12]))  # an unknown id: the loop (MQTT 4.3.2: ignored)
            assert ack_many.call_count == 1 and ack.call_count == 18 + 2 * 2
    run(main())


def test_a_short_read_with_repeated_and_unknown_ids_acks_each_run_id_once(tmp_path: Path) -> None:
    """A read of 2 to _SMALL_READ PUBACKs of run-path ids, with a repeated id and an unknown
    one (MQTT 4.3.2: ignored) among them, acks each id in flight once and leaves what one-id
    reads leave; so does a read of exactly _SMALL_READ."""
    async def main() -> None:
        pair = Pair(tmp_path, 20, False)
        await pair.step(("publish", [("t/a", 1)] * 20))
        ids = list(pair.pending)
        assert len(ids) == 20
        read = [ids[0], ids[1], ids[1], 60000, ids[2]]  # ids[2] after the repeated and the unknown id
        await pair.step(("acks", read, [4 * len(read)]))
        assert pair.bulk_reads[-1] == ("short", 5)
        assert ids[2] not in pair.inflight(0) and ids[3] in pair.inflight(0)
        await pair.step(("acks", ids[3:3 + qos_module._SMALL_READ], [4 * qos_module._SMALL_READ]))
        assert pair.bulk_reads[-1] == ("short", qos_module._SMALL_READ)
        assert not set(ids[:3 + qos_module._SMALL_READ]) & set(pair.inflight(0))
    run(main())


def test_a_read_across_runs_with_different_offset_deltas_acks_each_at_its_own_offset(tmp_path: Path) -> None:
    """Two gap-free runs in flight whose ids and offsets are apart by different amounts (as
    after a QoS 0 record, which takes an offset and no id, or after the ids wrapped): one read
    of PUBACKs for ids of both acks exactly the records sent under those ids (MQTT 4.3.2), in
    the bulk path and in the per-id loop alike."""
    async def main() -> None:
        for one_at_a_time in (False, True):
            h = Harness(Path(tempfile.mkdtemp(dir=tmp_path)), max_inflight=40)
            if one_at_a_time:
                _one_at_a_time(h)
            s = h.connected("s", False, subscribe=Subscribe(1, [("t/#", 1)]))
            s.received()
            p = h.connected("p")
            for i in range(40):
                p.send(Publish("t/a", b"%d" % i, 1, packet_id=i + 1))
            await h.commit()
            assert len([m for m in s.received() if isinstance(m, Publish)]) == 40
            state = s.conn.session
            assert state is not None
            run = state.qos.inflight[1]
            assert type(run) is SentRun and {id(o) for o in state.qos.inflight.values()} == {id(run)}
            group = run.group
            first = group.pending_offset
            # Re-label the second half as a run of its own under ids 101..120 (offset = id - 81 + first).
            second = SentRun(first + 20 - 101, group, run.records[20:], 101, None)
            for pid in range(21, 41):
                del state.qos.inflight[pid]
            state.qos.inflight.update(dict.fromkeys(range(101, 121), second))
            s.send(*(Puback(pid) for pid in [*range(15, 21), *range(101, 111)]))
            await h.settle()
            left = sorted(group._outstanding)
            expected = [first + i for i in [*range(0, 14), *range(30, 40)]]
            assert left == expected, (one_at_a_time, left)
            assert sorted(state.qos.inflight) == [*range(1, 15), *range(111, 121)]
    run(main())


def test_reads_of_pubacks_split_mid_packet_stay_equivalent(tmp_path: Path) -> None:
    """PUBACK bytes split inside a packet go through the decoder, one PUBACK per call; the
    next whole-packet read of >= 16 takes the bulk path again.  Same state either way."""
    async def main() -> None:
        pair = Pair(tmp_path, 30, False)
        await pair.step(("publish", [("t/a", 1), ("t/b", 1)] * 18))
        assert len(pair.pending) == 30
        ids = pair.pending[::-1]
        with mock.patch.object(ConsumerGroup, "ack_many", autospec=True,
                               side_effect=ConsumerGroup.ack_many) as ack_many:
            await pair.step(("acks", ids, [6, 2, 80, 3, 4 * len(ids) - 91]))
        assert ack_many.call_count == 1  # data[8:88]: twenty whole PUBACKs after an emptied decoder
        assert len(pair.last) == 6 and len(pair.pending) == 6  # all 30 acked: the rest delivered
    run(main())


def test_a_read_of_two_groups_pubacks_stays_equivalent(tmp_path: Path) -> None:
    """A read of >= 16 PUBACKs for the session's own deliveries and a shared subscription's
    (4.8.2: another consumer group) is not the bulk path's one group: it leaves what acking
    them one at a time leaves (compared by message: which group's records go out first after
    a commit is the broker's choice, so the two brokers' packet ids may differ)."""
    async def main() -> None:
        pair = Pair(tmp_path, 40, True)
        await pair.step(("publish", [("t/a", 1), ("s/a", 1)] * 10))
        first = pair.pending
        assert len(first) == 20
        ids = first[3:] + first[:2] + [first[4]]
        await pair.step(("acks", ids, [4 * len(ids)]))
        assert pair.pending == [first[2]] and pair.last == {"t": [], "s": []}
        await pair.step(("publish", [("s/a", 1), ("t/b", 1), ("t/a", 0)] * 5))
        assert len(pair.last["t"]) == 10 and len(pair.last["s"]) == 5
        await pair.step(("acks", pair.pending[::-1], [4 * len(pair.pending)]))
        assert pair.pending == []
    run(main())
