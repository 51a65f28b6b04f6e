"""Retained state across restarts and time (issue 33 item 3; docs/BROKER.md "Retained messages").

* A subscription's ``retain_below`` (retained records below it reach the subscriber by the
  SUBSCRIBE's replay with RETAIN 1, not live, MQTT-3.3.1-8) is in the session file, so a
  restart does not deliver those records a second time, live.
* A retained message whose MQTT 5 message expiry interval has passed is removed from the
  retained store (MQTT-3.3.2-5), by the broker's tick and by recovery after a restart, not
  just skipped at delivery while it stays in memory, in snapshots and in $SYS counts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import filemq.broker.publish as publish_module
from filemq.broker.session_state import OwnRuns
from filemq.broker.session_store import CorruptSession, StoredSession, StoredSubscription
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Properties,
    Publish,
    Suback,
    Subscribe,
    subscription_options,
)
from filemq.queue.retained import RetainedStore, expires_at_us
from segments.log import Log
from segments.record import Record
from tests.broker_harness import Harness, run
from tests.broker_harness5 import client5


def _headers(expiry: int) -> bytes:
    return b"\x02" + expiry.to_bytes(4, "big")


def test_retain_below_survives_a_restart(tmp_path: Path) -> None:
    """A retained record appended but not yet routed when a persistent session subscribes
    gives the subscription a retain_below past it; the session file keeps it and the broker
    started again on that file restores it (before: 0, so the record, still in the session's
    backlog, would be delivered live a second time)."""
    async def main() -> None:
        h = Harness(tmp_path)
        pub = h.connected("pub")
        pub.send(Publish("t", b"r", 1, retain=True, packet_id=1))  # appended, not committed
        c = h.client()
        c.send(Connect(client_id="s", clean_session=False), Subscribe(1, [("t", 1)]))
        await h.settle()
        below = h.core.sessions["s"].subs["t"].retain_below
        assert below > 0
        stored = h.store.load("s")
        assert stored is not None and stored.subscriptions["t"].retain_below == below
        await h.commit()
        c.conn.close("test: gone", will=False)
        h.core = h.make_core()  # a restart on the same files
        again = h.client()
        again.send(Connect(client_id="s", clean_session=False))
        await h.settle()
        assert h.core.sessions["s"].subs["t"].retain_below == below
    run(main())


def test_stored_subscription_retain_below_round_trips_and_old_files_load() -> None:
    s = StoredSession("c", {"t": StoredSubscription(1, 5, 0, 0, 9)})
    assert StoredSession.from_json(s.to_json(), "f").subscriptions["t"].retain_below == 9
    plain = StoredSession("c", {"t": StoredSubscription(1, 5)}).to_json()
    assert b'"rb"' not in plain  # unchanged for files without it
    assert StoredSession.from_json(plain, "f").subscriptions["t"].retain_below == 0


def test_expired_retained_message_is_removed_by_the_tick(tmp_path: Path) -> None:
    """MQTT-3.3.2-5: an MQTT 5 retained message with a 1 s expiry is gone from the store
    after it passes (not only skipped when sent); one without expiry stays."""
    async def main() -> None:
        h = Harness(tmp_path)
        now = time.time_ns() // 1000
        # As the broker applies committed records (the test queue does not store headers).
        h.retained.apply(Record(0, now, "t/short", b"s", 1, True, _headers(1)))
        h.retained.apply(Record(1, now, "t/long", b"l", 1, True))
        assert {m.topic for m in h.retained.match("#")} == {"t/short", "t/long"}
        time.sleep(1.2)
        h.core.tick()
        assert {m.topic for m in h.retained.match("#")} == {"t/long"}
        assert h.retained.expired == 1 and h.retained.payload_bytes == 1
        assert h.core.retained.changes > 0  # the tick's next snapshot leaves it out
    run(main())


def test_recovery_does_not_bring_back_an_expired_retained_message(tmp_path: Path) -> None:
    """After a restart (snapshot plus log replay) a retained message whose expiry passed is
    not in the store, whether it came from the snapshot or from the replayed log."""
    log = Log.open(tmp_path / "log")
    old = time.time_ns() // 1000 - 10_000_000  # published 10 s ago
    log.append("a/snap", b"x", qos=1, retain=True, timestamp_us=old, headers=_headers(5))
    log.append("a/keep", b"k", qos=1, retain=True, timestamp_us=old)
    log.sync()
    store = RetainedStore(tmp_path)
    store.recover(log)  # the 10 s old message with 5 s expiry is dropped already
    assert {m.topic for m in store.match("#")} == {"a/keep"}
    log.append("a/replayed", b"y", qos=1, retain=True, timestamp_us=old, headers=_headers(3))
    log.append("a/fresh", b"z", qos=1, retain=True, headers=_headers(3600))
    log.sync()
    store.snapshot()
    again = RetainedStore(tmp_path)
    again.recover(log)
    assert {m.topic for m in again.match("#")} == {"a/keep", "a/fresh"}
    assert expires_at_us(_headers(3), 0) == 3_000_000 and expires_at_us(b"", 0) is None
    log.close()


# -- no local across a restart and beyond the publisher window (issue 33 item 3) --------------


def _no_local_scenario(tmp_path: Path, monkeypatch: Any, kept: int, restart: bool) -> list[bytes]:
    """A persistent MQTT 5 session with a no local subscription on ``t/#`` publishes ``own``
    and goes away before it is routed; another client publishes ``other``; (with ``kept``
    small, 20 more messages push ``own`` out of the broker's bounded publisher map); the
    broker restarts on the same files (``restart``); the session comes back: what it receives."""
    monkeypatch.setattr(publish_module, "PUBLISHERS_KEPT", kept)

    async def main() -> list[bytes]:
        h = Harness(tmp_path)
        me = client5(h)
        me.send(Connect(client_id="me", clean_session=False, protocol_level=5,
                        properties=Properties(session_expiry_interval=3600)),
                Subscribe(1, [("t/#", subscription_options(1, no_local=True))]))
        await h.settle()
        assert [type(p) for p in me.received()] == [Connack, Suback]
        me.send(Publish("t/me", b"own", 1, packet_id=1), Disconnect())
        other = client5(h)  # (the publisher map holds MQTT 5 publishers' offsets)
        other.connect("other")
        other.send(Publish("t/x", b"other", 1, packet_id=1))
        for i in range(20):
            other.send(Publish("u/y", b"filler-%d" % i, 1, packet_id=2 + i))
        await h.commit()
        if restart:
            h.core.save_sessions()  # (the broker writes sessions with changes at shutdown and on its tick)
            h.core = h.make_core()  # a restart on the same files
        back = client5(h)
        back.send(Connect(client_id="me", clean_session=False, protocol_level=5,
                          properties=Properties(session_expiry_interval=3600)))
        await h.settle()
        return [p.payload for p in back.received() if isinstance(p, Publish)]

    result: list[bytes] = run(main())
    return result


def test_no_local_holds_across_a_restart(tmp_path: Path, monkeypatch: Any) -> None:
    """MQTT-3.8.3-3: a no local subscription never gets its own client's messages, also those
    still in its backlog when the broker restarts (before: the publisher map is memory only,
    so ``own`` came back to its publisher)."""
    assert _no_local_scenario(tmp_path, monkeypatch, kept=65536, restart=True) == [b"other"]


def test_no_local_holds_beyond_the_publisher_window(tmp_path: Path, monkeypatch: Any) -> None:
    """The same without a restart when more offsets than the broker's publisher map keeps
    (65,536; 10 here) were published after it (before: forgotten, delivered)."""
    assert _no_local_scenario(tmp_path, monkeypatch, kept=10, restart=False) == [b"other"]


def test_own_offsets_round_trip_and_are_checked() -> None:
    s = StoredSession("c", own_offsets=[(3, 5), (9, 10)])
    assert StoredSession.from_json(s.to_json(), "f").own_offsets == [(3, 5), (9, 10)]
    for bad in (b'[[5, 3]]', b'[[1, 4], [2, 6]]', b'[[1, true]]', b'{"a": 1}'):
        body = s.to_json().replace(b'"own":[[3,5],[9,10]]', b'"own":' + bad)
        with pytest.raises(CorruptSession):
            StoredSession.from_json(body, "f")
    runs = OwnRuns([(3, 5)])
    runs.add(5, 2)
    runs.add(9, 1)
    assert [runs.holds(o) for o in (2, 3, 6, 7, 8, 9, 10)] == [False, True, True, False, False, True, False]
    assert runs.pruned(4) == [(4, 7), (9, 10)] and runs.forget_from(6) and runs.runs == [[3, 6]]
