"""The fleet registry: every device a collector serves, whether it is connected, and its health.

A :class:`FleetRegistry` is fed by the collector on its event loop: :meth:`~FleetRegistry.seen`
for every PUBLISH a device's connection sends (a batch or a health report), with the
:class:`filemq.broker.session.connection.Connection` it came on; :meth:`~FleetRegistry.health` with each
decoded health report (:mod:`filemq.upstream.health`); :meth:`~FleetRegistry.landed` with the
rows the lander landed; and :meth:`~FleetRegistry.sweep` once a second, which notices a closed
connection (a kill -9 of the agent closes its socket: the collector sees it within a second,
not at a keepalive timeout) and a known device that connected again.

Per device it keeps first and last seen, connected now, remote address, records received and
landed per stream, the latest health report, a short history (lag over time, connects and
disconnects with their reason) and a :func:`device_state`: ``offline`` (not connected),
``stale`` (connected, no health report for ``fleet_stale_intervals`` intervals), ``disk_low``,
``behind`` (export lag or oldest unacknowledged age over the thresholds), else ``online``.

What a caller may rely on:

* **Durable and bounded.** :meth:`~FleetRegistry.save` writes one file, ``<data_dir>/fleet.json``,
  atomically (temporary name, fsync, rename, directory fsync, as the offset files); the
  collector saves it every :data:`SAVE_INTERVAL_S` (30 s) when something changed and at stop, and
  :meth:`~FleetRegistry.load` reads it back at start (a damaged file is logged and set aside,
  never fatal). Counters and the latest health survive a restart; history since the last
  save may not. At most ``fleet_max_devices`` devices are kept (the longest offline go first),
  each with a bounded history.
* Every device is ``offline`` after a restart until its agent connects again.
* Each collector knows only the devices it serves; see docs/DEPLOYMENT.md for a fleet behind
  several collectors.

Only the standard library (``filemq fleet``, :mod:`collector.fleet_view`, runs where Arrow is not installed).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gzip
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger(__name__)

FLEET_FILE = "fleet.json"
FILE_VERSION = 1
SAVE_INTERVAL_S = 30.0
HISTORY_POINTS = 120  # lag samples per device (one per health report: an hour at 30 s)
EVENTS_KEPT = 50  # connects/disconnects per device
STATES = ("online", "behind", "disk_low", "stale", "offline")
_NUMBER = (int, float)
# What /api/fleet shows of a device that changes without a new Device.version.
_DYNAMIC = ("state", "last_seen", "records_received", "records_landed")


class Conn(Protocol):
    """What the registry reads of a broker connection (:class:`filemq.broker.session.connection.Connection`)."""

    @property
    def closed(self) -> bool: ...

    @property
    def close_reason(self) -> str: ...

    @property
    def peer(self) -> str: ...


@dataclass(frozen=True)
class Thresholds:
    """The ``[collector] fleet_*`` keys (docs/CONFIG.md)."""

    behind_records: int = 100_000
    behind_age_s: float = 3600.0
    disk_low_bytes: int = 256 << 20
    stale_intervals: int = 3
    default_interval_s: float = 30.0  # a report that does not say its interval


@dataclass
class Device:
    """One device's entry (see the module docstring)."""

    device_id: str
    first_seen: float
    last_seen: float
    connected: bool = False
    client_id: str | None = None
    remote: str | None = None
    connected_since: float | None = None
    disconnected_at: float | None = None
    disconnect_reason: str | None = None
    connects: int = 0
    streams: dict[str, dict[str, int]] = field(default_factory=dict)
    health: dict[str, Any] | None = None
    health_json: bytes | None = None  # the report body's JSON text, when known
    health_at: float | None = None  # collector clock when the latest report arrived
    health_sent_at: float | None = None  # the device's clock when it sent it
    health_sequence: int = 0
    reports: int = 0
    history: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    events: deque[tuple[float, str, str]] = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    conn: Conn | None = None  # the live connection (not saved)
    # Counts changes to what /api/fleet shows of the device, but for last_seen and the record
    # counts (they change with every batch): the fragment below is re-encoded only after one.
    version: int = 0
    fragment: tuple[int, bytes] | None = None
    # A disconnect the event sink could not record yet (the WAL was closed): recorded at next start.
    pending_disconnect: tuple[float, str] | None = None
    _figures: tuple[object, int | None, float | None] | None = None  # (health, lag, age) of that report
    # (health, thresholds, stale window in s, state by that report): see device_state.
    _verdict: tuple[object, object, float, str] | None = None

    def _lag_and_age(self) -> tuple[int | None, float | None]:
        h = self.health
        cached = self._figures
        if cached is None or cached[0] is not h:  # once per report, not per view
            exports = (h or {}).get("exports") or []
            lags = [e["lag_records"] for e in exports if isinstance(e.get("lag_records"), int)]
            ages = [e["oldest_unacked_age_s"] for e in exports if isinstance(e.get("oldest_unacked_age_s"), _NUMBER)]
            cached = self._figures = (h, sum(lags) if lags else None, max(ages) if ages else None)
        return cached[1], cached[2]

    def lag_records(self) -> int | None:
        return self._lag_and_age()[0]

    def oldest_unacked_age_s(self) -> float | None:
        return self._lag_and_age()[1]


