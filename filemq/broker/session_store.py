"""The durable store of persistent MQTT sessions (clean_session = 0).

One small JSON file per session, ``<data_dir>/sessions/<escaped client id>.json``, replaced
with :func:`segments.fileio.atomic_write` (temp file, fdatasync, rename, directory fsync), so
a reader sees the old or the new version after a crash, never a mix.  What it holds:

* ``subscriptions``: filter -> ``{"qos", "start"}``; ``start`` is the log offset from which
  the subscription receives records (the log's next offset at SUBSCRIBE time), so a filter
  added later to a session whose consumer group is behind does not pull in older records.
  MQTT 5 adds ``"options"`` (the subscription options byte without its QoS bits) and ``"id"``
  (the subscription identifier), each only when not 0; absent means 0 (files before them).
* ``owner``: the username (``null`` for anonymous) of the client that created the session.
  Only that user may resume or discard it; another user with the same client id is refused
  (CONNACK 0x05).  A file written before this field existed has no owner: the first client
  that connects with its id adopts it (and the owner is written at once), but only when that
  client's ACL allows every stored subscription -- otherwise it is refused.
* ``qos2_inbound``: packet ids of QoS 2 PUBLISHes that were stored and PUBREC'ed but whose
  PUBREL has not been seen.  Added ids are written *after* the record's commit and *before*
  the PUBREC goes out; removals are written *before* the PUBCOMP goes out.  So the set on
  disk is exact: an id in it names a stored message whose PUBREL was not answered, and a
  PUBLISH with that id can only be a re-send of it (see docs/BROKER.md, "QoS 2 inbound").
  ``qos2_offsets`` maps each id to its record's log offset, so after a restart the broker
  checks a re-sent PUBLISH against that record before it answers PUBREC without storing.
* ``qos2_outbound`` (present when not empty): ids of QoS 2 deliveries to the client whose
  PUBREC arrived and whose PUBCOMP has not.  An id is written *before* the consumer group's
  ack of its record can be (so after a crash the record is re-sent or its PUBREL is);
  its removal at PUBCOMP is written soon after, not waited for (a stale id only costs a
  PUBREL the client answers with PUBCOMP, MQTT-4.3.3).  On reconnect the broker re-sends PUBREL for each.
* ``qos2_sent`` (present when not empty): outbound packet id -> log offset of every QoS 2
  PUBLISH of the session's own group sent to the client and not yet completed by PUBCOMP.
  Written *before* the PUBLISH leaves, so after a crash the broker knows every id the client
  may hold (MQTT 4.3.3 method B: it PUBREC'd and waits for PUBREL): on reconnect each is
  re-sent with its own id and DUP (MQTT-4.4.0-1), never reused for another message
  (MQTT-2.2.1-3), and the record is not delivered a second time under another id.  Offset
  -1 marks a retained message's delivery at SUBSCRIBE (no group record): after a restart
  the broker sends its PUBREL, which frees the id at the client.
  The broker writes in a worker thread (:meth:`SessionStore.write`), never on the event loop.
* ``own`` (present when not empty): offset runs ``[start, end)`` the session's own client
  published while it had a no local subscription (MQTT-3.8.3-3), pruned below the group's
  Pending offset, so no local holds after a restart however far behind the session is.
  Written lazily (the tick, a disconnect, shutdown): after a kill -9 a message published in
  the last seconds may come back to its publisher once.
* ``expiry`` and ``disconnected_at`` (format 2 only; an MQTT 5 session with a Session Expiry
  Interval, 3.1.2.11.2): the interval in seconds (0xFFFFFFFF = never) and the wall-clock time
  (Unix seconds) its connection closed, ``null`` while connected or when the close was not
  written (kill -9): then the interval counts from the broker's next start, never from an
  older time, so a session is never released early.  A file without them (format 1, every
  MQTT 3.1.1 session, byte for byte as before) never expires.
* ``will`` (format 2, present while one is held): an MQTT 5 will waiting for its Will Delay
  Interval (3.1.3.2.2) -- topic, payload and message properties (base64), QoS, retain and
  ``due``, the wall-clock time it is to be published.  A restart, or a kill -9, then keeps it:
  it is published when due, or when the session ends first, unless the client comes back
  before (MQTT-3.1.2-8).

The message backlog is not here: it stays in the log, behind the session's consumer group
(:mod:`filemq.queue.groups`).  Writes happen on SUBSCRIBE/UNSUBSCRIBE and on QoS 2 traffic, never
per QoS 0/1 message.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filemq.common.topics import InvalidTopic, parse_shared, validate_topic_filter
from filemq.queue.groups import escape_group_name
from segments.fileio import OS_FILE_IO, FileIO, atomic_write

log = logging.getLogger(__name__)

SESSIONS_DIR = "sessions"
# Written when the session has an MQTT 5 expiry interval; format 1 files load as before.
SESSION_FORMAT_EXPIRY = 2
NEVER_EXPIRES = 0xFFFFFFFF
SESSION_FORMAT = 1


@dataclass(slots=True)
class StoredWill:
    """An MQTT 5 will held for its Will Delay Interval; ``due`` is wall-clock (Unix) seconds."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    headers: bytes  # its will properties, as a record's message properties (segments format 2)
    due: float

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "payload": base64.b64encode(self.payload).decode("ascii"),
                "qos": self.qos, "retain": self.retain,
                "headers": base64.b64encode(self.headers).decode("ascii"), "due": self.due}

    @classmethod
    def from_dict(cls, raw: Any, path: str) -> StoredWill:
        if not isinstance(raw, dict):
            raise CorruptSession(path, "will is not an object")
        topic, qos, retain, due = raw.get("topic"), raw.get("qos"), raw.get("retain"), raw.get("due")
        try:
            payload = base64.b64decode(raw.get("payload", ""), validate=True)
            headers = base64.b64decode(raw.get("headers", ""), validate=True)
        except (ValueError, TypeError):
            raise CorruptSession(path, "will payload or headers are not base64") from None
        if (not isinstance(topic, str) or not topic or qos not in (0, 1, 2) or not isinstance(retain, bool)
                or not isinstance(due, (int, float)) or isinstance(due, bool) or due < 0):
            raise CorruptSession(path, f"bad will {raw!r:.200}")
        return cls(topic, payload, qos, retain, headers, float(due))


