"""The session registry (:class:`SessionRegistry`): the persistent sessions the broker knows
in memory, their session files (written off the event loop, durable before the acks that
need them), MQTT 5 session expiry and the wills sessions hold for their delay.

One part of :class:`~filemq.broker.core.BrokerCore`; it owns its state, and the other parts
reach it only through the methods below.  What it needs from them is given at wiring time:
the queue (to drop a discarded session's group), the ACL in force (:attr:`acl`, set again on
reload) and :attr:`publish_internal` (the ingest part's ``store_internal``, for wills).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from filemq.broker.session_state import SESSION_GROUP_PREFIX, SessionState, _copy_outcome
from filemq.broker.session_store import NEVER_EXPIRES, SessionSnapshot, SessionStore, StoredSession
from filemq.mqtt.packets import Publish
from filemq.mqtt.properties import encode_message_headers

if TYPE_CHECKING:
    from filemq.broker.acl import Acl, ClientAcl
    from filemq.broker.ports import QueuePort

log = logging.getLogger("filemq.broker")

SessionWriter = Callable[[SessionSnapshot, Callable[[BaseException | None], None]], None]
"""Writes a session snapshot durably, then calls ``done(None or the exception)``."""
InternalPublish = Callable[[str, bytes, int, bool, bytes], None]
"""Stores a message the broker itself publishes: topic, payload, QoS, retain, MQTT 5 headers."""


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    """Resolve a session write's future with its outcome: cancelled, failed with ``exc``, or done."""
    if isinstance(exc, asyncio.CancelledError):
        fut.cancel()
    elif exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(None)


def _retrieved(fut: asyncio.Future[None]) -> None:
    """Mark a fire-and-forget future's failure as seen (it was logged where it happened)."""
    if not fut.cancelled():
        fut.exception()


def _no_publish(topic: str, payload: bytes, qos: int, retain: bool, headers: bytes) -> None:
    raise RuntimeError("SessionRegistry.publish_internal is not wired")  # pragma: no cover


