"""CONNECT and the session lifecycle: authentication, session ownership, clean and
persistent sessions, auto-subscribe, and the session-file writes (off the event loop,
durable before CONNACK / PUBREC / PUBCOMP).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from filemq.broker.acl import fill_pattern
from filemq.broker.auth import LoginThrottle
from filemq.broker.session.connection import AUTHENTICATING, AWAITING_CONNECT, CONNECTED, Connection
from filemq.broker.session_state import (
    RC_QUOTA_EXCEEDED,
    SESSION_GROUP_PREFIX,
    SHARE_GROUP_PREFIX,
    OwnRuns,
    SessionState,
    Subscription,
    _too_long,
    parse_share_key,
)
from filemq.broker.session_store import StoredSession
from filemq.common.topics import (
    InvalidTopic,
    validate_topic_filter,
    validate_topic_name,
)
from filemq.mqtt.codec import ProtocolError, encode5
from filemq.mqtt.packets import (
    CONNACK_ACCEPTED,
    CONNACK_BAD_USERNAME_OR_PASSWORD,
    CONNACK_IDENTIFIER_REJECTED,
    CONNACK_NOT_AUTHORIZED,
    CONNACK_RETURN_CODE_NAMES,
    CONNACK_SERVER_UNAVAILABLE,
    CONNACK_UNACCEPTABLE_PROTOCOL_VERSION,
    PROTOCOL_LEVEL_5,
    RC_BAD_AUTHENTICATION_METHOD,
    RC_PROTOCOL_ERROR,
    Connack,
    Connect,
    Disconnect,
    Properties,
    Publish,
)

if TYPE_CHECKING:
    from filemq.broker.acl import Acl
    from filemq.broker.auth import PasswordFile
    from filemq.broker.delivery import Delivery
    from filemq.broker.publish import Ingest
    from filemq.broker.qos import QosAcks
    from filemq.broker.registry import SessionRegistry
    from filemq.broker.router import Router
    from filemq.broker.sysinfo import BrokerStats
    from filemq.common.config import BrokerSection

log = logging.getLogger("filemq.broker")

# 3.1.1 CONNACK return codes -> the MQTT 5 Connect Reason Codes that mean the same (3.2.2.2).
_V5_REFUSALS = {
    CONNACK_UNACCEPTABLE_PROTOCOL_VERSION: 0x84,
    CONNACK_IDENTIFIER_REJECTED: 0x85,
    CONNACK_SERVER_UNAVAILABLE: 0x88,
    CONNACK_BAD_USERNAME_OR_PASSWORD: 0x86,
    CONNACK_NOT_AUTHORIZED: 0x87,
}


CONNECT_TIMEOUT = 10.0
"""Seconds from the accept to a complete CONNECT (a TLS handshake included)."""
AUTH_THREADS = 2
"""Worker threads for password checks.  They are the broker's own, not the loop's default
executor: wrong-password CONNECTs (one PBKDF2 each) never queue ahead of the session-file and
offset writes that acks wait for."""


def session_expiry(p: Connect) -> int | None:
    """The session expiry interval a CONNECT asks for: None on 3.1.1 (a clean_session = 0
    session never expires), else the property, absent = 0 (3.1.2.11.2)."""
    if p.protocol_level != PROTOCOL_LEVEL_5:
        return None
    props = p.properties
    if props is None or props.session_expiry_interval is None:
        return 0
    return props.session_expiry_interval


def _source(conn: Connection) -> str:
    """The address a connection comes from, without its port (the login throttle's key)."""
    return conn.peer.rsplit(":", 1)[0]


def _check_password(conn: Connection, passwords: PasswordFile, user: str, password: bytes) -> bool:
    """The password check of a CONNECT, in an auth worker thread; a connection that went
    away while it waited for a thread costs no PBKDF2."""
    if conn.closed:
        return False
    return passwords.check(user, password)


def _no_resume(conn: Connection) -> None:
    """Until the core wires its own: a connection's bytes behind a CONNECT wait."""


class Connector:
    """CONNECT: authentication (password checks off the loop, the login throttle), session
    ownership and take-over, clean and persistent sessions (their files written before
    CONNACK), auto-subscribe, CONNACK; DISCONNECT.

    Owns the live connections by client id, the ACL and password file in force and the
    authentication threads."""

    def __init__(self, config: BrokerSection, acl: Acl, passwords: PasswordFile | None, stats: BrokerStats,
                 router: Router, registry: SessionRegistry, delivery: Delivery, ingest: Ingest,
                 qos: QosAcks) -> None:
        self.config = config
        self.acl = acl
        self.passwords = passwords
        self.anonymous_allowed = config.anonymous_allowed()
        self.stats = stats
        self.router = router
        self.registry = registry
        self.delivery = delivery
        self.ingest = ingest
        self.qos = qos
        self.connect_timeout = CONNECT_TIMEOUT
        # Handles a connection's events once its CONNECT is accepted after a wait (a password
        # check, a session-file write): the core's, wired by it.
        self.resume: Callable[[Connection], None] = _no_resume
        self.connections: dict[str, Connection] = {}  # client id -> live connection
        self._auth_pool: ThreadPoolExecutor | None = None  # created at the first password check
        self._login_throttle = LoginThrottle(config.login_failures_before_delay, config.login_failure_delay_ms / 1000)

    def shutdown(self) -> None:
        """Stop the authentication threads (shutdown; checks under way are dropped)."""
        if self._auth_pool is not None:
            self._auth_pool.shutdown(wait=False, cancel_futures=True)
            self._auth_pool = None

    # ---- CONNECT -------------------------------------------------------------------------

    def _server_full(self, conn: Connection, p: Connect) -> bool:
        """Refuse a CONNECT with CONNACK 3 (MQTT 5: 0x97) when ``max_connections`` clients are connected
        (a client taking over its own id does not add one).  Half-open connections do not
        count: they are capped apart (``max_connecting``, in the asyncio shell)."""
        limit = self.config.max_connections
        if len(self.connections) < limit or p.client_id in self.connections:
            return False
        if p.protocol_level == PROTOCOL_LEVEL_5:
            # 3.2.2.2: 0x97 Quota exceeded, "an implementation or administrative imposed
            # limit" -- what max_connections is (0x89 Server busy suggests a passing state).
            conn.protocol_level = PROTOCOL_LEVEL_5
            conn.encode_packet = encode5
            conn.send_packet(Connack(False, RC_QUOTA_EXCEEDED))
        else:
            conn.send_packet(Connack(False, CONNACK_SERVER_UNAVAILABLE))
        conn.close(f"CONNECT refused (server unavailable): max_connections ({limit}) clients connected",
                   will=False, level=logging.WARNING)
        return True

    def _refuse(self, conn: Connection, code: int, why: str) -> None:
        """CONNACK ``code`` (a 3.1.1 return code; on MQTT 5 its Connect Reason Code, or a
        reason code >= 0x80 given directly) and close."""
        name = CONNACK_RETURN_CODE_NAMES.get(code, f"0x{code:02x}")
        if conn.protocol_level == PROTOCOL_LEVEL_5:
            code = _V5_REFUSALS.get(code, code)
        conn.send_packet(Connack(False, code))
        conn.close(f"CONNECT refused ({name}): {why}", will=False, level=logging.WARNING)

    def on_connect(self, conn: Connection, p: Connect) -> None:
        if self._server_full(conn, p):
            return
        if p.protocol_name != "MQTT" or p.protocol_level not in (4, PROTOCOL_LEVEL_5):
            self._refuse(conn, CONNACK_UNACCEPTABLE_PROTOCOL_VERSION,
                         f"protocol {p.protocol_name!r} level {p.protocol_level}; only MQTT 3.1.1 (level 4) "
                         "and MQTT 5.0 (level 5)")
            return
        v5 = p.protocol_level == PROTOCOL_LEVEL_5
        if v5:
            conn.protocol_level = PROTOCOL_LEVEL_5
            conn.encode_packet = encode5
            props = p.properties
            if props is not None:
                if props.authentication_method is not None:
                    # No extended authentication is offered (3.1.2.11.9, 4.12).
                    self._refuse(conn, RC_BAD_AUTHENTICATION_METHOD,
                                 f"authentication method {props.authentication_method!r} is not supported")
                    return
                conn.client_max_packet = props.maximum_packet_size
                conn.alias_max = props.topic_alias_maximum or 0
                if props.receive_maximum is not None:
                    # Never more unacknowledged QoS 1/2 PUBLISHes than the client takes (3.1.2.11.3).
                    conn.max_inflight = min(conn.max_inflight, props.receive_maximum)
        conn.client_id = p.client_id
        conn.username = p.username
        conn.assigned_id = False
        if not p.client_id:
            if not p.clean_session and not v5:
                self._refuse(conn, CONNACK_IDENTIFIER_REJECTED,
                             "zero-length client id needs clean_session = 1")
                return
            # MQTT 5: the server assigns one and returns it in CONNACK (MQTT-3.1.3-6/-7).
            conn.client_id = "filemq-" + secrets.token_hex(8)
            conn.assigned_id = True
        if p.will_topic is not None:
            try:
                validate_topic_name(p.will_topic)
            except InvalidTopic as exc:
                raise ProtocolError(f"invalid will topic: {exc}", "CONNECT") from None
            if _too_long(p.will_topic, self.config.max_topic_length):
                raise ProtocolError(f"will topic of {len(p.will_topic.encode('utf-8'))} bytes exceeds "
                                    f"max_topic_length {self.config.max_topic_length}", "CONNECT")
            limit = self.config.message_size_limit
            if limit is not None and len(p.will_payload) > limit:
                # 3.1.1 has no CONNACK code for it: refused by closing, as Mosquitto does.
                conn.close(f"CONNECT refused: will payload of {len(p.will_payload)} bytes exceeds "
                           f"message_size_limit {limit}", will=False, level=logging.WARNING)
                return
            conn.will = Publish(p.will_topic, p.will_payload, p.will_qos, p.will_retain,
                                properties=p.will_properties)
        keepalive = p.keepalive
        kmax = self.config.keepalive_max
        if kmax is not None and (keepalive == 0 or keepalive > kmax):
            keepalive = kmax
        conn.keepalive = keepalive
        if conn.identity is not None:  # use_identity_as_username: the certificate logged in
            conn.username = conn.identity
            self._accept(conn, p)
            return
        passwords = self.passwords
        if p.username is None:
            if passwords is not None and not self.anonymous_allowed:
                self._refuse(conn, CONNACK_NOT_AUTHORIZED, "anonymous clients are not allowed; send a username")
                return
            self._accept(conn, p)
            return
        if passwords is None:
            self._accept(conn, p)  # no password file: usernames only select ACL rules
            return
        if p.password is None:
            self._refuse(conn, CONNACK_BAD_USERNAME_OR_PASSWORD, f"user {p.username!r} sent no password")
            return
        if passwords.cached(p.username, p.password):
            self._accept(conn, p)  # (no PBKDF2: never delayed by the login throttle)
            return
        # An address past its failed logins in a row waits its turn (filemq.broker.auth.
        # LoginThrottle): one PBKDF2 per login_failure_delay_ms from it, whatever it sends.
        wait = self._login_throttle.wait(_source(conn), time.monotonic(), self.connect_timeout)
        if wait is None:
            self._refuse(conn, CONNACK_SERVER_UNAVAILABLE,
                         f"too many failed logins in a row from {_source(conn)}; not checked (try later)")
            return
        conn.state = AUTHENTICATING  # packets arriving meanwhile wait (and while delayed)
        if wait:
            asyncio.get_running_loop().call_later(wait, self._check_password, conn, p)
        else:
            self._check_password(conn, p)

    def _check_password(self, conn: Connection, p: Connect) -> None:
        """PBKDF2 takes ~100 ms: run it off the loop (:data:`AUTH_THREADS` threads)."""
        if conn.closed:
            return
        assert self.passwords is not None and p.username is not None and p.password is not None
        loop = asyncio.get_running_loop()
        if self._auth_pool is None:
            self._auth_pool = ThreadPoolExecutor(AUTH_THREADS, thread_name_prefix="filemq-auth")
        fut = loop.run_in_executor(self._auth_pool, _check_password, conn, self.passwords, p.username, p.password)
        fut.add_done_callback(lambda f: self._auth_done(conn, p, f))

    def _auth_done(self, conn: Connection, p: Connect, fut: asyncio.Future[bool]) -> None:
        if conn.closed:
            return
        ok = not fut.cancelled() and fut.exception() is None and fut.result()
        conn.state = AWAITING_CONNECT
        source = _source(conn)
        if ok:
            self._login_throttle.succeeded(source)
            self._accept(conn, p)
            self.resume(conn)
        else:
            throttle = self._login_throttle
            if throttle.failed(source, time.monotonic()):
                log.warning("%d failed logins in a row from %s: its next password checks start at most one "
                            "per %d ms until one succeeds (broker.login_failures_before_delay, "
                            "login_failure_delay_ms)", throttle.after, source, round(throttle.delay * 1000))
            what = "an empty password (refused)" if not p.password else "wrong password"
            self._refuse(conn, CONNACK_BAD_USERNAME_OR_PASSWORD, f"{what} for user {p.username!r}")
        self.delivery.flush()

    @staticmethod
    def _take_over(old: Connection, conn: Connection, p: Connect) -> None:
        """Close ``old``, whose client id ``conn`` (CONNECT ``p``) takes (3.1.4-2; MQTT 5:
        DISCONNECT 0x8E first, MQTT-3.1.4-3).  Its will: MQTT 3.1.1 publishes it (the client
        sent no DISCONNECT, 3.1.2.5).  MQTT 5 publishes it only if the session ends with the
        take-over (Clean Start 1, or the old connection's session expiry 0): a new connection
        that resumes the session is one "opened before the Will Delay Interval has elapsed",
        so the will is not sent, whatever its delay (MQTT-3.1.2-8 of 5.0; Mosquitto alike)."""
        will = True
        if old.protocol_level == PROTOCOL_LEVEL_5:
            state = old.session
            will = p.clean_session or state is None or not state.persistent or state.expiry == 0
        if not will:
            log.info("client %r: its session is resumed by a new connection from %s: its will is not sent "
                     "(MQTT-3.1.2-8)", old.client_id, conn.peer)
        old.close(f"session taken over by a new connection from {conn.peer}", will=will, reason_code=0x8E)

    def _not_owner(self, conn: Connection, mem: SessionState | None,
                   stored: StoredSession | None) -> str | None:
        """Why ``conn``'s user may not take its client id (another user's session), or None."""
        user, cid = conn.username, conn.client_id
        old = self.connections.get(cid)
        if old is not None and old is not conn and old.username != user:
            return f"client id {cid!r} is connected as user {old.username!r}, not {user!r}"
        if mem is not None:
            owner, known, filters = mem.owner, True, list(mem.subs)
        elif stored is not None:
            owner, known, filters = stored.owner, stored.owner_known, list(stored.subscriptions)
        else:
            return None
        if known:
            if owner != user:
                return f"the session of client id {cid!r} belongs to user {owner!r}, not {user!r}"
            return None
        # A session file from before owners were recorded: adopted by the first client whose
        # ACL allows all its subscriptions (see session_store.py).
        assert conn.acl is not None
        denied = [f for f in filters if not conn.acl.can_subscribe(f)]
        if denied:
            return (f"the session of client id {cid!r} has no recorded owner and user {user!r} "
                    f"may not subscribe to its filter {denied[0]!r}")
        return None

    def _accept(self, conn: Connection, p: Connect) -> None:
        cid = conn.client_id
        conn.acl = self.acl.for_client(conn.username, cid)
        mem = self.registry.sessions.get(cid)
        stored = self.registry.store.load(cid) if mem is None else None
        discarded: asyncio.Future[None] | None = None  # an old session file being removed
        if (mem is not None or stored is not None) and self.registry.expired(cid, stored):
            # Its Session Expiry Interval elapsed and the tick has not released it yet.
            discarded = self.registry.discard(cid, "its session expiry interval elapsed")
            mem = stored = None
        why = self._not_owner(conn, mem, stored)
        if why is not None:
            # Neither resumed nor discarded: a session belongs to the user who made it.
            self._refuse(conn, CONNACK_NOT_AUTHORIZED, why)
            return
        old = self.connections.get(cid)
        if old is not None and old is not conn:
            # 3.1.4-2: the existing client is disconnected (MQTT 5: DISCONNECT 0x8E, session
            # taken over, MQTT-3.1.4-3); it did not send DISCONNECT: see _take_over.
            self._take_over(old, conn, p)
            if mem is not None and self.registry.sessions.get(cid) is not mem:
                mem = stored = None  # its session ended with it (MQTT 5 session expiry 0)
        present = adopted = False
        # None: MQTT 3.1.1 (a persistent session never expires); MQTT 5: the interval, 0 = the
        # session ends with the network connection (3.1.2.11.2).
        expiry = session_expiry(p)
        if p.clean_session:
            discarded = self.registry.discard(cid, "it connected with clean_session = 1 (Clean Start)") or discarded
            mem = stored = None
        if (p.clean_session and not expiry) or (expiry == 0 and mem is None and stored is None):
            state = SessionState(cid, persistent=False, owner=conn.username)
        else:
            if mem is not None:
                state, present = mem, True
            else:
                state = SessionState(cid, persistent=True, owner=conn.username)
                if stored is not None:
                    present = True
                    for f, entry in stored.subscriptions.items():
                        share, plain = parse_share_key(f)
                        state.subs[f] = Subscription(f, plain, share, entry.qos, entry.start, entry.retain_below,
                                                     entry.options, entry.identifier)
                    state.qos.restore(stored.qos2_inbound, stored.qos2_offsets, stored.qos2_outbound)
                    state.subs_changed()
                    for sub in state.subs.values():
                        if sub.share is not None:
                            self.router.recreate_if_missing(cid, SHARE_GROUP_PREFIX + sub.share, (sub.plain,))
                    if state.own_filters():
                        self.router.recreate_if_missing(cid, SESSION_GROUP_PREFIX + cid, state.own_filters())
                        state.group = self.router.group(SESSION_GROUP_PREFIX + cid, state.own_filters(), True)
                    if stored.own_offsets:  # no local across a restart (MQTT-3.8.3-3)
                        state.own_runs = OwnRuns(stored.own_offsets)
                    if stored.qos2_sent:  # outbound QoS 2 ids the client may hold: kept (MQTT-2.2.1-3)
                        self.qos.resume_outbound(state, stored.qos2_sent)
                    state.expiry, state.disconnected_at = stored.expiry, stored.disconnected_at
                    if not stored.owner_known:
                        log.warning("client %r: its session file has no owner (written by an older "
                                    "filemq); adopted by user %r", cid, conn.username)
                        adopted = True  # written below, with the owner
                self.registry.sessions[cid] = state
            # MQTT 5 session expiry: the clock stops while connected; a delayed will of the
            # session is not sent (MQTT-3.1.3-9).  The file says "connected" (and the new
            # interval) before CONNACK: after a crash the interval never counts from an older
            # close (never released early).
            self.registry.resumed(state)
            expiry_written = not present or (state.expiry == expiry and state.disconnected_at is None)
            state.expiry, state.disconnected_at = expiry, None
            # A new session's file, or one auto-subscribe changed, is written before CONNACK
            # (so a reconnect after a crash reports session_present = 1), in a worker
            # thread; a write of this session already under way is waited for too.
            if (self._auto_subscribe(conn, state) or not present or adopted or state.save_running
                    or state.save_next is not None or not expiry_written):
                written = self.registry.save_now(state)
                if written.done():  # (a writer that runs inline, as in tests)
                    self._session_written(conn, state, p, present, written)
                    return
                conn.state = AUTHENTICATING  # packets arriving meanwhile wait (backlog)
                written.add_done_callback(functools.partial(self._session_written, conn, state, p, present))
                return
        if discarded is not None and not discarded.done():
            # CONNACK once the old session's file is gone (removed in a worker thread): a crash
            # after it must not bring back a session the client was told is discarded.
            conn.state = AUTHENTICATING
            discarded.add_done_callback(functools.partial(self._session_written, conn, state, p, present))
            return
        self._connected(conn, state, p, present)

    def _session_written(self, conn: Connection, state: SessionState, p: Connect, present: bool,
                         done: asyncio.Future[None]) -> None:
        failed = done.cancelled() or done.exception() is not None
        if failed and not present and self.registry.sessions.get(state.client_id) is state and state.conn is None:
            del self.registry.sessions[state.client_id]  # never report a session that is not on disk
        if conn.closed:
            return
        if failed:
            self._refuse(conn, CONNACK_SERVER_UNAVAILABLE, "writing the session file failed")
        elif state.persistent and self.registry.sessions.get(state.client_id) is not state:
            self._refuse(conn, CONNACK_SERVER_UNAVAILABLE, "its session was discarded meanwhile (clean_session = 1)")
        else:
            old = self.connections.get(conn.client_id)
            if old is not None and old is not conn:
                self._take_over(old, conn, p)
            conn.state = AWAITING_CONNECT
            self._connected(conn, state, p, present)
            self.resume(conn)
        self.delivery.flush()

    def _connected(self, conn: Connection, state: SessionState, p: Connect, present: bool) -> None:
        """CONNACK (accepted) and the session's start: subscriptions, re-sends, deliveries."""
        cid = conn.client_id
        conn.session = state
        state.conn = conn
        state.expiry = session_expiry(p)
        self.connections[cid] = conn
        conn.state = CONNECTED
        self.stats.client_connected()
        if conn.protocol_level == PROTOCOL_LEVEL_5:
            conn.send_packet(Connack(present, CONNACK_ACCEPTED, self._connack_properties(conn, p)))
            if conn.closed:
                return  # the CONNACK does not fit the client's Maximum Packet Size (closed)
        else:
            conn.send_packet(Connack(present, CONNACK_ACCEPTED))
        for sub in state.subs.values():
            self.router.register(conn, sub)
        self.qos.resend(conn, state)  # 4.4: unacknowledged PUBLISH (DUP) and PUBREL, original ids
        log.info("client %r connected from %s (clean_session=%s, keepalive=%d, session_present=%s)",
                 cid, conn.peer, p.clean_session, conn.keepalive, present)
        self.delivery.pump(conn)

    def _connack_properties(self, conn: Connection, p: Connect) -> Properties:
        """What an MQTT 5 CONNACK tells the client (3.2.2.3): the limits it must keep and the
        features filemq offers, stated as they are."""
        props = Properties(maximum_packet_size=conn.max_packet_size)
        if self.config.receive_maximum < 65535:
            props.receive_maximum = self.config.receive_maximum  # 3.2.2.3.3 (absent = 65535)
        if self.config.topic_alias_maximum:
            props.topic_alias_maximum = self.config.topic_alias_maximum  # 3.2.2.3.8 (absent = 0)
        # No Response Information (3.1.2.11.6 allows it) and no Reason Strings at all, so
        # Request Problem Information 0 (3.1.2.11.7) changes nothing we send.
        if conn.assigned_id:
            props.assigned_client_identifier = conn.client_id  # MQTT-3.2.2-16
        if conn.keepalive != p.keepalive:
            props.server_keep_alive = conn.keepalive  # keepalive_max applies (MQTT-3.2.2-21)
        # Retained messages, wildcards and shared subscriptions are available (the defaults,
        # 3.2.2.3.5/.11/.13), and so are subscription identifiers (3.2.2.3.12).
        return props

    def on_disconnect(self, conn: Connection, p: Disconnect) -> None:
        """A client's DISCONNECT: normal (no will) or, MQTT 5, 0x04 "with will message"; an
        MQTT 5 DISCONNECT may set a new session expiry interval (3.14.2.2.2)."""
        state = conn.session
        props = p.properties
        if props is not None and props.session_expiry_interval is not None and state is not None:
            if not state.expiry and props.session_expiry_interval:
                raise ProtocolError("DISCONNECT sets a session expiry interval after CONNECT set 0 "
                                    "(MQTT-3.14.2-2... 3.14.2.2.2)", "DISCONNECT", RC_PROTOCOL_ERROR)
            self._set_expiry(state, props.session_expiry_interval)
        with_will = conn.protocol_level == PROTOCOL_LEVEL_5 and p.reason_code == 0x04
        conn.close(f"client sent DISCONNECT (reason 0x{p.reason_code:02x})", will=with_will, level=logging.INFO)

    def _set_expiry(self, state: SessionState, expiry: int) -> None:
        """A new session expiry interval from DISCONNECT; 0 ends the session with this connection."""
        state.expiry = expiry

    def _auto_subscribe(self, conn: Connection, state: SessionState) -> bool:
        """Add the auto-subscribe rules' filters; True if any was new (to be written)."""
        changed = False
        for rule in self.config.auto_subscribe:
            filled = fill_pattern(rule.filter, conn.username, conn.client_id)  # one pass
            if filled is None:
                continue
            f = filled
            if f in state.subs:
                continue
            try:
                share, plain = parse_share_key(f)
                validate_topic_filter(plain)
            except InvalidTopic as exc:
                log.warning("auto-subscribe %r for client %r skipped: %s", rule.filter, conn.client_id, exc)
                continue
            assert conn.acl is not None
            if not conn.acl.can_subscribe(f):
                log.warning("auto-subscribe %r for client %r denied by the ACL", f, conn.client_id)
                continue
            state.subs[f] = Subscription(f, plain, share, rule.qos, self.ingest.routed_offset)
            changed = True
        if changed:
            state.subs_changed()
            self.router.update_groups(state)
        return changed
