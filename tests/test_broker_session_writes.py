"""Session-file writes off the event loop (issue 33 item 2; docs/BROKER.md "Sessions and delivery").

SUBSCRIBE, UNSUBSCRIBE, the discard of a session by clean_session = 1, the release of an
expired MQTT 5 session, the lazy writes at a disconnect and a stored will that falls due all
write (or remove) the session file in a worker thread, never on the event loop; what the
client is told waits for durability: the SUBACK / UNSUBACK leaves only once the file holds
the change (MQTT-3.8.4-1 with 4.1: the subscription is session state), the CONNACK of a clean
session only once the old file is gone.  A gate in the store's write holds the worker thread,
so "not before durable" is checked, not assumed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from filemq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Properties,
    Publish,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from tests.broker_harness import Harness, run
from tests.broker_harness5 import client5


class GatedWrites:
    """Wrap ``h.store.write``: record the thread of every write and hold it while closed."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.gate = threading.Event()
        self.gate.set()
        self.threads: list[threading.Thread] = []
        self.real = h.store.write
        h.store.write = self._write  # type: ignore[method-assign]
        self.on_loop: list[str] = []
        real_delete = h.store.delete

        def delete(client_id: str) -> bool:
            self.on_loop.append(f"delete({client_id!r}) on {threading.current_thread().name}")
            return real_delete(client_id)

        h.store.delete = delete  # type: ignore[method-assign]

    def _write(self, snap: Any) -> None:
        self.gate.wait(10)
        self.threads.append(threading.current_thread())
        self.real(snap)

    def all_off_loop(self) -> bool:
        return bool(self.threads) and all(t is not threading.main_thread() for t in self.threads) \
            and not self.on_loop


def _harness(tmp_path: Path) -> tuple[Harness, GatedWrites]:
    h = Harness(tmp_path)
    h.threaded_writes = True
    h.core = h.make_core()
    return h, GatedWrites(h)


def test_suback_and_unsuback_wait_for_the_session_file_written_off_the_loop(tmp_path: Path) -> None:
    async def main() -> None:
        h, writes = _harness(tmp_path)
        c = h.client()
        c.send(Connect(client_id="s", clean_session=False))
        await h.settle()
        assert c.received() == [Connack(False, 0)]
        writes.gate.clear()
        c.send(Subscribe(1, [("a/#", 1)]))
        await asyncio.sleep(0.2)
        assert c.received() == [], "SUBACK before the subscription is durable"
        stored = h.store.load("s")
        assert stored is not None and "a/#" not in stored.subscriptions
        writes.gate.set()
        await h.settle()
        assert c.received() == [Suback(1, [1])]
        stored = h.store.load("s")
        assert stored is not None and "a/#" in stored.subscriptions
        writes.gate.clear()
        c.send(Unsubscribe(2, ["a/#"]))
        await asyncio.sleep(0.2)
        assert c.received() == [], "UNSUBACK before the change is durable"
        writes.gate.set()
        await h.settle()
        assert c.received() == [Unsuback(2, [])]
        stored = h.store.load("s")
        assert stored is not None and "a/#" not in stored.subscriptions
        assert writes.all_off_loop(), (writes.threads, writes.on_loop)
    run(main())


def test_a_failed_subscribe_write_closes_without_suback(tmp_path: Path) -> None:
    async def main() -> None:
        h, writes = _harness(tmp_path)
        c = h.client()
        c.send(Connect(client_id="s", clean_session=False))
        await h.settle()
        assert c.received() == [Connack(False, 0)]

        def fail(snap: Any) -> None:
            raise OSError(28, "No space left on device")

        h.store.write = fail  # type: ignore[method-assign]
        c.send(Subscribe(1, [("a/#", 1)]))
        await h.settle()
        assert c.received() == [] and c.conn.closed
    run(main())