@dataclass(slots=True)
class StoredSubscription:
    """One durable subscription: requested-and-granted QoS and the first offset it receives;
    MQTT 5 also its subscription options without the QoS bits (no local, retain as published,
    retain handling, 3.8.3.1) and its subscription identifier (0: none, 3.8.2.1.2)."""

    qos: int
    start: int
    options: int = 0
    identifier: int = 0
    # Retained records below this offset reach it by the SUBSCRIBE's retained replay, not live
    # (MQTT-3.3.1-8); kept across a restart so they are not delivered twice (issue 33 item 3).
    retain_below: int = 0

    def to_dict(self) -> dict[str, int]:
        """The JSON entry: ``options``, ``id`` and ``rb`` (retain_below) only when set, so a
        3.1.1 session's file is as before and older releases (which ignore unknown keys)
        still read it."""
        entry = {"qos": self.qos, "start": self.start}
        if self.options:
            entry["options"] = self.options
        if self.identifier:
            entry["id"] = self.identifier
        if self.retain_below:
            entry["rb"] = self.retain_below
        return entry

    @classmethod
    def from_dict(cls, sub: dict[str, Any]) -> StoredSubscription | None:
        """Parse an entry (None: invalid); a file without ``options``/``id`` loads with 0."""
        options = sub.get("options", 0)
        identifier = sub.get("id", 0)
        retain_below = sub.get("rb", 0)
        if not isinstance(retain_below, int) or isinstance(retain_below, bool) or retain_below < 0:
            return None
        if (
            sub.get("qos") not in (0, 1, 2)
            or not isinstance(sub.get("start"), int) or sub["start"] < 0
            or not isinstance(options, int) or not 0 <= options <= 0xFF or options & 0x03
            or not isinstance(identifier, int) or not 0 <= identifier <= 268_435_455
        ):
            return None
        return cls(sub["qos"], sub["start"], options, identifier, retain_below)