def device_state(d: Device, now: float, t: Thresholds) -> str:
    """``offline``, ``stale``, ``disk_low``, ``behind`` or ``online``, in that precedence."""
    if not d.connected:
        return "offline"
    h = d.health
    health_at = d.health_at
    if h is None or health_at is None:
        return "online"
    verdict = d._verdict
    if verdict is None or verdict[0] is not h or verdict[1] is not t:
        # What the report says depends on the report and the thresholds only: worked out once
        # per report, not at every /api/fleet build or scrape of thousands of devices.
        verdict = d._verdict = (h, t, t.stale_intervals * (h.get("interval_s") or t.default_interval_s),
                                _report_state(d, h, t))
    # A report is due at every connect, so a connection older than the window without a
    # fresh report is stale too.
    since = d.connected_since
    if now - (health_at if since is None or health_at >= since else since) > verdict[2]:
        return "stale"
    return verdict[3]


def _report_state(d: Device, h: dict[str, Any], t: Thresholds) -> str:
    """``disk_low``, ``behind`` or ``online``, by the latest report ``h`` of ``d``."""
    free = h.get("disk_free_bytes")
    if isinstance(free, int) and free < t.disk_low_bytes:
        return "disk_low"
    lag = d.lag_records()
    age = d.oldest_unacked_age_s()
    if (lag is not None and lag > t.behind_records) or (age is not None and age > t.behind_age_s):
        return "behind"
    return "online"


_ISO_SECONDS: dict[int, str] = {}


def iso(ts: float | None) -> str | None:
    """ISO 8601 UTC with milliseconds (``2026-11-27T21:24:00.123Z``), or None."""
    if ts is None:
        return None
    second = math.floor(ts)
    prefix = _ISO_SECONDS.get(second)
    if prefix is None:  # a fleet's timestamps share few seconds: format each second once
        if len(_ISO_SECONDS) >= 65536:
            _ISO_SECONDS.clear()
        prefix = _ISO_SECONDS[second] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return f"{prefix}.{min(int((ts - second) * 1000), 999):03d}Z"


