"""How much acked progress a kill -9 can take back: the progress journal's cadence.

The broker appends the consumer groups' acked progress to the progress journal after the
loop pass of the first acks and then at most once per ``JOURNAL_INTERVAL_S`` (1 ms), and at
the latest after the pass in which the acks since the last append reach ``JOURNAL_MAX_ACKS``
(filemq/broker/delivery.py ``Delivery.flush``).  Without the count bound, a loop of quick passes (a
subscriber draining a backlog from the tail cache while the publishers wait for their
commit) acked several in-flight windows within one interval, and a kill -9 re-delivered all
of them (tests/test_broker_kill9.py once saw 120 in one round against its bound of 100).

Here the interval is made an hour, so only the count can trigger an append, and a persistent
subscriber drains a backlog with reads of whole windows and with one PUBACK per read.  After
every read the journal (what a restart would resume from) must be behind the group's Pending
by fewer than ``JOURNAL_MAX_ACKS`` plus the acks of that one read (the bound is per group
acked into since the last append; here one group acks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from filemq.broker import delivery
from filemq.broker.session_state import JOURNAL_MAX_ACKS
from filemq.mqtt.packets import Puback, Publish, Subscribe
from tests.broker_harness import FakeQueue, Harness, run

WINDOW = 20
BACKLOG = 400


class JournalingQueue(FakeQueue):
    """:class:`FakeQueue` whose progress journal keeps what a restart would resume from."""

    def __init__(self, groups_dir: Path) -> None:
        super().__init__(groups_dir)
        self.journaled: dict[str, int] = {}
        self.appends = 0

    def journal_progress(self) -> int:
        self.appends += 1
        for name, g in self._groups.items():
            self.journaled[name] = g.pending_offset
        return len(self._groups)

    def groups_acked(self) -> int:
        return sum(1 for name, g in self._groups.items() if g.pending_offset != self.journaled.get(name, 0))


@pytest.mark.parametrize("acks_per_read", [WINDOW, 1])
def test_a_kill_9_takes_back_at_most_journal_max_acks_of_acked_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, acks_per_read: int) -> None:
    monkeypatch.setattr(delivery, "JOURNAL_INTERVAL_S", 3600.0)  # (read by Delivery.flush)

    async def main() -> None:
        h = Harness(tmp_path, max_inflight=WINDOW)
        h.queue = JournalingQueue(tmp_path / "groups")
        h.core = h.make_core()
        sub = h.connected("drainer", False, subscribe=Subscribe(1, [("t/#", 1)]))
        sub.received()
        sub.conn.connection_lost()  # the backlog piles up while it is away
        pub = h.connected("pub")
        for i in range(BACKLOG):
            pub.send(Publish("t/x", b"%d" % i, 1, packet_id=i % 65535 + 1))
        await h.commit()
        sub = h.client()
        sub.connect("drainer", False)
        group = next(g for name, g in h.queue._groups.items() if "drainer" in name)
        acked = 0
        worst = 0
        while acked < BACKLOG:
            pids = [p.packet_id for p in sub.received() if isinstance(p, Publish) and p.packet_id is not None]
            assert pids, f"nothing delivered after {acked} acks"
            for k in range(0, len(pids), acks_per_read):
                sub.send(*(Puback(pid) for pid in pids[k:k + acks_per_read]))
                await h.settle()
                behind = group.pending_offset - h.queue.journaled.get(group.name, 0)
                worst = max(worst, behind)
                # What a kill -9 now re-delivers beyond the window: fewer than the bound plus
                # the acks of this one read.
                assert behind < JOURNAL_MAX_ACKS + acks_per_read, (acked, behind)
            acked += len(pids)
        assert group.pending_offset == h.queue.log.next_offset  # drained, all acked
        # The count, not the (hour-long) interval, made the appends: at least one per bound.
        assert h.queue.appends >= BACKLOG // (JOURNAL_MAX_ACKS + acks_per_read)
        assert worst >= JOURNAL_MAX_ACKS - acks_per_read  # the bound was reached, not avoided

    run(main())