@dataclass(slots=True)
class StoredSession:
    """What survives a broker restart of one persistent session."""

    client_id: str
    subscriptions: dict[str, StoredSubscription] = field(default_factory=dict)
    qos2_inbound: set[int] = field(default_factory=set)
    # id -> log offset of the stored message (files before this field have none).
    qos2_offsets: dict[int, int] = field(default_factory=dict)
    owner: str | None = None  # the username that created the session (None: anonymous)
    owner_known: bool = True  # False: a file from before owners were recorded
    # Outbound QoS 2 ids whose PUBREC arrived and whose PUBCOMP has not: PUBREL is re-sent.
    qos2_outbound: set[int] = field(default_factory=set)
    # MQTT 5 Session Expiry Interval in seconds (None: never, MQTT 3.1.1 / format 1) and the
    # wall-clock time its connection closed (None: connected, or the close was never written).
    expiry: int | None = None
    disconnected_at: float | None = None
    will: StoredWill | None = None  # an MQTT 5 will held for its delay (format 2)
    # Outbound QoS 2 PUBLISHes sent and not completed: packet id -> log offset (see the module doc).
    qos2_sent: dict[int, int] = field(default_factory=dict)
    # Offset runs [start, end) its own client published while it had a no local subscription.
    own_offsets: list[tuple[int, int]] = field(default_factory=list)

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": SESSION_FORMAT if self.expiry is None else SESSION_FORMAT_EXPIRY,
            "client_id": self.client_id,
            "owner": self.owner,
            "subscriptions": {
                f: s.to_dict() for f, s in sorted(self.subscriptions.items())
            },
            "qos2_inbound": sorted(self.qos2_inbound),
            "qos2_offsets": {str(pid): off for pid, off in sorted(self.qos2_offsets.items())},
        }
        if self.qos2_outbound:
            body["qos2_outbound"] = sorted(self.qos2_outbound)
        if self.qos2_sent:
            body["qos2_sent"] = {str(pid): off for pid, off in sorted(self.qos2_sent.items())}
        if self.own_offsets:
            body["own"] = [[s, e] for s, e in self.own_offsets]
        if self.expiry is not None:
            body["expiry"] = self.expiry
            body["disconnected_at"] = self.disconnected_at
            if self.will is not None:
                body["will"] = self.will.to_dict()
        return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii") + b"\n"

    @classmethod
    def from_json(cls, data: bytes, path: str) -> StoredSession:
        """Parse a session file; raises :class:`CorruptSession` naming ``path`` and the problem."""
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise CorruptSession(path, f"not JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") not in (SESSION_FORMAT, SESSION_FORMAT_EXPIRY):
            raise CorruptSession(path, "not a filemq session file (format field missing or unknown)")
        client_id = raw.get("client_id")
        subs = raw.get("subscriptions")
        ids = raw.get("qos2_inbound")
        if not isinstance(client_id, str) or not isinstance(subs, dict) or not isinstance(ids, list):
            raise CorruptSession(path, "client_id, subscriptions or qos2_inbound missing or of the wrong type")
        if "owner" in raw and raw["owner"] is not None and not isinstance(raw["owner"], str):
            raise CorruptSession(path, "owner is not a username")
        session = cls(client_id, owner=raw.get("owner"), owner_known="owner" in raw)
        for topic_filter, sub in subs.items():
            try:
                _, plain = parse_shared(topic_filter)
                validate_topic_filter(plain)
            except InvalidTopic as exc:
                raise CorruptSession(path, f"bad filter: {exc}") from None
            entry = StoredSubscription.from_dict(sub) if isinstance(sub, dict) else None
            if entry is None:
                raise CorruptSession(path, f"bad subscription entry for {topic_filter!r}")
            session.subscriptions[topic_filter] = entry
        for pid in ids:
            if not isinstance(pid, int) or not 0 < pid <= 0xFFFF:
                raise CorruptSession(path, f"bad QoS 2 packet id {pid!r}")
            session.qos2_inbound.add(pid)
        offsets = raw.get("qos2_offsets", {})
        if not isinstance(offsets, dict):
            raise CorruptSession(path, "qos2_offsets is not an object")
        for key, off in offsets.items():
            if not key.isdigit() or int(key) not in session.qos2_inbound or not isinstance(off, int) or off < 0:
                raise CorruptSession(path, f"bad qos2_offsets entry {key!r}: {off!r}")
            session.qos2_offsets[int(key)] = off
        released = raw.get("qos2_outbound", [])
        if not isinstance(released, list):
            raise CorruptSession(path, "qos2_outbound is not a list")
        for pid in released:
            if not isinstance(pid, int) or not 0 < pid <= 0xFFFF:
                raise CorruptSession(path, f"bad outbound QoS 2 packet id {pid!r}")
            session.qos2_outbound.add(pid)
        sent = raw.get("qos2_sent", {})
        if not isinstance(sent, dict):
            raise CorruptSession(path, "qos2_sent is not an object")
        for key, off in sent.items():
            if (not key.isdigit() or not 0 < int(key) <= 0xFFFF or not isinstance(off, int)
                    or isinstance(off, bool) or off < -1):  # -1: a retained message's delivery
                raise CorruptSession(path, f"bad qos2_sent entry {key!r}: {off!r}")
            session.qos2_sent[int(key)] = off
        own = raw.get("own", [])
        if not isinstance(own, list):
            raise CorruptSession(path, "own is not a list")
        last = -1
        for run in own:
            if (not isinstance(run, list) or len(run) != 2 or not all(type(x) is int for x in run)
                    or not last <= run[0] < run[1]):
                raise CorruptSession(path, f"bad own offset run {run!r:.100}")
            last = run[1]
            session.own_offsets.append((run[0], run[1]))
        if raw["format"] == SESSION_FORMAT_EXPIRY:
            expiry, at = raw.get("expiry"), raw.get("disconnected_at")
            if not isinstance(expiry, int) or isinstance(expiry, bool) or not 0 <= expiry <= NEVER_EXPIRES:
                raise CorruptSession(path, f"bad expiry {expiry!r}")
            if at is not None and (not isinstance(at, (int, float)) or isinstance(at, bool) or at < 0):
                raise CorruptSession(path, f"bad disconnected_at {at!r}")
            session.expiry = expiry
            session.disconnected_at = None if at is None else float(at)
            if raw.get("will") is not None:
                session.will = StoredWill.from_dict(raw["will"], path)
        return session

    def expires_at(self, started: float) -> float | None:
        """When (wall clock) this session expires if nobody resumes it, for a broker started at
        ``started``: None never; a close that was not written counts from ``started``."""
        if self.expiry is None or self.expiry == NEVER_EXPIRES:
            return None
        since = self.disconnected_at if self.disconnected_at is not None else started
        return since + self.expiry


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    """A session's file content at one moment; ``seq`` orders snapshots of one store."""

    client_id: str
    seq: int
    data: bytes


