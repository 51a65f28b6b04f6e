"""The asyncio shell of the broker: listeners, one ``asyncio.Protocol`` per connection, timers.

It only moves bytes between sockets and :class:`~filemq.broker.session.connection.Connection` objects
and calls :meth:`BrokerCore.flush` after every event, so each connection gets at most one
``transport.write`` per event (one per group commit for its acks).  No task per packet or
per message: the only periodic work is one tick a second (``$SYS``, snapshots, session expiry), and a
keepalive check at the next client deadline when one falls between ticks.

In-process API (the agent and the collector build on it)::

    broker = Broker(config, publish_hook=hook)
    await broker.start()          # binds; broker.port is the actual port (config port 0)
    broker.ports                  # every listener's actual port, in config order
    broker.reload_tls()           # new connections get the TLS files' current certificates
    broker.queue                  # the filemq.queue.Queue (log + consumer groups)
    await broker.stop()           # stop accepting, close clients, persist everything
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from filemq.broker.acl import Acl
from filemq.broker.admission import Acceptor, Admission, bind_listening_sockets
from filemq.broker.auth import PasswordFile
from filemq.broker.availability import availability_sys
from filemq.broker.batching import AckBatcher, AckBatching
from filemq.broker.budget import (
    CHECK_BYTES,
    DEFAULT_BROKER_BYTES,
    IngestBudget,
)
from filemq.broker.core import SESSION_GROUP_PREFIX, SHARE_GROUP_PREFIX, BrokerCore, PublishHook
from filemq.broker.fairness import TURN_BYTES, Turns
from filemq.broker.pacing import AckPacer
from filemq.broker.session.connection import AUTHENTICATING, Connection
from filemq.broker.session_store import SessionStore
from filemq.broker.sysinfo import SYS_PREFIX, BrokerStats
from filemq.broker.tailcache import TailCache
from filemq.broker.tls import TlsGate, TlsListener, certificate_cn, tls_context
from filemq.common.aio import cancel_and_wait
from filemq.common.config import ConfigError, Listener, broker_listeners
from filemq.queue import Queue, QueueConfig
from filemq.queue.retained import RetainedStore
from segments import LogConfig

if TYPE_CHECKING:
    from filemq.common.config import Config

log = logging.getLogger("filemq.broker")

RETAINED_SNAPSHOT_INTERVAL_S = 5.0  # at most this often, when retained messages changed
KEEPALIVE_CHECK_MIN_S = 0.1  # between-tick keepalive checks at most this often (a late close: at most this)
RETAINED_IDLE_SNAPSHOT_S = 60.0  # otherwise, to keep the replay at start short
WRITE_BUFFER_HIGH = 256 * 1024


LINGER_S = 2.0
"""Seconds a closed connection keeps reading (and discarding) after its last packet."""


class _MQTTProtocol(asyncio.Protocol):
    """Bytes between one socket and its :class:`Connection`."""

    __slots__ = ("core", "conn", "max_packet_size", "max_inflight", "half_open", "transport",
                 "reading", "identity_as_username", "accepted_at", "pacing", "pacer", "batching",
                 "batcher", "budget", "held", "turns", "unchecked")

    def __init__(self, core: BrokerCore, max_packet_size: int, max_inflight: int,
                 half_open: Admission | None = None, identity_as_username: bool = False,
                 pacing: bool = False, batching: AckBatching | None = None,
                 accepted_at: float | None = None, budget: IngestBudget | None = None) -> None:
        self.core = core
        self.budget = budget  # bytes accepted, not yet durable (filemq.broker.budget)
        self.held = False
        self.unchecked = 0  # bytes read since the budget was last looked at
        self.turns: Turns | None = None  # input beyond this pass's turn (filemq.broker.fairness)
        self.pacing = pacing  # prompt TCP ACKs after reads of acks (filemq.broker.pacing)
        self.pacer: AckPacer | None = None
        self.batching = batching  # fewer wake-ups for one-by-one acks (filemq.broker.batching)
        self.batcher: AckBatcher | None = None
        self.conn: Connection | None = None
        self.max_packet_size = max_packet_size
        self.max_inflight = max_inflight
        self.half_open = half_open
        self.transport: asyncio.Transport | None = None
        self.reading = True
        self.identity_as_username = identity_as_username
        # The accept (before any TLS handshake); for a socket silent since its handshake, that.
        self.accepted_at = time.monotonic() if accepted_at is None else accepted_at

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop transports do not subclass it)
        peername = transport.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
        core = self.core
        # max_connections counts connected clients; half-open sockets have their own cap.
        if len(core.connections) >= core.config.max_connections:
            log.warning("refusing connection from %s: max_connections (%d) reached",
                        peer, core.config.max_connections)
            # A lingering close: a CONNECT that arrived before the accept (admission accepts
            # in passes) is read and dropped, so the client reads EOF, not a reset.
            self.transport = transport
            self._linger_close()
            return
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        conn = Connection(core.config, peer, now=self.accepted_at, output_ready=core.mark_dirty,
                          closed=self._closed, max_packet_size=self.max_packet_size,
                          max_inflight=self.max_inflight)
        conn.write = transport.write
        if self.identity_as_username:
            # use_identity_as_username: the verified client certificate's CN is the username.
            conn.identity = certificate_cn(transport.get_extra_info("peercert"))
            if conn.identity is None:
                log.warning("refusing connection from %s: its client certificate has no CN "
                            "(use_identity_as_username)", peer)
                transport.close()
                return
        if self.half_open is not None:
            self.half_open.admit(conn, transport.get_extra_info("socket"))
        self.conn = conn
        self.transport = transport
        if self.pacing:
            self.pacer = AckPacer.for_transport(transport)
        if self.batching is not None:
            self.batcher = AckBatcher.for_transport(transport, self.batching)
        conn.reading_changed = self._update_reading
        core.new_connection(conn)

    def _closed(self, conn: Connection, prev_state: str) -> None:
        """The connection closed (its ``closed`` notification): the core forgets it; then
        what is left in its output is written and the socket closed -- a lingering close
        when that is a last packet (a refusal CONNACK, a DISCONNECT with a reason code)."""
        self.core.on_close(conn, prev_state)
        transport = self.transport
        if conn.write is None or transport is None:
            return  # (the socket is gone already)
        conn.write = None
        data = conn.data_to_send()
        if data:
            transport.write(data)
            self._linger_close()
            return
        transport.close()

    def _linger_close(self) -> None:
        """Close after the last packet (a refusal CONNACK, a DISCONNECT with a reason code):
        end our side (EOF) and keep reading, discarding, for up to :data:`LINGER_S`, so that
        what the client sends meanwhile (e.g. a PUBREL) does not make our kernel answer RST
        and the client's kernel drop the reason code unread.  TLS has no half-close: closed
        at once there."""
        transport = self.transport
        if transport is None:
            return
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if not self.reading:
            self.reading = True
            transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def update_reading(self) -> None:
        """:meth:`_update_reading`, for the ingest budget and fair turns."""
        self._update_reading()

    def _update_reading(self) -> None:
        """Read from the socket only while the connection can take input: not while its
        password is checked, not while its output is backed up (issue 10 item 10: a
        client that never reads must not have its PINGREQs answered without limit), and not
        while the ingest budget holds it (the log is behind)."""
        conn, transport = self.conn, self.transport
        if conn is None or transport is None or conn.closed:
            return
        want = not conn.paused and conn.state != AUTHENTICATING and not self.held
        turns = self.turns
        if turns is not None and turns.rest:  # not read until its waiting turns are handled
            if want:
                turns.schedule()
            want = False
        if want != self.reading:
            self.reading = want
            if want:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        if len(data) > TURN_BYTES or self.turns is not None and self.turns.waiting():
            data = self._turns().take(data)  # one turn now, the rest later (filemq.broker.fairness)
        conn = self.conn
        if conn is None or not data:
            return
        self.core.stats.received_bytes(len(data))
        state = conn.session
        before = len(state.qos.inflight) if state is not None else 0
        # The ingest budget is looked at once per CHECK_BYTES read from this connection.
        self.unchecked += len(data)
        check = self.unchecked >= CHECK_BYTES and self.budget is not None
        appended = self.core.log.next_offset if check else 0
        self.core.receive(conn, conn.receive_data(data, time.monotonic()))
        self.core.flush()
        if check:
            self.unchecked = 0
            budget = self.budget
            if budget is not None and self.core.log.next_offset != appended and budget.over():
                budget.hold(self)  # (calls update_reading)
        self._update_reading()
        if state is None or conn.closed:
            return
        inflight = len(state.qos.inflight)
        pacer = self.pacer
        if pacer is not None and inflight < before and not pacer.acks_read(conn.client_id):
            self.pacer = None
        batcher = self.batcher
        # (not after a publisher's reads: nothing in flight to it, and no mark raised)
        if batcher is not None and (inflight or batcher.mark != 1) and \
                not batcher.after_read(inflight, conn.max_inflight, conn.last_rx):
            self.batcher = None

    def _turns(self) -> Turns:
        turns = self.turns
        if turns is None:
            def can_go() -> bool:
                conn = self.conn
                return conn is not None and not conn.closed and not conn.paused and not self.held \
                    and conn.state != AUTHENTICATING
            turns = self.turns = Turns(self.data_received, can_go, self._update_reading)
        return turns

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        conn = self.conn
        if conn is None:
            return
        if self.turns is not None:
            self.turns.drop()
        conn.write = None
        self.pacer = None
        if self.held and self.budget is not None:
            self.budget.forget(self)
        if self.batcher is not None:
            self.batcher.close()
            self.batcher = None
        conn.connection_lost("connection lost" + (f" ({exc})" if exc else " (peer closed the socket)"))
        self.core.flush()

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.paused = True
            self._update_reading()

    def resume_writing(self) -> None:
        conn = self.conn
        if conn is not None:
            conn.paused = False
            self._update_reading()
            self.core.pump(conn)
            self.core.flush()


def log_config(config: Config) -> LogConfig:
    """The segment-log settings of ``config``'s ``[log]`` section."""
    names = {f.name for f in dataclasses.fields(LogConfig)}
    values = {k: v for k, v in dataclasses.asdict(config.log).items() if k in names}
    return LogConfig(**values)


