"""Outbound QoS 1 and 2 of a persistent session, across reconnects: the broker core (over the
test harness's queue, commits controlled) driven as a Hypothesis state machine against a model
of MQTT 3.1.1 4.3 and 4.4 (issue 31 item 1).

One publisher, one subscriber on a persistent session (clean_session = 0) subscribed to ``t``
at QoS 2; messages are published at QoS 1 or 2 and delivered at that QoS.  The subscriber
acknowledges the oldest delivery it holds (PUBACK; PUBREC, then PUBCOMP once the PUBREL came),
drops its connection without DISCONNECT and reconnects.  The model says what it must read:

* 4.3.2 / 4.3.3: a QoS 1 delivery is answered by PUBACK; a QoS 2 one by PUBREC, to which the
  broker answers PUBREL with the same packet id (MQTT-4.3.3-1's sender side), then PUBCOMP.
* MQTT-4.4.0-1 (3.1.1) / MQTT-4.4.0-1 (5.0 for a session resumed): on reconnect with
  clean_session = 0 the broker re-sends every unacknowledged PUBLISH with its original packet
  id and DUP = 1 (MQTT-3.3.1-1), and every PUBREL not answered by PUBCOMP.
* MQTT-4.6.0-1/-2 and 4.6's ordered topics: re-sent PUBLISHes in the order first sent; the
  messages published while it was away follow, in publish order, with fresh packet ids
  (MQTT-2.3.1-2: none in use by another unacknowledged PUBLISH).
* Every message is delivered, none twice except as DUP re-sends of the same packet id.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from filemq.mqtt.packets import Puback, Pubcomp, Publish, Pubrec, Pubrel, Subscribe
from tests.broker_harness import Client, Harness

WINDOW = 8  # the subscriber's in-flight window: the model keeps fewer unacknowledged



class QosMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = Path(tempfile.mkdtemp(prefix="filemq-qos-machine-"))
        self.h, self.pub, sub = self._run(self._start())
        self.sub: Client | None = sub
        self.n = 0  # messages published
        self.pub_pid = 0
        # The model: the subscriber's unacknowledged deliveries, oldest first, as
        # [pid, payload, stage] (stage "publish": PUBACK/PUBREC due; "pubrel": PUBCOMP due).
        self.held: list[list[Any]] = []
        self.offline: list[tuple[bytes, int]] = []  # published while it was away: (payload, qos)
        self.delivered: list[bytes] = []  # each message's first delivery, in order
        self.expect: list[tuple[str, Any]] = []  # what it must read next: ("publish", payload/dup) ...

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _start(self) -> tuple[Harness, Client, Client]:
        h = Harness(self.tmp, max_inflight=WINDOW)
        return h, h.connected("pub"), h.connected("sub", clean=False, subscribe=Subscribe(1, [("t", 2)]))

    def teardown(self) -> None:
        self.loop.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- the subscriber's reads ------------------------------------------------------------

    def _read(self) -> list[Any]:
        assert self.sub is not None
        return self.sub.received()

    def _take_delivery(self, p: Publish) -> None:
        """A fresh delivery: it must be the next message in publish order, not a DUP."""
        assert not p.dup, p
        assert p.packet_id not in {h[0] for h in self.held}, "MQTT-2.3.1-2: an id still in use"
        self.delivered.append(p.payload)
        self.held.append([p.packet_id, p.payload, "publish", p.qos])

    # ---- rules ------------------------------------------------------------------------------

    @precondition(lambda self: len(self.held) + len(self.offline) < WINDOW - 1)
    @rule(qos=st.sampled_from([1, 2]))
    def publish(self, qos: int) -> None:
        self._run(self._publish(qos))

    async def _publish(self, qos: int) -> None:
        self.n += 1
        self.pub_pid += 1
        payload = f"m{self.n}".encode()
        self.pub.send(Publish("t", payload, qos, packet_id=self.pub_pid))
        await self.h.commit()
        acks = self.pub.received()
        assert [type(a) for a in acks] == [Puback if qos == 1 else Pubrec]  # after the commit
        if qos == 2:
            self.pub.send(Pubrel(self.pub_pid))
            await self.h.settle()
            assert [type(a) for a in self.pub.received()] == [Pubcomp]
        if self.sub is None:
            self.offline.append((payload, qos))
            return
        got = self._read()
        assert [(type(p), p.payload, p.qos) for p in got] == [(Publish, payload, qos)], got  # 4.6 order
        self._take_delivery(got[0])

    @precondition(lambda self: self.sub is not None and bool(self.held))
    @rule()
    def acknowledge_the_oldest(self) -> None:
        self._run(self._acknowledge())

    async def _acknowledge(self) -> None:
        assert self.sub is not None
        pid, payload, stage, qos = self.held[0]
        if qos == 1:
            self.sub.send(Puback(pid))  # 4.3.2
            await self.h.settle()
            assert self._read() == []
            self.held.pop(0)
        elif stage == "publish":
            self.sub.send(Pubrec(pid))  # 4.3.3: the broker answers PUBREL, same id
            await self.h.settle()
            got = self._read()
            assert [(type(p), p.packet_id) for p in got] == [(Pubrel, pid)], got
            self.held[0][2] = "pubrel"
        else:
            self.sub.send(Pubcomp(pid))
            await self.h.settle()
            assert self._read() == []
            self.held.pop(0)

    @precondition(lambda self: self.sub is not None)
    @rule()
    def connection_drops(self) -> None:
        self._run(self._drop())

    async def _drop(self) -> None:
        assert self.sub is not None
        self.sub.conn.connection_lost()
        await self.h.settle()
        self.sub = None

    @precondition(lambda self: self.sub is None)
    @rule()
    def reconnect_resumes_4_4_0_1(self) -> None:
        self._run(self._reconnect())

    async def _reconnect(self) -> None:
        sub = self.h.client()
        ack = sub.connect("sub", clean=False)
        assert ack.session_present  # (3.2.2.2)
        self.sub = sub
        await self.h.settle()
        got = self._read()
        # Re-sent first: each unacknowledged PUBLISH with its id and DUP = 1, in the order first
        # sent; each PUBREL not completed.  Then what was published meanwhile, fresh.
        resent = [(p.packet_id, p.payload, p.qos) for p in got if isinstance(p, Publish) and p.dup]
        assert resent == [(pid, payload, qos) for pid, payload, stage, qos in self.held if stage == "publish"]
        pubrels = sorted(p.packet_id for p in got if isinstance(p, Pubrel))
        assert pubrels == sorted(pid for pid, _, stage, _ in self.held if stage == "pubrel")
        fresh = [p for p in got if isinstance(p, Publish) and not p.dup]
        assert [(p.payload, p.qos) for p in fresh] == self.offline
        assert all(isinstance(p, (Publish, Pubrel)) for p in got), got
        # Re-sent PUBLISHes come before the fresh ones (4.6: in order of the messages).
        kinds = ["re" if isinstance(p, Publish) and p.dup else "new" for p in got if isinstance(p, Publish)]
        assert kinds == sorted(kinds, key=lambda k: k == "new")
        self.offline.clear()
        for p in fresh:
            self._take_delivery(p)

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def every_message_delivered_once_in_order(self) -> None:
        published = [f"m{i}".encode() for i in range(1, self.n + 1)]
        assert self.delivered + [p for p, _ in self.offline] == published


QosMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_outbound_qos_across_reconnects = QosMachine.TestCase