def test_clean_session_discard_removes_the_file_off_the_loop_before_connack(tmp_path: Path) -> None:
    """MQTT-3.1.2-6: clean_session = 1 discards the previous session; the CONNACK (session
    present 0) leaves only once its file is gone, so a crash right after cannot bring it back."""
    async def main() -> None:
        h, writes = _harness(tmp_path)
        c = h.client()
        c.send(Connect(client_id="s", clean_session=False), Subscribe(1, [("a/#", 1)]))
        await h.settle()
        assert c.received() == [Connack(False, 0), Suback(1, [1])]
        c.send(Disconnect())
        await h.settle()
        assert h.store.path_of("s").exists()
        writes.gate.clear()
        again = h.client()
        again.send(Connect(client_id="s", clean_session=True))
        await asyncio.sleep(0.2)
        assert again.received() == [], "CONNACK before the discarded session's file is gone"
        writes.gate.set()
        await h.settle()
        assert again.received() == [Connack(False, 0)]
        assert not h.store.path_of("s").exists()
        assert writes.all_off_loop(), (writes.threads, writes.on_loop)
    run(main())


def test_expired_session_is_released_and_a_stored_will_rewritten_off_the_loop(tmp_path: Path) -> None:
    """The tick's work: an MQTT 5 session past its Session Expiry Interval is released (its
    file removed) and a will held for its delay by a session on disk is published and the file
    rewritten without it -- both in a worker thread."""
    async def main() -> None:
        h, writes = _harness(tmp_path)
        c = client5(h)
        c.send(Connect(client_id="x", clean_session=False, protocol_level=5,
                       properties=Properties(session_expiry_interval=1)), Subscribe(1, [("a/#", 1)]))
        await h.settle()
        assert [type(p) for p in c.received()] == [Connack, Suback]
        c.send(Disconnect())
        await h.settle()
        assert h.store.path_of("x").exists()
        h.core.expire_sessions(time.monotonic() + 5)
        await h.settle()
        assert not h.store.path_of("x").exists()

        w = client5(h)
        w.send(Connect(client_id="w", clean_session=False, protocol_level=5, will_topic="gone", will_payload=b"bye",
                       properties=Properties(session_expiry_interval=3600),
                       will_properties=Properties(will_delay_interval=1)))
        await h.settle()
        w.conn.close("test: network gone", will=True)
        await h.settle()
        stored = h.store.load("w")
        assert stored is not None and stored.will is not None
        # A restart: the will is now held by the file only.
        h.core = h.make_core()
        h.core.release_expired_sessions()
        h.core.expire_sessions(time.monotonic() + 5)
        await h.settle()
        stored = h.store.load("w")
        assert stored is not None and stored.will is None
        assert any(r.topic == "gone" for r in h.queue.log.records)
        assert writes.all_off_loop(), (writes.threads, writes.on_loop)
    run(main())


def test_live_records_wait_behind_the_retained_replay_while_the_suback_waits(tmp_path: Path) -> None:
    """While a SUBSCRIBE's session-file write runs, a newer live message on the topic is not
    sent before the SUBACK and the older retained one: a client taking RETAIN 1 for the last
    known value would otherwise overwrite the newer value with the older."""
    async def main() -> None:
        h, writes = _harness(tmp_path)
        pub = h.connected("pub")
        pub.send(Publish("a/1", b"old", 1, retain=True, packet_id=1))
        await h.commit()
        c = h.client()
        c.send(Connect(client_id="s", clean_session=False))
        await h.settle()
        assert c.received() == [Connack(False, 0)]
        writes.gate.clear()
        c.send(Subscribe(1, [("a/#", 1)]))
        await asyncio.sleep(0.05)
        pub.send(Publish("a/1", b"new", 1, packet_id=2))
        h.queue.commit()
        for _ in range(5):
            await asyncio.sleep(0.02)
        h.core.flush()
        assert c.received() == [], "a live record left before the SUBACK and the retained replay"
        writes.gate.set()
        await h.settle()
        got = c.received()
        assert isinstance(got[0], Suback)
        pubs = [p for p in got if isinstance(p, Publish)]
        assert [(p.payload, p.retain) for p in pubs] == [(b"old", True), (b"new", False)]
    run(main())