class CachedBody:
    """A view's bytes (``/api/fleet``), built on the event loop and served from any thread.

    :meth:`get` (any thread) returns the last bytes built and whether they are fresh: at most
    ``max_age_s`` old. For bytes that are not, the caller asks for a build with :meth:`build_on`
    (one build on the loop however many callers ask) and waits for it a short while; a loop busy
    with thousands of sockets may not run it for hundreds of milliseconds, and the caller then
    serves the last bytes (their ``generated_at`` says when they were built) as long as they are
    at most ``stale_s`` old. The registry is so encoded at most once per ``max_age_s`` and only
    when asked for, however often it is asked for.
    What a caller may rely on: a fresh body reflects the registry at most ``max_age_s`` ago, any
    body :meth:`get` returns at most ``stale_s`` ago (by ``clock``).
    """

    def __init__(self, build: Callable[[], bytes], *, max_age_s: float = 2.0, stale_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._build = build
        self.max_age_s = max_age_s
        self.stale_s = stale_s
        self._clock = clock
        self._body: tuple[float, bytes] | None = None  # (clock when the build started, bytes): replaced whole
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[bytes] | None = None  # the build asked for
        self._gzipped: tuple[bytes, bytes] | None = None  # (body, its gzip): compressed once per body
        self.builds = 0

    def get(self) -> tuple[bytes | None, bool]:
        """``(body, fresh)``: None for no body or one older than ``stale_s``."""
        body = self._body
        if body is None:
            return None, False
        age = self._clock() - body[0]
        if age > self.stale_s:
            return None, False
        return body[1], age <= self.max_age_s

    def build_on(self, loop: asyncio.AbstractEventLoop) -> concurrent.futures.Future[bytes]:
        """The build of new bytes on ``loop`` (queued unless one already is), to wait for."""
        with self._lock:
            pending = self._pending
            if pending is None:
                pending = self._pending = concurrent.futures.Future()
                loop.call_soon_threadsafe(self._build_pending, pending)
            return pending

    def _build_pending(self, pending: concurrent.futures.Future[bytes]) -> None:
        try:
            data = self.refresh()
        except Exception as exc:
            with self._lock:
                self._pending = None
            pending.set_exception(exc)
            return
        with self._lock:
            self._pending = None
        pending.set_result(data)

    def gzipped(self, body: bytes) -> bytes:
        """``body`` (one :meth:`get` returned) gzip-compressed, once per body, in the calling
        thread (zlib lets go of the GIL while it compresses): at 5,000 devices 84 KB to send
        instead of 2.5 MB."""
        kept = self._gzipped
        if kept is not None and kept[0] is body:
            return kept[1]
        data = gzip.compress(body, compresslevel=1, mtime=0)
        self._gzipped = (body, data)
        return data

    def refresh(self) -> bytes:
        """Build the bytes now (on the loop) and keep them."""
        started = self._clock()
        data = self._build()
        self._body = (started, data)
        self.builds += 1
        return data


EventSink = Callable[[str, str, float, Mapping[str, Any]], None]
"""``(device_id, kind, unix_time, details)``: a connect, disconnect or health event; raises if
it could not record it (a disconnect is then kept and offered again by :meth:`FleetRegistry.flush_pending`)."""


class FleetRegistry:
    """The devices of one collector (see the module docstring). Use it on the event loop."""

    def __init__(self, path: Path | None, thresholds: Thresholds | None = None, *, max_devices: int = 100_000,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.thresholds = thresholds or Thresholds()
        self.max_devices = max_devices
        self.devices: dict[str, Device] = {}
        self._by_client: dict[str, str] = {}  # client id -> device id (for the sweep)
        self._live: dict[str, Device] = {}  # the connected devices
        self._clock = clock
        self.dirty = False
        self.on_event: EventSink | None = None
        self.evicted = 0
        self.malformed_reports = 0
        self.frozen = False  # set by disconnect_all at shutdown: nothing changes afterwards

    def _changed(self, d: Device) -> None:
        d.version += 1
        self.dirty = True

    def now(self) -> float:
        """The registry's clock (Unix seconds)."""
        return self._clock()

    # -- feeding ---------------------------------------------------------------------------------

    def _device(self, device_id: str, now: float) -> Device:
        d = self.devices.get(device_id)
        if d is None:
            if len(self.devices) >= self.max_devices:
                self._evict()
            d = Device(device_id, now, now)
            self.devices[device_id] = d
        return d

    def _evict(self) -> None:
        """Forget the device offline the longest (connected devices are never evicted)."""
        offline = [d for d in self.devices.values() if not d.connected]
        if not offline:
            return
        victim = min(offline, key=lambda d: d.last_seen)
        del self.devices[victim.device_id]
        if victim.client_id is not None and self._by_client.get(victim.client_id) == victim.device_id:
            del self._by_client[victim.client_id]
        self.evicted += 1
        log.info("fleet: forgot device %r (offline since %s; fleet_max_devices %d reached)",
                 victim.device_id, iso(victim.last_seen), self.max_devices)

    def seen(self, device_id: str, client_id: str, peer: str, conn: Conn | None,
             stream: str | None = None, records: int = 0) -> Device:
        """A PUBLISH of ``device_id`` arrived on ``conn``; ``records`` were stored for ``stream``."""
        now = self._clock()
        d = self._device(device_id, now)
        if self.frozen:
            return d
        d.last_seen = now
        if conn is not None and (d.conn is not conn or not d.connected):
            if d.connected and d.conn is not None and d.conn is not conn:
                self._disconnected(d, now, d.conn.close_reason or "replaced by a new connection")
            self._connected(d, now, client_id, peer, conn)
        if stream is not None and records:
            counts = d.streams.get(stream)
            if counts is None:
                counts = d.streams[stream] = {"records_received": 0, "records_landed": 0}
            counts["records_received"] += records
        self.dirty = True  # (last_seen and the counts are not in the device's /api/fleet fragment)
        return d

    def health(self, device_id: str, body: dict[str, Any], sent_at_us: int, sequence: int,
               body_json: bytes | None = None) -> Device | None:
        """A decoded health report of ``device_id`` (call :meth:`seen` first); ``body_json`` is
        the body's JSON text as received (kept for the snapshot, so it is not encoded again).
        Returns the device (None once :meth:`disconnect_all` froze the registry)."""
        if self.frozen:
            return None
        now = self._clock()
        d = self._device(device_id, now)
        d.health = body
        d.health_json = body_json
        d.health_at = now
        d.health_sent_at = sent_at_us / 1e6
        d.health_sequence = sequence
        d.reports += 1
        lag = d.lag_records()
        if lag is not None:
            d.history.append((now, lag))
        self._changed(d)
        self._emit(device_id, "health", now, {"sequence": sequence})
        return d

    def landed(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Rows landed per ``(device_id, stream)`` by one roll of the lander."""
        now = self._clock()
        for (device_id, stream), rows in counts.items():
            d = self._device(device_id, now)
            c = d.streams.get(stream)
            if c is None:
                c = d.streams[stream] = {"records_received": 0, "records_landed": 0}
            c["records_landed"] += rows
            self.dirty = True

    def sweep(self, connections: Mapping[str, Conn]) -> None:
        """Once a second: mark devices whose connection closed as disconnected (with its reason),
        and known devices whose client id has a live connection as connected."""
        if self.frozen:
            return
        now = self._clock()
        # Work in proportion to the connections, not to every device ever seen.
        for d in list(self._live.values()):
            conn = d.conn
            if conn is None or conn.closed:
                reason = (conn.close_reason if conn is not None else "") or "connection closed"
                self._disconnected(d, now, reason)
        for client_id, live in connections.items():
            device_id = self._by_client.get(client_id)
            known = self.devices.get(device_id) if device_id is not None else None
            if known is not None and not known.connected and not live.closed and live is not known.conn:
                self._connected(known, now, client_id, live.peer, live)

    def _connected(self, d: Device, now: float, client_id: str, peer: str, conn: Conn) -> None:
        d.connected = True
        self._live[d.device_id] = d
        d.conn = conn
        d.client_id = client_id
        d.remote = peer or d.remote
        d.connected_since = now
        d.connects += 1
        d.last_seen = now
        self._by_client[client_id] = d.device_id
        d.events.append((now, "connect", peer))
        self._changed(d)
        log.info("fleet: device %r connected from %s", d.device_id, peer)
        self._emit(d.device_id, "connect", now, {"remote": peer, "client_id": client_id})

    def _disconnected(self, d: Device, now: float, reason: str) -> None:
        d.connected = False
        self._live.pop(d.device_id, None)
        d.disconnected_at = now
        d.disconnect_reason = reason
        d.last_seen = now
        d.events.append((now, "disconnect", reason))
        self._changed(d)
        log.info("fleet: device %r disconnected: %s", d.device_id, reason)
        if not self._emit(d.device_id, "disconnect", now, {"reason": reason, "remote": d.remote}):
            d.pending_disconnect = (now, reason)

    def _emit(self, device_id: str, kind: str, now: float, details: Mapping[str, Any]) -> bool:
        """Hand an event to the sink; False if the sink could not record it."""
        sink = self.on_event
        if sink is not None:
            try:
                sink(device_id, kind, now, details)
            except Exception as exc:
                log.warning("fleet: recording a %s event of %r failed: %s", kind, device_id, exc)
                return False
        return True

    def disconnect_all(self, reason: str) -> int:
        """Shutdown: every connected device disconnected now with ``reason`` (events recorded
        while the WAL is still open); the registry changes no more afterwards. Returns how many."""
        now = self._clock()
        gone = list(self._live.values())
        for d in gone:
            self._disconnected(d, now, reason)
        self.frozen = True
        return len(gone)

    def flush_pending(self) -> int:
        """Record the disconnects the sink could not take before (at start, once the WAL is
        open): a collector killed while devices were connected records them now, with the time
        of its last save. Returns how many were recorded."""
        done = 0
        for d in self.devices.values():
            pending = d.pending_disconnect
            if pending is None or d.connected:
                continue
            when, reason = pending
            if self._emit(d.device_id, "disconnect", when, {"reason": reason, "remote": d.remote}):
                d.pending_disconnect = None
                done += 1
                self.dirty = True
        return done

    # -- views -----------------------------------------------------------------------------------

    def counts(self, now: float | None = None) -> dict[str, int]:
        """Devices per state (every state present, 0 when none) and ``total``."""
        now = self._clock() if now is None else now
        out = dict.fromkeys(STATES, 0)
        t = self.thresholds
        for d in self.devices.values():
            out[device_state(d, now, t)] += 1
        out["total"] = len(self.devices)
        return out

    def summary(self, d: Device, now: float) -> dict[str, Any]:
        """One device as in ``/api/fleet`` (docs/DEPLOYMENT.md)."""
        h = d.health or {}
        exports = [
            {"name": e.get("name"), "state": e.get("state"), "lag_records": e.get("lag_records"),
             "lag_bytes": e.get("lag_bytes"), "oldest_unacked_age_s": e.get("oldest_unacked_age_s")}
            for e in h.get("exports") or []
        ]
        return {
            "device_id": d.device_id, "connected": d.connected, "state": device_state(d, now, self.thresholds),
            "last_seen": iso(d.last_seen), "first_seen": iso(d.first_seen), "remote": d.remote,
            "connected_since": iso(d.connected_since) if d.connected else None,
            "disconnected_at": iso(d.disconnected_at), "disconnect_reason": d.disconnect_reason,
            "exports": exports, "lag_records": d.lag_records(), "oldest_unacked_age_s": d.oldest_unacked_age_s(),
            "disk_free_bytes": h.get("disk_free_bytes"), "log_bytes": h.get("log_bytes"),
            "agent_version": h.get("agent_version"), "uptime_s": h.get("uptime_s"),
            "last_report": iso(d.health_at),
            "records_received": sum(c["records_received"] for c in d.streams.values()),
            "records_landed": sum(c["records_landed"] for c in d.streams.values()),
        }

    def fleet(self) -> dict[str, Any]:
        """The ``/api/fleet`` object: ``devices`` and ``counts`` by state."""
        now = self._clock()
        devices = [self.summary(d, now) for d in self.devices.values()]
        counts = dict.fromkeys(STATES, 0)
        for s in devices:
            counts[s["state"]] += 1
        counts["total"] = len(devices)
        return {"generated_at": iso(now), "counts": counts, "devices": devices}

    def fleet_json(self, extra: Mapping[str, Any]) -> bytes:
        """:meth:`fleet` plus ``extra`` as JSON bytes, for ``/api/fleet`` at thousands of
        devices: each device's object is encoded again only after it changed; what changes
        with every batch (``last_seen``, the record counts) and its state (which depends on the
        time) are put in front of the kept encoding."""
        now = self._clock()
        t = self.thresholds
        counts = dict.fromkeys(STATES, 0)
        parts: list[bytes] = []
        lead = "{"  # then ",{": each device is its fields in front and its kept fragment, not copied into one
        for d in self.devices.values():
            state = device_state(d, now, t)
            counts[state] += 1
            cached = d.fragment
            if cached is None or cached[0] != d.version:
                body = self.summary(d, now)
                for key in _DYNAMIC:
                    del body[key]
                cached = d.fragment = (d.version, json.dumps(body, separators=(",", ":")).encode()[1:])
            received = landed = 0
            for c in d.streams.values():
                received += c["records_received"]
                landed += c["records_landed"]
            parts.append(f'{lead}"state":"{state}","last_seen":"{iso(d.last_seen)}","records_received":{received},'
                         f'"records_landed":{landed},'.encode())
            parts.append(cached[1])
            lead = ",{"
        counts["total"] = len(self.devices)
        head = {"generated_at": iso(now), "counts": counts, **extra}
        parts.insert(0, json.dumps(head, separators=(",", ":")).encode()[:-1] + b',"devices":[')
        parts.append(b"]}")
        return b"".join(parts)

    def detail(self, device_id: str) -> dict[str, Any] | None:
        """The ``/api/fleet/<device>`` object: the summary, streams, latest report, history."""
        d = self.devices.get(device_id)
        if d is None:
            return None
        now = self._clock()
        out = self.summary(d, now)
        out.update(
            client_id=d.client_id, connects=d.connects, streams=d.streams, health=d.health,
            health_sent_at=iso(d.health_sent_at), health_sequence=d.health_sequence, reports=d.reports,
            history=[{"t": iso(t), "lag_records": lag} for t, lag in d.history],
            events=[{"t": iso(t), "event": kind, "detail": detail} for t, kind, detail in d.events],
        )
        return out

    def oldest_backlog_age_s(self) -> float:
        """The largest oldest-unacknowledged age over the connected devices (0 when none)."""
        ages = [a for d in self._live.values() for a in [d.oldest_unacked_age_s()] if a is not None]
        return max(ages, default=0.0)

    # -- durability ------------------------------------------------------------------------------

    def encode(self) -> bytes:
        """The snapshot bytes (history and connections are not kept). A device's latest health
        report is written as the JSON text it arrived in: a snapshot of thousands of devices
        encodes only their small bookkeeping."""
        parts: list[bytes] = []
        for d in self.devices.values():
            row = json.dumps({
                "device_id": d.device_id, "first_seen": d.first_seen, "last_seen": d.last_seen,
                "client_id": d.client_id, "remote": d.remote, "disconnected_at": d.disconnected_at,
                "disconnect_reason": d.disconnect_reason, "connects": d.connects,
                "streams": d.streams, "health_at": d.health_at, "health_sent_at": d.health_sent_at,
                "health_sequence": d.health_sequence, "reports": d.reports,
                "connected": d.connected, "pending_disconnect": d.pending_disconnect,
            }, separators=(",", ":")).encode()
            health = d.health_json
            if health is None:
                health = json.dumps(d.health, separators=(",", ":")).encode()
                if d.health is not None:
                    d.health_json = health
            parts.append(row[:-1] + b',"health":' + health + b"}")
        head = json.dumps({"version": FILE_VERSION, "saved_at": self._clock()}, separators=(",", ":")).encode()
        return head[:-1] + b',"devices":[' + b",".join(parts) + b"]}\n"

    def save(self, write: Callable[[Path, bytes], None]) -> None:
        """Write the snapshot with ``write`` (``segments.fileio.atomic_write``)."""
        if self.path is None:
            return
        data = self.encode()
        self.dirty = False
        write(self.path, data)

    def load(self) -> int:
        """Read the snapshot, if any; returns the devices loaded. A device connected at the
        save is now offline (the restart closed every connection), with that reason."""
        if self.path is None or not self.path.exists():
            return 0
        try:
            body = json.loads(self.path.read_bytes())
            rows = body["devices"] if body.get("version") == FILE_VERSION else None
            if not isinstance(rows, list):
                raise ValueError(f"unknown version {body.get('version')!r}")
            devices = [_device_from(row) for row in rows]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            aside = self.path.with_suffix(".damaged")
            log.error("fleet: %s is unreadable (%s); starting with an empty registry, the file is kept as %s",
                      self.path, exc, aside)
            with contextlib.suppress(OSError):
                self.path.replace(aside)
            return 0
        saved_at = float(body.get("saved_at") or self._clock())
        for d, was_connected in devices[: self.max_devices]:
            if was_connected:
                # Killed while this device was connected: its disconnect is recorded at start.
                d.disconnected_at = saved_at
                d.disconnect_reason = "collector restarted"
                d.pending_disconnect = (saved_at, "collector restarted")
            self.devices[d.device_id] = d
            if d.client_id is not None:
                self._by_client[d.client_id] = d.device_id
        return len(self.devices)


def _device_from(row: Mapping[str, Any]) -> tuple[Device, bool]:
    d = Device(str(row["device_id"]), float(row["first_seen"]), float(row["last_seen"]))
    d.client_id = row.get("client_id")
    d.remote = row.get("remote")
    d.disconnected_at = row.get("disconnected_at")
    d.disconnect_reason = row.get("disconnect_reason")
    d.connects = int(row.get("connects") or 0)
    d.streams = {str(k): {"records_received": int(v.get("records_received", 0)),
                          "records_landed": int(v.get("records_landed", 0))}
                 for k, v in (row.get("streams") or {}).items()}
    health = row.get("health")
    d.health = health if isinstance(health, dict) else None
    d.health_at = row.get("health_at")
    d.health_sent_at = row.get("health_sent_at")
    d.health_sequence = int(row.get("health_sequence") or 0)
    d.reports = int(row.get("reports") or 0)
    pending = row.get("pending_disconnect")
    if pending is not None:
        d.pending_disconnect = (float(pending[0]), str(pending[1]))
    return d, bool(row.get("connected"))