class SessionRegistry:
    """Persistent sessions in memory and on disk, their expiry and their delayed wills."""

    def __init__(self, store: SessionStore, queue: QueuePort, acl: Acl) -> None:
        self.store = store
        self.queue = queue
        self.acl = acl  # in force (BrokerCore.set_acl replaces it): a stored will's rights
        self.sessions: dict[str, SessionState] = {}  # persistent sessions known in memory
        self.publish_internal: InternalPublish = _no_publish
        # Writes a session snapshot durably, then calls ``done(None or the exception)``; by
        # default in a worker thread (never an fsync on the event loop); tests may replace it.
        self.session_writer: SessionWriter = self._write_in_thread
        self._session_writes: set[asyncio.Future[None]] = set()  # running session-file writes
        # cid -> monotonic time its disconnected MQTT 5 session expires.
        self.expiring: dict[str, float] = {}
        # cids of sessions holding a delayed will.
        self.wills_waiting: set[str] = set()
        # Wills held for their delay by sessions only on disk (from before a restart or a
        # kill -9): cid -> (the session as stored, monotonic time the will is due).
        self.stored_wills: dict[str, tuple[StoredSession, float]] = {}

    # ---- no local across the bounded publisher map -----------------------------------------

    def own_published(self, first: int, n: int, client_id: str) -> None:
        """An MQTT 5 client published ``first`` .. ``first + n - 1``: a persistent session of
        its with a no local subscription keeps them (OwnRuns; written lazily)."""
        state = self.sessions.get(client_id)
        if state is not None and state.persistent and state.has_no_local():
            state.own_runs.add(first, n)
            state.save_due = True

    def own_forget(self, offset: int) -> None:
        for state in self.sessions.values():
            if state.own_runs and state.own_runs.forget_from(offset):
                state.save_due = True

    # ---- discarding ------------------------------------------------------------------------

    def discard(self, cid: str, why: str = "it connected with clean_session = 1") -> asyncio.Future[None] | None:
        """Forget ``cid``'s persistent session; its file is removed in a worker thread (the
        future, None when there was no file, resolves once the removal is durable)."""
        state = self.sessions.pop(cid, None)
        self.expiring.pop(cid, None)
        if state is not None and state.will_pending is not None:
            self.will_due(state)  # the session ends: its delayed will is due (3.1.3.2.2)
        if cid in self.stored_wills:
            self.stored_will_due(cid, rewrite=False)  # the same for a will from before a restart
        # Group first, file second: a crash in between leaves a session file whose group is
        # gone (harmless), never a group without a file holding back retention.
        dropped = self.queue.drop_group(SESSION_GROUP_PREFIX + cid)
        stored = self.store.path_of(cid).exists()
        removed = None
        if stored or state is not None:  # (a write of it may be in flight: numbered after it)
            removed = self.write_snapshot(self.store.deletion(cid))
        if state is not None or stored or dropped:
            log.info("client %r: its persistent session was discarded: %s", cid, why)
        return removed if stored else None  # what a CONNACK waits for: a file on disk going

    def write_snapshot(self, snap: SessionSnapshot) -> asyncio.Future[None] | None:
        """Have the session writer write ``snap`` (or remove the file, a deletion) off the
        event loop; the future resolves when it is durable (None: no loop runs, written now)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.store.write(snap)
            return None
        fut: asyncio.Future[None] = loop.create_future()
        fut.add_done_callback(_retrieved)

        def done(exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None and not isinstance(exc, asyncio.CancelledError):
                log.error("client %r: writing or removing the session file failed: %s", snap.client_id, exc)
            _settle(fut, exc)

        self.session_writer(snap, done)
        return fut

    # ---- MQTT 5 session expiry and delayed wills -------------------------------------------

    def expired(self, cid: str, stored: StoredSession | None) -> bool:
        """Whether the disconnected session of ``cid`` is past its Session Expiry Interval."""
        due = self.expiring.get(cid)
        if due is not None:
            return due <= time.monotonic()
        if stored is not None and stored.disconnected_at is not None:
            now = time.time()
            at = stored.expires_at(now)
            return at is not None and at <= now
        return False

    def session_closed(self, state: SessionState) -> None:
        """``state``'s connection closed and the session lives on: an MQTT 5 one starts its
        expiry clock; the close time is written to its file (in a worker thread)."""
        expiry = state.expiry
        if expiry is None or expiry == 0:
            return
        state.disconnected_at = time.time()
        if expiry != NEVER_EXPIRES:
            self.expiring[state.client_id] = time.monotonic() + expiry
        self.save_soon(state)

    def resumed(self, state: SessionState) -> None:
        """``state`` is taken by a CONNECT: its expiry clock stops and a delayed will of it is
        not sent (MQTT-3.1.3-9), unless its delay passed already (the tick is late)."""
        cid = state.client_id
        self.expiring.pop(cid, None)
        now = time.monotonic()
        if state.will_pending is not None and state.will_pending[2] <= now:
            self.will_due(state)
        held = self.stored_wills.get(cid)
        if held is not None and held[1] <= now:
            self.stored_will_due(cid)
        held = self.stored_wills.pop(cid, None)
        if state.will_pending is not None or held is not None:
            log.info("client %r: resumed its session within the will delay: its will is not sent", cid)
            state.will_pending = None
        self.wills_waiting.discard(cid)

    def release_expired_sessions(self) -> None:
        """At start: release every stored session whose interval elapsed since its recorded
        close (the broker was down meanwhile); the others expire at their time (tick).  A
        session whose close was not written (kill -9) counts from now: late, never early."""
        started, mono = time.time(), time.monotonic()
        for stored in self.store.stored_sessions():
            cid = stored.client_id
            if stored.will is not None and cid not in self.sessions:
                # A will held for its delay when the broker stopped: due at its time (tick).
                self.stored_wills[cid] = (stored, mono + max(0.0, stored.will.due - started))
                self.wills_waiting.add(cid)
            at = stored.expires_at(started)
            if at is None or cid in self.sessions:
                continue
            if at <= started:
                self.discard(cid, "its session expiry interval elapsed while the broker was down")
            else:
                self.expiring[cid] = mono + (at - started)

    def expire_sessions(self, now: float) -> None:
        """Release the disconnected sessions whose interval elapsed by ``now`` (monotonic) and
        publish delayed wills that are due (tick)."""
        for cid, due in list(self.expiring.items()):
            if due <= now:
                state = self.sessions.get(cid)
                if state is not None and state.conn is not None:
                    self.expiring.pop(cid, None)  # (resumed; not reached: CONNECT pops it)
                    continue
                self.discard(cid, "its session expiry interval elapsed")
        for cid in list(self.wills_waiting):
            state = self.sessions.get(cid)
            pending = None if state is None else state.will_pending
            held = self.stored_wills.get(cid)
            if held is not None:
                if held[1] <= now:
                    self.stored_will_due(cid)
            elif pending is None:
                self.wills_waiting.discard(cid)
            elif pending[2] <= now:
                assert state is not None
                self.will_due(state)

    def hold_will(self, state: SessionState, will: Publish, acl: ClientAcl | None, delay: int) -> None:
        """Keep ``will`` until its Will Delay Interval has passed (or the session ends)."""
        state.will_pending = (will, acl, time.monotonic() + delay)
        self.wills_waiting.add(state.client_id)
        self.save_soon(state)  # the file holds it: a restart or a kill -9 does not lose it

    def stored_will_due(self, cid: str, rewrite: bool = True) -> None:
        """Publish the will a session on disk held for its delay, then write the session
        without it (``rewrite``; not when the session file is about to be deleted)."""
        stored, _ = self.stored_wills.pop(cid)
        self.wills_waiting.discard(cid)
        will = stored.will
        if will is None:
            return
        acl = self.acl.for_client(stored.owner, cid) if self.acl is not None else None
        self.store_will(cid, will.topic, will.payload, will.qos, will.retain, will.headers, acl)
        if rewrite:
            stored.will = None
            self.write_snapshot(self.store.snapshot(stored))  # off the loop (a tick)

    def will_due(self, state: SessionState) -> None:
        pending, state.will_pending = state.will_pending, None
        self.wills_waiting.discard(state.client_id)
        if pending is not None:
            self.publish_will(state.client_id, pending[0], pending[1])
            if state.persistent and self.sessions.get(state.client_id) is state:
                self.save_soon(state)  # the file no longer holds it: not published twice

    def publish_will(self, cid: str, will: Publish, acl: ClientAcl | None) -> None:
        """Store ``will`` with its will properties as the message's (3.1.3.2), as the client
        could have published it (ACL; never to a $-topic)."""
        self.store_will(cid, will.topic, will.payload, will.qos, will.retain,
                        encode_message_headers(will.properties), acl)

    def store_will(self, cid: str, topic: str, payload: bytes, qos: int, retain: bool, headers: bytes,
                   acl: ClientAcl | None) -> None:
        if topic.startswith("$") or (acl is not None and not acl.can_publish(topic)):
            log.warning("client %r: will to %r not published (ACL or $-topic)", cid, topic)
            return
        log.info("client %r: publishing its will to %r", cid, topic)
        self.publish_internal(topic, payload, qos, retain, headers)

    def publish_pending_wills(self) -> None:
        """Shutdown: delayed wills are published now rather than lost with the process."""
        for cid in list(self.wills_waiting):
            state = self.sessions.get(cid)
            if state is not None:
                self.will_due(state)
            if cid in self.stored_wills:
                self.stored_will_due(cid)
        self.wills_waiting.clear()

    # ---- session-file writes off the event loop -----------------------------------------

    def qos2_gate(self, state: SessionState, fut: asyncio.Future[None]) -> asyncio.Future[None]:
        """A future that resolves once commit ``fut`` resolved and then the session file
        (with the QoS 2 ids ``fut`` stored) was written; one per commit batch and session,
        so one write covers every QoS 2 PUBREC of the batch (also across a takeover: the
        session is the same).  Fails as ``fut`` or the write fails."""
        gate = state.qos2_gates.get(fut)
        if gate is None:
            gate = state.qos2_gates[fut] = asyncio.get_running_loop().create_future()
            gate.add_done_callback(_retrieved)  # (a failure is logged by the committer)
            fut.add_done_callback(functools.partial(self._qos2_committed, state, gate))
        return gate

    def _qos2_committed(self, state: SessionState, gate: asyncio.Future[None], fut: asyncio.Future[None]) -> None:
        state.qos2_gates.pop(fut, None)
        if fut.cancelled():
            gate.cancel()
        elif (exc := fut.exception()) is not None:
            gate.set_exception(exc)
        else:
            self.save_soon(state).add_done_callback(functools.partial(_copy_outcome, gate))

    def save_now(self, state: SessionState) -> asyncio.Future[None]:
        """:meth:`save_soon`, but started at once when no write of ``state`` is running."""
        fut = self.save_soon(state)
        if not state.save_running:
            self._start_save(state)
        return fut

    def save_soon(self, state: SessionState) -> asyncio.Future[None]:
        """Write ``state``'s session file in a worker thread, soon (changes made before the
        write starts are all in it: one write per batch).  The future resolves when it is
        durable, or fails with the OSError."""
        fut = state.save_next
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = state.save_next = loop.create_future()
            # A failed write is logged (_save_done); a save nobody waits for any more (its
            # connection gone) must not also print "Future exception was never retrieved".
            fut.add_done_callback(_retrieved)
            if not state.save_running:
                loop.call_soon(self._start_save, state)
        return fut

    def _start_save(self, state: SessionState) -> None:
        fut, state.save_next = state.save_next, None
        if fut is None:
            return
        if state.persistent and self.sessions.get(state.client_id) is not state:
            fut.set_result(None)  # discarded meanwhile (clean_session = 1): never revive its file
            return
        state.save_running = True
        state.save_due = False
        snap = self.store.snapshot(state.stored())
        self.session_writer(snap, functools.partial(self._save_done, state, fut))

    def _write_in_thread(self, snap: SessionSnapshot, done: Callable[[BaseException | None], None]) -> None:
        """The default :attr:`session_writer`: ``store.write`` in the loop's executor."""
        job = asyncio.get_running_loop().run_in_executor(None, self.store.write, snap)
        self._session_writes.add(job)

        def finished(j: asyncio.Future[None]) -> None:
            self._session_writes.discard(j)
            done(asyncio.CancelledError() if j.cancelled() else j.exception())

        job.add_done_callback(finished)

    def _save_done(self, state: SessionState, fut: asyncio.Future[None], exc: BaseException | None) -> None:
        state.save_running = False
        if exc is not None and not isinstance(exc, asyncio.CancelledError):
            log.error("client %r: writing the session file failed: %s", state.client_id, exc)
        _settle(fut, exc)
        if state.save_next is not None:
            self._start_save(state)

    async def session_writes_done(self) -> None:
        """Wait until no session-file write is running or due (tests, shutdown)."""
        for _ in range(1000):
            await asyncio.sleep(0)
            if not self._session_writes:
                if not any(s.save_next is not None for s in self.sessions.values()):
                    return
                continue
            await asyncio.gather(*self._session_writes, return_exceptions=True)

    def save_session(self, state: SessionState) -> None:
        """Write ``state``'s session file now, on the calling thread (shutdown)."""
        state.save_due = False
        try:
            self.store.save(state.stored())
        except OSError as exc:
            log.error("client %r: writing the session file failed: %s", state.client_id, exc)

    def save_sessions(self, off_loop: bool = False) -> None:
        """Write every persistent session with unwritten changes: now (shutdown), or in a
        worker thread (``off_loop``, the periodic tick: no fsync on the event loop)."""
        for state in self.sessions.values():
            if state.save_due:
                if off_loop:
                    self.save_soon(state)
                else:
                    self.save_session(state)
