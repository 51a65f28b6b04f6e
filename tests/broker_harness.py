"""The broker test harness: the broker's connections and core driven by packets, without sockets
(h11 style), over a queue whose commits the test controls.

:class:`FakeQueue` resolves a PUBLISH's commit future only when the test says so
(:meth:`Harness.commit`), so a test can check that no PUBACK/PUBREC leaves before its record is
committed.  :class:`Harness` builds a :class:`~filemq.broker.core.BrokerCore` over it (session
files written inline unless ``threaded_writes``); :class:`Client` is one fake connection (send
packets, read what the broker sent back); :func:`users_file` and :func:`with_logins` give the
core a password file (and an ACL).  tests/test_broker_session.py and the other broker test
files use it, and the in-process instruction-count benches (bench/callgrind_*.py).  Its MQTT 5
side (fake MQTT 5 clients, a queue that keeps the message properties) is
tests/broker_harness5.py; a real broker on sockets is tests/broker_process.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from filemq.broker.acl import Acl
from filemq.broker.auth import PasswordFile, add_or_update
from filemq.broker.core import BrokerCore
from filemq.broker.session.connection import Connection
from filemq.broker.session.inflight import SentRun, message_of
from filemq.broker.session_store import SessionStore
from filemq.broker.sysinfo import BrokerStats
from filemq.broker.tailcache import TailCache
from filemq.common.config import BrokerSection
from filemq.mqtt.codec import Decoder, encode
from filemq.mqtt.packets import Connack, Connect, Puback, Publish, Subscribe
from filemq.queue.groups import ConsumerGroup
from filemq.queue.retained import RetainedStore
from segments.record import Record

# ---- a queue whose commits the test controls -----------------------------------------------


class FakeLog:
    def __init__(self) -> None:
        self.records: list[Record] = []
        self.committed_offset = 0
        self.first_offset = 0

    @property
    def next_offset(self) -> int:
        return len(self.records)

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]:
        offset = max(offset, 0)
        return self.records[offset:min(self.committed_offset, offset + max_records)]


class FakeQueue:
    """Queue API subset; :meth:`commit` resolves every open batch like a group commit."""

    def __init__(self, groups_dir: Path) -> None:
        self.log = FakeLog()
        self.groups_dir = groups_dir
        self._groups: dict[str, ConsumerGroup] = {}
        self._listeners: list[Any] = []
        self._batch: asyncio.Future[None] | None = None
        self.fail_next = False

    def publish_nowait(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                       timestamp_us: int | None = None, *, validated: bool = False) -> tuple[int, asyncio.Future[None]]:
        offset = self.log.next_offset
        self.log.records.append(Record(offset, timestamp_us or 0, topic, payload, qos, retain))
        if self._batch is None:
            self._batch = asyncio.get_running_loop().create_future()
        return offset, self._batch

    def publish_many_nowait(self, topics: list[str], payloads: list[bytes], retains: list[bool], qos: int,
                            timestamp_us: int, headers: list[bytes] | None = None) -> tuple[int, asyncio.Future[None]]:
        first = self.log.next_offset
        if self._batch is None:  # (as the real committer: no records still give the open batch)
            self._batch = asyncio.get_running_loop().create_future()
        fut = self._batch
        if headers is not None:  # (MQTT 5 messages with properties: kept in the records)
            records = self.log.records
            for topic, payload, retain, header in zip(topics, payloads, retains, headers, strict=True):
                offset, fut = self.publish_nowait(topic, payload, qos, retain, timestamp_us, validated=True)
                records[offset] = Record(offset, timestamp_us, topic, payload, qos, retain, header)
            return first, fut
        for topic, payload, retain in zip(topics, payloads, retains, strict=True):
            _, fut = self.publish_nowait(topic, payload, qos, retain, timestamp_us, validated=True)
        return first, fut

    def commit(self) -> None:
        fut, self._batch = self._batch, None
        if fut is None:
            return
        if self.fail_next:
            self.fail_next = False
            del self.log.records[self.log.committed_offset:]
            fut.set_exception(OSError(28, "No space left on device"))
            return
        self.log.committed_offset = self.log.next_offset
        fut.set_result(None)
        for cb in self._listeners:
            cb(self.log.committed_offset)

    def add_commit_listener(self, cb: Any) -> None:
        self._listeners.append(cb)

    def group(self, name: str, filters: Any = None, durable: bool = True, start: Any = "latest") -> ConsumerGroup:
        g = self._groups.get(name)
        if g is None:
            g = ConsumerGroup.create(name, self.log, self.groups_dir, filters=filters or ("#",),
                                     durable=durable, start=start)
            self._groups[name] = g
        return g

    def get_group(self, name: str) -> ConsumerGroup | None:
        return self._groups.get(name)

    def journal_progress(self) -> int:
        return 0

    def groups_acked(self) -> int:
        return 1  # (no journal: as if one group acked, the broker's journal cadence is unscaled)

    def persist_due(self) -> list[Any]:
        import time as _time

        now = _time.monotonic()
        return [(g, g.snapshot(now)) for g in self._groups.values() if g.needs_persist(now)]

    @staticmethod
    def write_snapshots(snapshots: list[Any]) -> None:
        for g, snap in snapshots:
            g.write_snapshot(snap)

    def drop_group(self, name: str) -> bool:
        g = self._groups.pop(name, None)
        if g is None:
            return False
        g.drop()
        return True


class FakeTransport:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.data += data

    def close(self) -> None:
        self.closed = True


class SocketTransport:
    """A transport that only holds a socket, as ``AckPacer.for_transport`` and
    ``AckBatcher.for_transport`` look at it (``get_extra_info("socket")``)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default