class Broker:
    """The MQTT broker on the log. See the module docstring for the lifecycle."""

    def __init__(self, config: Config, *, publish_hook: PublishHook | None = None) -> None:
        if config.data_dir is None:
            raise ConfigError("the broker needs a data directory (data_dir, flag --data-dir)", key="data_dir")
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.publish_hook = publish_hook
        self.port = config.broker.port
        self.tls_port: int | None = None
        self.listeners = broker_listeners(config)
        self.ports: list[int] = []  # actual port of each listener, in config order
        self._tls: list[TlsListener] = []
        self.queue: Queue | None = None
        self.core: BrokerCore | None = None
        self.stats = BrokerStats(started_at=time.monotonic())
        self.retained = RetainedStore(self.data_dir)
        self.recovery_seconds = 0.0
        self._servers: list[Acceptor] = []
        self.admission: Admission | None = None
        self.budget: IngestBudget | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._stopped = False
        self.batching: AckBatching | None = None  # (set at start when [broker] ack_batching)

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Recover the store, then bind the listener(s). Raises ConfigError / OSError."""
        b = self.config.broker
        started = time.perf_counter()
        passwords = PasswordFile.load(b.password_file) if b.password_file else None
        acl = Acl.load(b.acl_file)
        contexts: list[ssl.SSLContext | None] = []
        for lst in self.listeners:
            if lst.tls:
                try:
                    contexts.append(tls_context(lst))
                except (OSError, ssl.SSLError) as exc:
                    key = "listener" if self.config.listener else "broker.tls_cert"
                    raise ConfigError(f"cannot load TLS certificate {lst.tls_cert} / key {lst.tls_key}"
                                      f"{f' / CA {lst.tls_ca}' if lst.tls_ca else ''}"
                                      f"{f' / CRL {lst.tls_crl}' if lst.tls_crl else ''} of listener "
                                      f"{lst.describe()}: {exc}", key=key) from exc
            else:
                contexts.append(None)
        if any(lst.protocol == "websockets" for lst in self.listeners):
            try:
                import filemq.broker.websocket  # noqa: F401  (the optional wsproto)
            except ImportError as exc:
                raise ConfigError("a protocol = \"websockets\" listener needs wsproto: "
                                  "pip install 'filemq[websockets]'", key="listener") from exc
        # Housekeeping once a second: an idle broker must not wake up more often.
        queue = Queue.open(self.data_dir, QueueConfig(log=log_config(self.config),
                                                       housekeeping_interval_ms=1000))
        self.queue = queue
        store = SessionStore(self.data_dir)
        self._drop_orphan_session_groups(queue, store)
        self._migrate_share_groups(queue)
        await queue.start()
        cache = TailCache(queue.log, max_bytes=b.cache_bytes)
        core = BrokerCore(
            queue, cache, config=b, store=store, retained=self.retained, stats=self.stats,
            acl=acl, passwords=passwords, publish_hook=self.publish_hook,
        )
        self.core = core
        # MQTT 5 sessions whose expiry interval elapsed while the broker was down are
        # released now; the others' clocks run on (docs/DURABILITY.md).
        core.release_expired_sessions()
        core.retained.ready = False  # until the background rebuild below is done
        self.recovery_seconds = time.perf_counter() - started
        loop = asyncio.get_running_loop()

        half_open = Admission(b.max_connecting)
        self.admission = half_open
        budget = IngestBudget(queue.log, b.max_uncommitted_bytes or DEFAULT_BROKER_BYTES)
        queue.add_commit_listener(budget.on_commit)
        self.budget = budget
        batching = AckBatching() if b.ack_batching else None
        self.batching = batching

        def factory_for(lst: Listener, ctx: ssl.SSLContext | None) -> Callable[[float], asyncio.Protocol]:
            def mqtt(at: float) -> _MQTTProtocol:
                return _MQTTProtocol(core, b.max_packet_size, b.max_inflight, half_open,
                                     identity_as_username=lst.use_identity_as_username,
                                     pacing=b.ack_pacing, batching=batching, accepted_at=at, budget=budget)

            inner: Callable[[float], asyncio.Protocol] = mqtt
            if lst.protocol == "websockets":
                from filemq.broker.websocket import WebSocketProtocol

                origins = lst.allowed_origins
                inner = lambda at: WebSocketProtocol(mqtt(at), origins)  # noqa: E731
            if ctx is None:
                return inner
            return lambda at: TlsGate(inner(at), ctx, half_open, core.connect_timeout, at)

        try:
            for lst, ctx in zip(self.listeners, contexts, strict=True):
                # TLS: TlsGate runs the handshake, counted among the half-open sockets and
                # bounded by the same deadline as the CONNECT (which counts from the accept).
                # Admission (filemq.broker.admission) accepts: it stops while max_connecting
                # sockets are half-open, and the listen backlog holds a burst meanwhile.
                server = Acceptor(bind_listening_sockets(lst.host, lst.port, b.listen_backlog),
                                  factory_for(lst, ctx), half_open)
                self._servers.append(server)
                port = server.sockets[0].getsockname()[1]
                self.ports.append(port)
                if ctx is not None:
                    self._tls.append(TlsListener(lst, ctx))
                    if self.tls_port is None and lst.protocol == "mqtt":
                        self.tls_port = port
            plain = [p for lst, p in zip(self.listeners, self.ports, strict=True) if not lst.tls]
            self.port = plain[0] if plain else self.ports[0]
            for server in self._servers:
                server.start_reading()
        except OSError:
            for s in self._servers:
                s.close()
            await queue.close()
            raise
        # Retained messages are rebuilt (snapshot + log replay) in a thread while the broker
        # already accepts connections: the replay may be long if the snapshot is old or missing.
        self._start_retained_recovery(core, queue)
        self._ticker = loop.create_task(self._tick_loop(), name="filemq-broker-tick")
        log.info("broker listening on %s, data dir %s, %d records, recovered in %.0f ms",
                 ", ".join(dataclasses.replace(lst, port=p).describe()
                           for lst, p in zip(self.listeners, self.ports, strict=True)),
                 self.data_dir, queue.log.next_offset - queue.log.first_offset,
                 self.recovery_seconds * 1000)

    @staticmethod
    def _drop_orphan_session_groups(queue: Queue, store: SessionStore) -> None:
        # A crash between dropping a session's file and its group (clean_session = 1 over a
        # persistent session) would leave a group that holds back retention forever.
        for group in queue.groups():
            if group.name.startswith(SESSION_GROUP_PREFIX):
                client_id = group.name[len(SESSION_GROUP_PREFIX):]
                if not store.path_of(client_id).exists():
                    log.warning("consumer group %r has no session file; dropped", group.name)
                    queue.drop_group(group.name)

    @staticmethod
    def _migrate_share_groups(queue: Queue) -> None:
        # Before share groups were keyed by (name, filter), `$share/<name>/...` used one group
        # `mqtt-share:<name>` for every filter. Each of its filters gets its own group
        # `mqtt-share:<name>/<filter>` starting at the old group's Pending offset (so nothing
        # unacknowledged is lost; records acked out of order above it may be re-delivered once),
        # then the old group is dropped. Share names cannot contain '/', so old names have none.
        for group in queue.groups():
            rest = group.name[len(SHARE_GROUP_PREFIX):]
            if not group.name.startswith(SHARE_GROUP_PREFIX) or "/" in rest:
                continue
            start = group.pending_offset
            for f in group.filters:
                name = f"{SHARE_GROUP_PREFIX}{rest}/{f}"
                if queue.get_group(name) is None:
                    queue.group(name, (f,), durable=True, start=start)
            log.warning("shared-subscription group %r (filters %s) split into one group per filter "
                        "from offset %d; the old group is dropped", group.name, list(group.filters), start)
            queue.drop_group(group.name)

    def _start_retained_recovery(self, core: BrokerCore, queue: Queue) -> None:
        loop = asyncio.get_running_loop()
        self._retained_done = threading.Event()

        def done(store: RetainedStore) -> None:
            self.retained = store
            core.retained.recovered(store)

        def run() -> None:
            store = RetainedStore(self.data_dir)
            try:
                store.recover(queue.log)
            except Exception:
                # A replay that fails leaves the snapshot as is; at shutdown the log closing
                # under the replay is expected.
                if not self._stopped:
                    log.exception("rebuilding retained messages failed")
                return
            finally:
                self._retained_done.set()
            with contextlib.suppress(RuntimeError):  # loop closed: the broker stopped meanwhile
                loop.call_soon_threadsafe(done, store)

        # A daemon thread, not the default executor: shutdown must not wait for a long replay.
        threading.Thread(target=run, name="filemq-retained-recovery", daemon=True).start()

    async def wait_retained_ready(self, timeout: float = 30.0) -> None:
        """Wait until retained messages are recovered (tests, tools)."""
        async with asyncio.timeout(timeout):
            while self.core is None or not self.core.retained.ready:
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop accepting, close every client (no wills), persist sessions, offsets, retained."""
        if self._stopped:
            return
        self._stopped = True
        if self.admission is not None:
            self.admission.close()  # (its re-check timer, and every listening socket)
        if self.budget is not None:
            self.budget.close()
        for server in self._servers:
            server.close()
        if self._ticker is not None:
            await cancel_and_wait(self._ticker)
        core = self.core
        if core is not None:
            # Let the commits in progress finish so their publishers get their acks (fewer
            # re-sends after the restart); bounded, a stuck disk must not block shutdown.
            pending = core.pending_commits()
            if pending:
                with contextlib.suppress(TimeoutError, OSError):
                    await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 2.0)
                await asyncio.sleep(0)  # run the batches' done-callbacks (ack release)
            core.close_all("broker shutting down")
            if self.batching is not None:
                self.batching.close()  # (its sweep timer)
            await core.stop_persisting()
            core.save_sessions()
        if self.queue is not None:
            await self.queue.close()
            if core is not None and core.retained.ready:
                self.retained.advance(core.routed_offset)
                try:
                    self.retained.snapshot()
                except OSError as exc:
                    log.error("writing the retained snapshot failed: %s (the log is replayed at next start)", exc)
            else:
                log.warning("stopped before retained messages were rebuilt; the old snapshot is kept")
        log.info("broker stopped")

    def reload(self) -> bool:
        """Re-read the password file, the ACL file and every TLS listener's certificate files
        (SIGHUP); no connection is dropped.

        The one place a reload happens (TLS: :meth:`reload_tls`). Each file
        is parsed in full first; one that cannot be read or parsed is logged (ERROR, with the
        line) and the one in force stays. A new password file applies to every later CONNECT
        (its login cache starts empty; connected clients stay logged in); a new ACL applies at
        once to every connected client, existing subscriptions included (every delivery is
        checked against the receiver's read rights). True when every file was taken.
        """
        core = self.core
        if core is None or self._stopped:
            return False
        b = self.config.broker
        ok = True
        if b.password_file:
            try:
                passwords = PasswordFile.load(b.password_file)
            except (ConfigError, OSError, ValueError) as exc:
                ok = False
                log.error("reload: the password file in force is kept, the new one is not usable: %s", exc)
            else:
                core.passwords = passwords
                log.info("reload: password file %s in force (%d users)", b.password_file, len(passwords.users))
        if b.acl_file:
            try:
                acl = Acl.load(b.acl_file)
            except (ConfigError, OSError, ValueError) as exc:
                ok = False
                log.error("reload: the ACL in force is kept, the new file is not usable: %s", exc)
            else:
                core.set_acl(acl)
                log.info("reload: ACL file %s in force for %d connected clients", b.acl_file, len(core.connections))
        if not self.reload_tls():
            ok = False
        return ok

    @property
    def listening(self) -> str:
        """``host:port`` of the first plain listener (or the first one); with ``[[listener]]``
        tables, the others follow as ``(also mqtts://host:port, ws://host:port)``."""
        bound = [dataclasses.replace(lst, port=p) for lst, p in zip(self.listeners, self.ports, strict=False)]
        plain = [lst for lst in self.listeners if not lst.tls]
        first = (plain or list(self.listeners))[0]
        text = f"{first.host}:{self.port}"
        if self.config.listener and len(bound) > 1:
            main = bound[self.listeners.index(first)]
            text += " (also " + ", ".join(lst.describe() for lst in bound if lst is not main) + ")"
        return text

    def reload_tls(self) -> bool:
        """Rebuild every TLS listener's context from its files (SIGHUP).

        New connections get the new certificates; connections already open keep theirs.  A
        listener whose files fail to load keeps its old context, and the reason is logged.
        Returns True when every TLS listener was reloaded.
        """
        ok = True
        for tls in self._tls:
            lst = tls.listener
            try:
                tls.current = tls_context(lst)
            except (OSError, ssl.SSLError) as exc:
                ok = False
                log.error("reloading TLS files of listener %s (%s, %s%s%s) failed: %s; it keeps its "
                          "previous certificates", lst.describe(), lst.tls_cert, lst.tls_key,
                          f", {lst.tls_ca}" if lst.tls_ca else "", f", CRL {lst.tls_crl}" if lst.tls_crl else "", exc)
            else:
                log.info("listener %s: TLS certificate %s reloaded", lst.describe(), lst.tls_cert)
        return ok

    # ---- once a second -------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        core = self.core
        queue = self.queue
        assert core is not None and queue is not None
        interval = self.config.broker.sys_interval_s
        next_sys = time.monotonic() + interval if interval > 0 else float("inf")
        next_snapshot = time.monotonic() + RETAINED_SNAPSHOT_INTERVAL_S
        last_fsyncs = queue.log.stats.fsyncs
        last_fsync_s = queue.log.stats.fsync_seconds_total
        retained_covered = self.retained.covered_offset
        retained_changes = -1
        last_snapshot = time.monotonic()
        next_tick = time.monotonic() + 1.0
        last_check = 0.0
        while True:
            # Asleep until the tick, or until a keepalive / CONNECT deadline falls before it
            # (checked at most every KEEPALIVE_CHECK_MIN_S, however many clients time out).
            now = time.monotonic()
            wake = min(next_tick, max(core.next_timeout, last_check + KEEPALIVE_CHECK_MIN_S))
            await asyncio.sleep(max(0.0, wake - now))
            now = time.monotonic()
            if now < next_tick:
                last_check = now
                try:
                    core.check_timeouts(now)
                except Exception:
                    log.exception("broker keepalive check failed; continuing")
                continue
            next_tick = max(next_tick + 1.0, now + 0.5)
            last_check = now
            try:
                core.tick(now)
                stats = queue.log.stats
                if stats.fsyncs > last_fsyncs:
                    self.stats.fsync_done((stats.fsync_seconds_total - last_fsync_s) / (stats.fsyncs - last_fsyncs))
                    last_fsyncs, last_fsync_s = stats.fsyncs, stats.fsync_seconds_total
                if now >= next_sys:
                    next_sys = now + interval
                    self.stats.store_bytes = queue.log.size_bytes()
                    # Durable groups only (clean sessions come and go); group names embed
                    # client ids, whose wildcard characters are not allowed in topic names.
                    backlog = {g.name.replace("+", "%2B").replace("#", "%23"): g.lag
                               for g in queue.groups() if g.durable}
                    for name in [n for n in self.stats.backlog if n not in backlog]:
                        self.stats.remove_backlog(name)
                    for name, lag in backlog.items():
                        self.stats.set_backlog(name, lag)
                    # The backlog topics are the complete set: a dropped group's topic goes away.
                    core.publish_sys(self.stats.sys_messages(now)
                                     + [(SYS_PREFIX + name, value.encode()) for name, value in availability_sys(self.admission, self.budget)],
                                     replace=SYS_PREFIX + "backlog/")
                if now >= next_snapshot and core.retained.ready:
                    next_snapshot = now + RETAINED_SNAPSHOT_INTERVAL_S
                    routed = core.routed_offset
                    # Snapshot when retained messages changed (so a restart replays little),
                    # else only now and then: each snapshot costs fsyncs next to the log's.
                    changed = core.retained.changes != retained_changes
                    stale = now - last_snapshot >= RETAINED_IDLE_SNAPSHOT_S
                    if routed > retained_covered and (changed or stale):
                        retained_changes = core.retained.changes
                        self.retained.advance(routed)
                        await asyncio.to_thread(self.retained.snapshot)
                        retained_covered, last_snapshot = routed, now
                    core.save_sessions(off_loop=True)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("broker tick failed; continuing")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and benchmarks)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