class CorruptSession(ValueError):
    """A session file that cannot be parsed; ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"session file {path}: {reason}")
        self.path = path
        self.reason = reason


class SessionStore:
    """Persistent sessions of one broker data directory.

    :meth:`load` returns None for an unknown client id; a damaged file is logged (WARNING),
    moved aside to ``<file>.corrupt`` and treated as unknown, so the client gets a fresh
    session rather than a broker that refuses to start or to accept it.  Every :meth:`save`
    is durable when it returns.
    """

    def __init__(self, data_dir: str | os.PathLike[str], fileio: FileIO = OS_FILE_IO) -> None:
        self.directory = Path(data_dir) / SESSIONS_DIR
        self._fileio = fileio
        os.makedirs(self.directory, exist_ok=True)
        self.writes = 0
        self._seq = 0  # snapshot numbers (event loop thread)
        self._written: dict[str, int] = {}  # client id -> number of the snapshot on disk
        # client id -> number of a deletion not done yet: load() already sees no session
        self._deleting: dict[str, int] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def path_of(self, client_id: str) -> Path:
        return self.directory / (escape_group_name(client_id) + ".json")

    def load(self, client_id: str) -> StoredSession | None:
        if client_id in self._deleting:
            return None  # its removal is under way in a worker thread
        path = self.path_of(client_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            session = StoredSession.from_json(data, str(path))
        except CorruptSession as exc:
            log.warning("%s; starting client %r with an empty session", exc, client_id)
            self._fileio.rename(path, path.with_name(path.name + ".corrupt"))
            return None
        if session.client_id != client_id:
            # Only a hashed long name can collide; never hand one client another's session.
            log.warning("session file %s belongs to client %r, not %r; ignored", path, session.client_id, client_id)
            return None
        return session

    def save(self, session: StoredSession) -> None:
        self.write(self.snapshot(session))

    def snapshot(self, session: StoredSession) -> SessionSnapshot:
        """``session`` as it is now, numbered; pass it to :meth:`write` (possibly in a thread).

        Call on the thread that changes the sessions (the event loop): the numbers order the
        snapshots as the state changed."""
        self._seq += 1
        self._deleting.pop(session.client_id, None)  # newer state than a pending removal
        return SessionSnapshot(session.client_id, self._seq, session.to_json())

    def deletion(self, client_id: str) -> SessionSnapshot:
        """A numbered snapshot that removes ``client_id``'s file when passed to :meth:`write`
        (possibly in a thread): the event loop never waits for the unlink and directory fsync,
        and the numbers keep it in order with the writes of that client."""
        self._seq += 1
        self._deleting[client_id] = self._seq
        return SessionSnapshot(client_id, self._seq, b"")

    def write(self, snap: SessionSnapshot) -> None:
        """Write ``snap`` durably (any thread); a :meth:`deletion` snapshot removes the file
        (unlink, directory fsync).  A snapshot older than the one last written (or than a
        :meth:`delete`) for the same client is skipped: a slow write never replaces newer
        state, nor revives a deleted session."""
        with self._lock_of(snap.client_id):
            if snap.seq <= self._written.get(snap.client_id, 0):
                return
            path = self.path_of(snap.client_id)
            if not snap.data:
                self._written[snap.client_id] = snap.seq  # an older write in flight must not revive it
                try:
                    if path.exists():
                        self._fileio.unlink(path)
                        self._fileio.fsync_dir(self.directory)
                finally:
                    if self._deleting.get(snap.client_id) == snap.seq:
                        self._deleting.pop(snap.client_id, None)
                return
            atomic_write(path, snap.data, self._fileio)
            self._written[snap.client_id] = snap.seq
            self.writes += 1

    def _lock_of(self, client_id: str) -> threading.Lock:
        with self._locks_lock:
            lock = self._locks.get(client_id)
            if lock is None:
                lock = self._locks[client_id] = threading.Lock()
            return lock

    def delete(self, client_id: str) -> bool:
        """Forget a session (clean_session = 1 discards the old one). True if a file existed."""
        self._seq += 1
        with self._lock_of(client_id):
            self._written[client_id] = self._seq  # a write still in flight must not revive it
            path = self.path_of(client_id)
            if not path.exists():
                return False
            self._fileio.unlink(path)
            self._fileio.fsync_dir(self.directory)
            return True

    def stored_sessions(self) -> Iterator[StoredSession]:
        """Every readable stored session (start-up: sessions whose expiry runs)."""
        for path in sorted(self.directory.glob("*.json")):
            try:
                yield StoredSession.from_json(path.read_bytes(), str(path))
            except (OSError, CorruptSession):
                continue

    def client_ids(self) -> Iterator[str]:
        """Client ids of every readable stored session (for status output and tests)."""
        for path in sorted(self.directory.glob("*.json")):
            try:
                yield StoredSession.from_json(path.read_bytes(), str(path)).client_id
            except (OSError, CorruptSession):
                continue