class Client:
    """One fake connection: send packets, read what the broker sent back."""

    def __init__(self, h: Clients, peer: str) -> None:
        self.h = h
        self.transport = FakeTransport()
        core = h.core
        self.conn = Connection(h.config, peer, now=time.monotonic(), output_ready=core.mark_dirty,
                               closed=self._closed, max_inflight=h.config.max_inflight,
                               max_packet_size=h.config.max_packet_size)
        self.conn.write = self.transport.write
        core.new_connection(self.conn)
        self._decoder = Decoder(server=False)
        self._read = 0
        self._left: list[Any] = []

    def _closed(self, conn: Connection, prev_state: str) -> None:
        """The connection's ``closed`` notification, as the asyncio shell handles it: the core
        forgets it, what is left in its output is written, the transport closed."""
        self.h.core.on_close(conn, prev_state)
        write, conn.write = conn.write, None
        if write is None:
            return
        data = conn.data_to_send()
        if data:
            write(data)
        self.transport.close()

    def feed(self, data: bytes, now: float | None = None) -> None:
        """``data`` as one read from the socket: the connection's events to the core (no flush)."""
        self.h.core.receive(self.conn, self.conn.receive_data(data, time.monotonic() if now is None else now))

    def send(self, *packets: Any) -> None:
        self.feed(b"".join(encode(p) for p in packets))
        self.h.core.flush()

    def send_bytes(self, data: bytes) -> None:
        self.feed(data)
        self.h.core.flush()

    def received(self) -> list[Any]:
        data = bytes(self.transport.data[self._read:])
        self._read = len(self.transport.data)
        self._decoder.feed(data)
        out, self._left = self._left + self._decoder.packets(), []
        return out

    def connect(self, client_id: str, clean: bool = True, **kw: Any) -> Connack:
        self.send(Connect(client_id=client_id, clean_session=clean, **kw))
        out = self.received()
        assert out and isinstance(out[0], Connack), out
        self._left = out[1:]  # deliveries right behind the CONNACK
        return out[0]


class Clients:
    """Fake connections to a harness's ``core``: numbered peers, optionally connected."""

    core: BrokerCore
    config: BrokerSection
    _n: int
    peer_prefix = "10.0.0.1:"

    def client(self) -> Client:
        self._n += 1
        return Client(self, f"{self.peer_prefix}{1000 + self._n}")

    def connected(self, client_id: str, clean: bool = True, *, subscribe: Subscribe | None = None,
                  **kw: Any) -> Client:
        """A new client, CONNECTed; with ``subscribe``, also subscribed (its SUBACK and any
        retained deliveries read and dropped)."""
        c = self.client()
        c.connect(client_id, clean, **kw)
        if subscribe is not None:
            c.send(subscribe)
            c.received()
        return c


class Harness(Clients):
    def __init__(self, tmp: Path, **broker: Any) -> None:
        self.tmp = tmp
        self.config = BrokerSection(**broker)
        self.queue = FakeQueue(tmp / "groups")
        (tmp / "groups").mkdir(exist_ok=True)
        self.store = SessionStore(tmp)
        self.retained = RetainedStore(tmp)
        self.stats = BrokerStats(started_at=0.0)
        self.acl = Acl.permissive()
        self.hook: Any = None
        self._n = 0
        self.core = self.make_core()

    def make_core(self) -> BrokerCore:
        # (FakeQueue and FakeLog stand in for Queue and its log: the same methods, not the types)
        core = BrokerCore(self.queue, TailCache(self.queue.log), config=self.config,  # type: ignore[arg-type]
                          store=self.store, retained=self.retained, stats=self.stats, acl=self.acl,
                          publish_hook=self.hook)
        if not self.threaded_writes:
            core.session_writer = self._write_inline  # CONNACK of a new session at once
        return core

    threaded_writes = False

    def _write_inline(self, snap: Any, done: Any) -> None:
        try:
            self.store.write(snap)
        except OSError as exc:
            done(exc)
            return
        done(None)

    async def commit(self) -> None:
        self.queue.commit()
        await self.settle()

    async def settle(self) -> None:
        """Let commit callbacks and session-file writes (worker threads) finish; flush."""
        for _ in range(3):
            await asyncio.sleep(0)
        await self.core.session_writes_done()
        for _ in range(3):
            await asyncio.sleep(0)
        self.core.flush()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- shared scenarios ---------------------------------------------------------------------


