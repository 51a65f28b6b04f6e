"""The asyncio shell of the broker: listeners, one ``asyncio.Protocol`` per connection, timers.

It only moves bytes between sockets and :class:`~filemq.broker.session.Connection` objects
and calls :meth:`BrokerCore.flush` after every event, so each connection gets at most one
``transport.write`` per event (one per group commit for its acks).  No task per packet or
per message: the only periodic work is one tick a second (keepalive, ``$SYS``, snapshots).

In-process API (the agent and the collector build on it)::

    broker = Broker(config, publish_hook=hook)
    await broker.start()          # binds; broker.port is the actual port (config port 0)
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
from pathlib import Path
from typing import TYPE_CHECKING

from filemq.acl import Acl
from filemq.auth import PasswordFile
from filemq.broker.core import SESSION_GROUP_PREFIX, BrokerCore, PublishHook
from filemq.broker.session import Connection
from filemq.broker.sessions import SessionStore
from filemq.broker.tailcache import TailCache
from filemq.config import ConfigError
from filemq.queue import Queue, QueueConfig
from filemq.retained import RetainedStore
from filemq.sysinfo import SYS_PREFIX, BrokerStats
from segments import LogConfig

if TYPE_CHECKING:
    from filemq.config import Config

log = logging.getLogger("filemq.broker")

RETAINED_SNAPSHOT_INTERVAL_S = 5.0  # at most this often, when retained messages changed
RETAINED_IDLE_SNAPSHOT_S = 60.0  # otherwise, to keep the replay at start short
WRITE_BUFFER_HIGH = 256 * 1024


class _MQTTProtocol(asyncio.Protocol):
    """Bytes between one socket and its :class:`Connection`."""

    __slots__ = ("core", "conn", "max_packet_size", "max_inflight")

    def __init__(self, core: BrokerCore, max_packet_size: int, max_inflight: int) -> None:
        self.core = core
        self.conn: Connection | None = None
        self.max_packet_size = max_packet_size
        self.max_inflight = max_inflight

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peername = transport.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
        core = self.core
        if core.at_capacity():
            log.warning("refusing connection from %s: max_connections (%d) reached",
                        peer, core.config.max_connections)
            transport.close()
            return
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        conn = Connection(core, peer, transport, max_packet_size=self.max_packet_size,
                          max_inflight=self.max_inflight)
        self.conn = conn
        core.new_connection(conn)

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is None:
            return
        self.core.stats.received_bytes(len(data))
        conn.receive_data(data)
        self.core.flush()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        conn = self.conn
        if conn is None:
            return
        conn.transport = None
        conn.connection_lost("connection lost" + (f" ({exc})" if exc else " (peer closed the socket)"))
        self.core.flush()

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.paused = True

    def resume_writing(self) -> None:
        conn = self.conn
        if conn is not None:
            conn.paused = False
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
        self.queue: Queue | None = None
        self.core: BrokerCore | None = None
        self.stats = BrokerStats(started_at=time.monotonic())
        self.retained = RetainedStore(self.data_dir)
        self.recovery_seconds = 0.0
        self._servers: list[asyncio.base_events.Server] = []
        self._ticker: asyncio.Task[None] | None = None
        self._stopped = False

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Recover the store, then bind the listener(s). Raises ConfigError / OSError."""
        b = self.config.broker
        started = time.perf_counter()
        passwords = PasswordFile.load(b.password_file) if b.password_file else None
        acl = Acl.load(b.acl_file)
        ssl_ctx = None
        if b.tls_cert is not None:
            ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                ssl_ctx.load_cert_chain(b.tls_cert, b.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cannot load TLS certificate {b.tls_cert} / key {b.tls_key}: {exc}",
                                  key="broker.tls_cert") from exc
        # Housekeeping once a second: an idle broker must not wake up more often.
        queue = Queue.open(self.data_dir, QueueConfig(log=log_config(self.config),
                                                       housekeeping_interval_ms=1000))
        self.queue = queue
        store = SessionStore(self.data_dir)
        self._drop_orphan_session_groups(queue, store)
        await queue.start()
        cache = TailCache(queue.log)
        core = BrokerCore(
            queue, cache, config=b, store=store, retained=self.retained, stats=self.stats,
            acl=acl, passwords=passwords, publish_hook=self.publish_hook,
        )
        self.core = core
        core.retained_ready = False  # until the background rebuild below is done
        self.recovery_seconds = time.perf_counter() - started
        loop = asyncio.get_running_loop()

        def factory() -> _MQTTProtocol:
            return _MQTTProtocol(core, b.max_packet_size, b.max_inflight)

        try:
            server = await loop.create_server(factory, b.host, b.port, reuse_address=True, backlog=1024)
            self._servers.append(server)
            self.port = server.sockets[0].getsockname()[1]
            if ssl_ctx is not None:
                tls = await loop.create_server(factory, b.host, b.tls_port, ssl=ssl_ctx,
                                               reuse_address=True, backlog=1024)
                self._servers.append(tls)
                self.tls_port = tls.sockets[0].getsockname()[1]
        except OSError:
            for s in self._servers:
                s.close()
            await queue.close()
            raise
        # Retained messages are rebuilt (snapshot + log replay) in a thread while the broker
        # already accepts connections: the replay may be long if the snapshot is old or missing.
        self._start_retained_recovery(core, queue)
        self._ticker = loop.create_task(self._tick_loop(), name="filemq-broker-tick")
        log.info("broker listening on %s:%d%s, data dir %s, %d records, recovered in %.0f ms",
                 b.host, self.port, f" (TLS on {self.tls_port})" if self.tls_port else "",
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

    def _start_retained_recovery(self, core: BrokerCore, queue: Queue) -> None:
        loop = asyncio.get_running_loop()
        self._retained_done = threading.Event()

        def done(store: RetainedStore) -> None:
            self.retained = store
            core.retained_recovered(store)

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
            while self.core is None or not self.core.retained_ready:
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop accepting, close every client (no wills), persist sessions, offsets, retained."""
        if self._stopped:
            return
        self._stopped = True
        for server in self._servers:
            server.close()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
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
            await core.stop_persisting()
            core.save_sessions()
        if self.queue is not None:
            await self.queue.close()
            if core is not None and core.retained_ready:
                self.retained.advance(core.routed_offset)
                try:
                    self.retained.snapshot()
                except OSError as exc:
                    log.error("writing the retained snapshot failed: %s (the log is replayed at next start)", exc)
            else:
                log.warning("stopped before retained messages were rebuilt; the old snapshot is kept")
        for server in self._servers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 2.0)
        log.info("broker stopped")

    @property
    def listening(self) -> str:
        b = self.config.broker
        return f"{b.host}:{self.port}"

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
        while True:
            await asyncio.sleep(1.0)
            try:
                now = time.monotonic()
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
                    core.publish_sys(self.stats.sys_messages(now), replace=SYS_PREFIX + "backlog/")
                if now >= next_snapshot and core.retained_ready:
                    next_snapshot = now + RETAINED_SNAPSHOT_INTERVAL_S
                    routed = core.routed_offset
                    # Snapshot when retained messages changed (so a restart replays little),
                    # else only now and then: each snapshot costs fsyncs next to the log's.
                    changed = core.retained_changes != retained_changes
                    stale = now - last_snapshot >= RETAINED_IDLE_SNAPSHOT_S
                    if routed > retained_covered and (changed or stale):
                        retained_changes = core.retained_changes
                        self.retained.advance(routed)
                        await asyncio.to_thread(self.retained.snapshot)
                        retained_covered, last_snapshot = routed, now
                    core.save_sessions()
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
