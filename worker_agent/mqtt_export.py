"""An MQTT export: the device log shipped record by record to any MQTT 5.0 or 3.1.1 broker.

A :class:`MqttExport` reads its durable consumer group (``export.NAME``) and publishes each
record with the export's QoS to ``topic_template`` on the upstream broker, through one
:class:`worker_agent.mqtt_link.ExportLink` kept for the life of the export (a lean publisher:
a batch of records becomes one write, acknowledgements are parsed in bulk).

What a caller may rely on:

* **The group moves only over what the destination acknowledged.** A record is acked in the
  group when its PUBACK (QoS 1) or PUBCOMP (QoS 2) arrives; the group's Pending offset is the
  lowest record not yet acked, so it only ever moves over a gap-free acknowledged prefix,
  whatever order the acknowledgements come in. After a crash the export resumes there.
* **The unacknowledged window goes first, with DUP.** The upstream session is persistent
  (clean session off) and the client keeps its in-flight publishes across reconnects: on
  each reconnect they are sent again with their packet ids and DUP set before any new record
  (MQTT-4.4.0-1). After a restart, records the group may have handed out before the restart
  are published with DUP set (MQTT-3.3.1-1).
* **QoS 2 after a restart.** The new process does not know which packet ids the upstream
  session still holds for half-finished QoS 2 exchanges; a stale id would make the broker
  take a new message for a duplicate and drop it. So a QoS 2 export's first connection in a
  process is a clean one (the broker forgets those ids), then it reconnects persistent; the
  records it had not completed are sent again (at least once, never lost).
* **No acknowledgement never means waiting forever.** When the oldest publish in flight has
  not been acknowledged for ``ack_timeout_s`` (a destination that accepts the connection but
  stops acknowledging, or answers a QoS 1 PUBLISH with PUBREC), the export closes the
  connection, backs off and reconnects; the window is then sent again with the same packet
  ids and DUP set (MQTT-4.4.0-1). The first such timeout is logged at WARNING with the packet
  id and the time waited, every one is counted (``stats.ack_timeouts``).
* **MQTT 5 end to end.** ``protocol`` "5", or "auto" (the default: MQTT 5, 3.1.1 when the
  destination refuses it; ``stats.protocol`` says which and why): a record's message
  properties go upstream with it, the expiry interval lowered by its time in the log; a
  record whose message expiry passed before it was sent is not sent (acked, counted in
  ``stats.expired_skipped``, as the broker never delivers one, MQTT-3.3.2-5); the window is
  at most the destination's Receive Maximum and a record over its Maximum Packet Size is
  set aside as one over ``max_packet_size`` is.
* **Failures back off, never skip.** A refused login (wrong credentials), an unreachable or
  restarting broker: the reason is logged and kept in ``stats.last_error``, the export waits
  with full-jitter exponential backoff and tries again; no record is acked without its
  acknowledgement. One export never waits for another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from filemq.broker.session_state import message_expiry
from filemq.common.aio import cancel_and_wait
from filemq.mqtt.client import ConnectionRefused
from worker_agent.forwarder import CONSUMER, ForwardGroup, RateLimiter, backoff_delay
from worker_agent.mqtt_link import ExportLink, Message
from worker_agent.uplink import MAX_GRANT_BYTES

if TYPE_CHECKING:
    from filemq.common.config import ExportSection
    from segments import Record

log = logging.getLogger(__name__)

_OFFSET = attrgetter("offset")
_PAYLOAD = attrgetter("payload")
_HEADERS = attrgetter("headers")

# Records per group fetch, and so per write upstream. Larger runs made a drain stop-and-go (a
# long fetch and publish while acknowledgements wait): 512 keeps the pipe smooth.
FETCH_MAX = 512
MAX_INFLIGHT_BYTES = 16 << 20  # payload bytes in flight, whatever the window in records
PUBLISH_OVERHEAD = 7  # fixed header, topic length, packet id: bytes per PUBLISH besides topic and payload
PUBLISH_MAX_OVERHEAD = 9  # the same with a 4-byte remaining length: an upper bound


class ExportGroup(ForwardGroup, Protocol):
    """The consumer group of an export (``filemq.queue.groups.ConsumerGroup``)."""

    def redelivered(self, offset: int) -> bool: ...

    def may_be_redelivered(self, lowest: int) -> bool: ...

    def ack_many(self, offsets: Sequence[int]) -> int: ...


class ExportClient(Protocol):
    """What the export needs of its upstream connection (:class:`worker_agent.mqtt_link.ExportLink` fits)."""

    closed: asyncio.Event
    close_reason: BaseException | None
    clean_session: bool
    protocol_level: int
    fallback: str | None
    send_quota: int
    server_max_packet: int | None
    on_complete: Callable[[list[Message]], None] | None
    topic_of: Callable[[str], str]
    inflight: dict[int, Message]
    coalesce_above: int

    async def connect(self, timeout: float = 10.0) -> object: ...

    def publish(self, messages: Sequence[Message], retain: bool,
                redelivered: Callable[[int], bool] | None) -> int: ...

    async def disconnect(self, timeout: float = 5.0) -> None: ...


@dataclass
class ExportStats:
    """Counters and state of one export (``filemq status``, ``$SYS``, Prometheus)."""

    state: str = "starting"  # connected | backoff | stopped
    last_error: str | None = None
    connects: int = 0
    connect_failures: int = 0
    disconnects: int = 0
    records_sent: int = 0
    records_acked: int = 0
    bytes_sent: int = 0
    bytes_acked: int = 0
    inflight: int = 0
    acked_offset: int = -1  # offset of the last record acknowledged upstream
    last_ack_unix: float | None = None
    oversized_skipped: int = 0  # records over max_packet_size: set aside, never sent (a counted loss)
    ack_timeouts: int = 0  # connections ended because the oldest publish in flight was not acknowledged
    protocol: str = ""  # "5", "3.1.1", or "3.1.1 (fallback: why)" once connected
    expired_skipped: int = 0  # MQTT 5 records whose message expiry passed before they were sent


@dataclass(frozen=True)
class MqttExportSettings:
    """How one MQTT export publishes and retries (from its ``[[export]]`` table)."""

    name: str
    device_id: str
    qos: int = 1
    retain: bool = True
    topic_template: str = "{topic}"
    window: int = 8000
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 60.0
    connect_timeout_s: float = 10.0
    max_packet_size: int | None = None  # the destination's limit; larger PUBLISHes are never sent
    ack_timeout_s: float = 30.0  # the oldest publish in flight unacknowledged this long: reconnect

    @classmethod
    def from_section(cls, spec: ExportSection, device_id: str, backoff_initial_s: float,
                     backoff_max_s: float, ack_timeout_s: float = 30.0) -> MqttExportSettings:
        if spec.ack_timeout_ms is not None:
            ack_timeout_s = spec.ack_timeout_ms / 1000
        return cls(spec.name, device_id, spec.qos, spec.retain, spec.topic_template,
                   spec.window or cls.window, backoff_initial_s, backoff_max_s,
                   max_packet_size=spec.max_packet_size, ack_timeout_s=ack_timeout_s)


class AckTimeout(Exception):
    """The destination did not acknowledge the oldest publish in flight in time."""

    def __init__(self, packet_id: int, waited_s: float, inflight: int) -> None:
        super().__init__(f"no acknowledgement of packet id {packet_id} for {waited_s:.1f} s "
                         f"({inflight} publishes in flight)")
        self.packet_id = packet_id
        self.waited_s = waited_s


class MqttExport:
    """Ship one consumer group to an MQTT broker until :meth:`stop`."""

    kind = "mqtt"

    def __init__(
        self,
        group: ExportGroup,
        wait_for_records: Callable[[int], Awaitable[object]],
        make_client: Callable[[], ExportClient],
        settings: MqttExportSettings,
        *,
        limiter: RateLimiter | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.group = group
        self.settings = settings
        self.stats = ExportStats()
        self._wait_for_records = wait_for_records
        self._make_client = make_client
        self._limiter = limiter
        self._rng = rng or random.Random()
        self._template = self._topic_function(settings)
        self._carry: list[Record] = []  # fetched, not yet handed to the client
        self._client: ExportClient | None = None
        self._inflight_bytes = 0  # payload bytes published and not yet acknowledged
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._attempt = 0
        self._timeout_logged = False

    @staticmethod
    def _topic_function(s: MqttExportSettings) -> Callable[[str], str]:
        if s.topic_template == "{topic}":
            return lambda topic: topic
        template = s.topic_template
        return lambda topic: template.format(device_id=s.device_id, topic=topic, name=s.name)

    @property
    def name(self) -> str:
        return self.settings.name

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"filemq-export-{self.name}")

    async def stop(self) -> None:
        """Stop: disconnect (what is unacknowledged stays in the log for next time)."""
        self._stopping.set()
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        self.stats.state = "stopped"

    # -- the connection loop ------------------------------------------------------------------

    async def _run(self) -> None:
        client = self._client = self._make_client()
        client.on_complete = self._completed
        client.topic_of = self._template
        client.coalesce_above = max(self.settings.window // 2, 2)
        fresh = self.settings.qos == 2  # see the module doc: forget stale QoS 2 packet ids once
        try:
            while not self._stopping.is_set():
                try:
                    if fresh and not await self._reset_session(client):
                        continue
                    fresh = False
                    await self._connection(client)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.exception("export %r: unexpected error; reconnecting", self.name)
                    await self._backoff(f"unexpected error: {exc}")
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(3.0):
                    await asyncio.shield(client.disconnect(timeout=1.0))
            self._carry = []
            self._inflight_bytes = 0
            self.stats.inflight = 0
            self.group.release(CONSUMER)

    async def _reset_session(self, client: ExportClient) -> bool:
        """One clean connection, to drop the upstream session's QoS 2 state; False (after a
        backoff) if it could not be made."""
        client.clean_session = True
        try:
            if not await self._connect(client):
                return False
            await client.disconnect(timeout=1.0)
            return True
        finally:
            client.clean_session = False

    async def _connect(self, client: ExportClient) -> bool:
        """Connect; on failure count it, record why, back off and return False."""
        try:
            await client.connect(timeout=self.settings.connect_timeout_s)
        except ConnectionRefused as exc:
            self.stats.connect_failures += 1
            await self._backoff(f"the broker refused the connection: {exc.reason} (CONNACK {exc.return_code}); "
                                "check the export's username, password_file and client_id", error=True)
            return False
        except (OSError, TimeoutError, ConnectionError) as exc:
            self.stats.connect_failures += 1
            await self._backoff(f"cannot connect: {exc or type(exc).__name__}")
            return False
        return True

    async def _connection(self, client: ExportClient) -> None:
        if not await self._connect(client):
            return
        self.stats.connects += 1
        self.stats.state = "connected"
        self.stats.last_error = None
        level = "5" if client.protocol_level == 5 else "3.1.1"
        self.stats.protocol = level if client.fallback is None else f"{level} (fallback: {client.fallback})"
        log.info("export %r connected; backlog %d records", self.name, self.group.lag)
        pump = asyncio.create_task(self._pump(client), name=f"filemq-export-{self.name}-pump")
        closed = asyncio.create_task(client.closed.wait(), name=f"filemq-export-{self.name}-closed")
        watch = asyncio.create_task(self._watch_acks(client), name=f"filemq-export-{self.name}-acks")
        tasks = {pump, closed, watch}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5.0)
        self.stats.disconnects += 1
        reason: object = client.close_reason
        for task in (pump, watch):
            if task in done and not task.cancelled() and task.exception() is not None:
                reason = task.exception()
        if isinstance(reason, AckTimeout):
            self.stats.ack_timeouts += 1
            if not self._timeout_logged:
                self._timeout_logged = True
                log.warning("export %r: the destination %s has not acknowledged packet id %d for %.1f s "
                            "(ack_timeout_ms %d); closing the connection, the window is resent with DUP "
                            "after the reconnect (logged the first time only; counted in ack_timeouts)",
                            self.name, self._destination(client), reason.packet_id, reason.waited_s,
                            round(self.settings.ack_timeout_s * 1000))
            # The connection is up but useless: end it (the window stays in flight for the next).
            with contextlib.suppress(Exception):
                await client.disconnect(timeout=1.0)
        if not self._stopping.is_set():
            await self._backoff(f"connection lost: {reason or 'closed'}")

    async def _watch_acks(self, client: ExportClient) -> None:
        """Raise :class:`AckTimeout` once the oldest publish in flight has waited ``ack_timeout_s``.

        The oldest is the first packet id of ``client.inflight`` (send order); its wait is
        counted from when it became the oldest, so one check a fraction of the timeout apart
        costs nothing per record, and a destination that acknowledges out of order but never
        the oldest one is caught as well.
        """
        timeout = self.settings.ack_timeout_s
        inflight = client.inflight
        head: int | None = None
        since = time.monotonic()
        while True:
            await asyncio.sleep(min(timeout / 4, 1.0))
            now = time.monotonic()
            first = next(iter(inflight), None)
            if first != head:
                head, since = first, now
            elif first is not None and now - since >= timeout:
                raise AckTimeout(first, now - since, len(inflight))

    @staticmethod
    def _destination(client: ExportClient) -> str:
        host, port = getattr(client, "host", "?"), getattr(client, "port", "?")
        return f"{host}:{port}"

    async def _backoff(self, reason: str, *, error: bool = False) -> None:
        s = self.settings
        delay = backoff_delay(self._attempt, s.backoff_initial_s, s.backoff_max_s, self._rng)
        self._attempt += 1
        self.stats.state = "backoff"
        self.stats.last_error = reason
        (log.error if error else log.warning)("export %r: %s; retrying in %.2f s", self.name, reason, delay)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._stopping.wait()

    # -- sending --------------------------------------------------------------------------------

    async def _pump(self, client: ExportClient) -> None:
        """Publish records as the window allows; records stay in ``_carry`` until published."""
        s = self.settings
        group = self.group
        window = min(s.window, client.send_quota)  # MQTT 5: the destination's Receive Maximum
        inflight = client.inflight
        # Refill the window in chunks, not a record per acknowledgement: fewer, larger writes.
        # Not a small one (an MQTT 5 Receive Maximum, mosquitto's 20): there the next PUBLISH
        # must go at the first acknowledgement, or this side's delayed ACK meets the
        # destination's Nagle and the rest of the acknowledgements wait ~40 ms (measured:
        # 434 records/s to mosquitto with a refill of 5 of 20).
        refill = max(1, min(window // 4, FETCH_MAX)) if window >= 256 else 1
        limiter = self._limiter
        while True:
            while len(inflight) > window - refill or self._inflight_bytes > MAX_INFLIGHT_BYTES:
                self._room.clear()
                await self._room.wait()
            if not self._carry:
                # A small window (an MQTT 5 Receive Maximum: mosquitto's is 20) still fetches
                # a full run and hands it out as room comes: one fetch per window would cost
                # more than the publishes (measured: 3,325 records/s to mosquitto).
                records = group.fetch(max(min(window - len(inflight), FETCH_MAX), min(FETCH_MAX, 128)), CONSUMER)
                if not records:
                    if group.has_work():
                        await asyncio.sleep(0)
                    else:
                        await self._wait_for_records(group.doing_offset)
                    continue
                self._carry = records
            room = window - len(inflight)
            chunk = self._carry if len(self._carry) <= room else self._carry[:room]
            if limiter is not None:
                chunk, size = _chunk(chunk)
                await limiter.take(size)
            self._publish(client, chunk)
            if chunk is self._carry:
                self._carry = []
            else:
                del self._carry[:len(chunk)]
            await asyncio.sleep(0)  # let the local broker run between chunks of a backlog

    def _publish(self, client: ExportClient, records: list[Record]) -> None:
        s = self.settings
        v5 = client.protocol_level == 5
        limit = s.max_packet_size
        what = "the export's max_packet_size"
        if v5 and client.server_max_packet is not None and (limit is None or client.server_max_packet < limit):
            limit, what = client.server_max_packet, "the destination's Maximum Packet Size (MQTT 5 CONNACK)"
        if limit is not None:
            records = self._set_aside_oversized(records, limit, v5, what)
            if not records:
                return
        if v5 and any(map(_HEADERS, records)):
            records = self._drop_expired(records)
            if not records:
                return
        group = self.group
        # One test per run of records instead of a call per record: a backlog's first send has
        # no DUP to set (only records handed out before a reconnect or a restart may).
        dup = group.redelivered if group.may_be_redelivered(min(map(_OFFSET, records))) else None
        sent_bytes = client.publish(records, s.retain, dup)
        self._inflight_bytes += sent_bytes
        stats = self.stats
        stats.inflight = len(client.inflight)
        stats.records_sent += len(records)
        stats.bytes_sent += sent_bytes

    def _drop_expired(self, records: list[Record]) -> list[Record]:
        """The records whose MQTT 5 message expiry has not passed; the others are acked unsent
        (a broker never delivers an expired message, MQTT-3.3.2-5), counted and logged once."""
        now_us = time.time_ns() // 1000
        keep: list[Record] = []
        for r in records:
            if not r.headers or message_expiry(r.headers, r.timestamp_us, now_us) is not None:
                keep.append(r)
                continue
            self.group.ack(r.offset)
            if not self.stats.expired_skipped:
                log.info("export %r: record %d on %r expired (MQTT 5 message expiry) before it was sent; "
                         "not sent (logged once; counted in expired_skipped)", self.name, r.offset, r.topic)
            self.stats.expired_skipped += 1
        return keep

    def _set_aside_oversized(self, records: list[Record], limit: int, v5: bool = False,
                             what: str = "the export's max_packet_size") -> list[Record]:
        """The records whose PUBLISH fits ``limit``; the others are acked without being sent.

        A broker closes the connection on a packet over its limit (MQTT 3.1.1 has no other
        refusal), so sending one would resend it forever and wedge every record behind it:
        a counted, logged loss instead (the record stays readable in the log until retention).
        """
        topic_of = self._template
        keep: list[Record] = []
        for r in records:
            size = PUBLISH_MAX_OVERHEAD + len(topic_of(r.topic).encode()) + len(r.payload)
            if v5:
                size += 4 + len(r.headers)  # the property length (at most 4 bytes) and the properties
            if size <= limit:
                keep.append(r)
                continue
            self.group.ack(r.offset)
            self.stats.oversized_skipped += 1
            log.error("export %r: record %d (%d bytes on topic %r) exceeds %s %d; set aside, not sent",
                      self.name, r.offset, len(r.payload), r.topic, what, limit)
        return keep

    def _completed(self, messages: list[Message]) -> None:
        """The destination acknowledged these publishes (PUBACK / PUBCOMP): ack their records."""
        offsets = list(map(_OFFSET, messages))
        self.group.ack_many(offsets)
        acked_bytes = sum(map(len, map(_PAYLOAD, messages)))
        self._inflight_bytes -= acked_bytes
        top = max(offsets)
        stats = self.stats
        client = self._client
        stats.inflight = len(client.inflight) if client is not None else 0
        stats.records_acked += len(messages)
        stats.bytes_acked += acked_bytes
        if top > stats.acked_offset:
            stats.acked_offset = top
        stats.last_ack_unix = time.time()
        self._attempt = 0
        if self._timeout_logged:
            self._timeout_logged = False  # the next stall is logged again
            log.info("export %r: the destination acknowledges again (after %d ack timeouts in all)",
                     self.name, stats.ack_timeouts)
        self._room.set()


def _chunk(records: list[Record]) -> tuple[list[Record], int]:
    """The leading records worth at most MAX_GRANT_BYTES on the wire (at least one), and their size."""
    size = 0
    for i, r in enumerate(records):
        n = len(r.payload) + len(r.topic) + PUBLISH_OVERHEAD
        if i and size + n > MAX_GRANT_BYTES:
            return records[:i], size
        size += n
    return records, size


def mqtt_client_factory(spec: ExportSection, device_id: str) -> Callable[[], ExportLink]:
    """A function making the export's client: persistent session, its login and TLS settings.

    Raises :class:`filemq.common.config.ConfigError` when a password, CA or key file cannot be read.
    """
    import ssl

    from filemq.common.config import ConfigError, read_config_text

    password: str | None = spec.password
    if spec.password_file is not None:
        lines = read_config_text(spec.password_file, f"the password file of export {spec.name!r}").splitlines()
        if not lines:
            raise ConfigError(f"the password file of export {spec.name!r} is empty", file=spec.password_file)
        password = lines[0]
    context: ssl.SSLContext | None = None
    if spec.tls:
        try:
            context = ssl.create_default_context(cafile=spec.tls_ca)
            if spec.tls_cert is not None:
                context.load_cert_chain(spec.tls_cert, spec.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"export {spec.name!r}: cannot load its TLS files: {exc}",
                              key="export.tls_ca") from exc
    client_id = spec.client_id or f"filemq-{device_id}-{spec.name}"

    def make() -> ExportLink:
        return ExportLink(client_id, spec.host, spec.port, qos=spec.qos, clean_session=False, keepalive=30,
                          username=spec.username, password=password, ssl=context, protocol=spec.protocol)

    return make