async def one_delivery(h: Harness, qos: int) -> tuple[Client, Publish]:
    """A persistent subscriber "s" (QoS 2 on "t") that got one PUBLISH of QoS ``qos`` from "p"."""
    s = h.connected("s", clean=False, subscribe=Subscribe(1, [("t", 2)]))
    p = h.connected("p")
    p.send(Publish("t", b"m", qos, packet_id=1))
    await h.commit()
    [m] = s.received()
    assert isinstance(m, Publish) and m.qos == qos and not m.dup
    return s, m


def deliveries(ops: list[tuple[Any, ...]], first_pid: int, tmp: Path, run_path: bool,
                new_client: Any = None, subscribe: Any = None, **connect: Any) -> tuple[Any, ...]:
    """What a persistent subscriber receives and keeps in flight under ``ops``, with or
    without Delivery._deliver_run. ``new_client(h)``: the subscriber's client (default
    MQTT 3.1.1), ``subscribe(op)``: the SUBSCRIBE of a "subscribe" op, ``connect``: its CONNECT's
    other fields."""
    calls = 0
    if subscribe is None:
        def subscribe(op: tuple[Any, ...]) -> Subscribe:
            return Subscribe(2, [(op[1], op[2])])

    def connected(h: Harness) -> Client:
        c = h.client() if new_client is None else new_client(h)
        c.connect("s", False, **connect)
        return c

    async def main() -> tuple[Any, ...]:
        nonlocal calls
        h = Harness(tmp, max_inflight=20)
        h.core.acl = Acl.parse("topic read a/#\ntopic read b/#\ntopic read c/1\ntopic write #\n"
                               "pattern read nothing\n")
        real = h.core.delivery._deliver_run

        def spy(*a: Any) -> bool:
            nonlocal calls
            done = run_path and real(*a)
            calls += done
            return done

        h.core.delivery._deliver_run = spy  # type: ignore[method-assign,assignment]
        s = connected(h)
        s.send(Subscribe(1, [("a/#", 1), ("b/1", 2)]))
        assert s.conn.session is not None
        s.conn.session.qos.next_pid = first_pid
        p = h.connected("p")
        got: list[Any] = []
        pending: list[int] = []
        n = 0
        for op in ops:
            if op[0] == "publish":
                for topic, qos, retain in op[1]:
                    n += 1
                    p.send(Publish(topic, b"%d" % n, qos, retain, packet_id=n if qos else None))
                await h.commit()
            elif op[0] == "ack":
                ids = pending[:op[1]] + (pending[:1] if op[2] else [])  # op[2]: with a duplicate id
                del pending[:op[1]]
                if ids:
                    s.send_bytes(b"".join(encode(Puback(i)) for i in ids))  # one read
            elif op[0] == "subscribe":
                s.send(subscribe(op))
            else:
                s.conn.connection_lost()
                s = connected(h)
                pending.clear()
            await h.settle()
            for m in s.received():
                got.append(m)
                if isinstance(m, Publish) and m.qos == 1:
                    pending.append(m.packet_id)  # type: ignore[arg-type]
        state = s.conn.session
        assert state is not None
        # (a SentRun, one object for a gap-free run, as the message it holds under each id)
        inflight = {pid: (pid + o.delta if type(o) is SentRun else o.offset,  # type: ignore[union-attr]
                          o.qos, *message_of(o, pid),
                          o.share, o.stage, o.retain, o.headers)
                    for pid, o in state.qos.inflight.items()}
        return got, inflight, state.qos.next_pid

    return run(main()), calls


# ---- logins ---------------------------------------------------------------------------------


def users_file(tmp_path: Path, *users: str) -> Path:
    """A password file (``tmp_path/pw``) of ``users``, each with the password ``<user>-pw``."""
    pw_file = tmp_path / "pw"
    for user in users:
        add_or_update(pw_file, user, user + "-pw", iterations=1000)
    return pw_file


def with_logins(h: Harness, pw_file: Path, acl_text: str | None = None) -> None:
    """The harness's core checks logins against ``pw_file`` (and rights against ``acl_text``)."""
    h.core.passwords = PasswordFile.load(pw_file)
    if acl_text is not None:
        h.core.acl = Acl.parse(acl_text)
