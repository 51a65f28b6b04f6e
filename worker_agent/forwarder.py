"""The forwarder: ships the device log upstream in acknowledged batches.

A :class:`Forwarder` reads the log through a durable consumer group (named ``forwarder``
by the agent), packs records into batches (:mod:`filemq.upstream.batch`) bounded by records, bytes
and linger time, and publishes each batch with QoS 1 to the collector, keeping up to
``window`` batches in flight. Each record's headers (its MQTT 5.0 message properties) travel
with it: a batch holding any is format version 2, otherwise version 1 (docs/FORMAT.md).

What a caller may rely on:

* **Pending advances only on the collector's PUBACK, in order.** The records of batch k are
  acked in the group only after batch k's PUBACK *and* every earlier batch's; a PUBACK for
  k+1 that arrives first is held. So after a crash the group resumes at a point the
  collector has durably received everything below.
* **Nothing is skipped on a lost connection.** When the connection drops, or the oldest
  batch is not acknowledged within ``ack_timeout_s`` (a collector with a full disk stops
  acking), every batch in flight is sent again, verbatim and first, on the next connection
  (the collector drops what it already has by offset). :meth:`Forwarder.stop` hands the
  unacknowledged records back to the group.
* Reconnects use exponential backoff with full jitter between ``backoff_initial_s`` and
  ``backoff_max_s``; the backoff resets only when a batch is acknowledged, so a collector
  that accepts connections but never acks is not hammered.
* An optional token bucket caps the upstream rate (bytes of batch payload per second).
* **Nothing blocks the stream.** No PUBLISH larger than ``upstream_max_packet_size`` (the
  collector's packet limit) is sent: a batch over it is split in halves, and a single record
  that alone is too large (accepted locally under a raised ``broker.max_packet_size``) is set
  aside -- skipped upstream and acked in the group, it stays in the device log until
  retention removes it -- with an ERROR log naming its offset, and counted
  (``oversized_records``, ``$SYS/broker/forwarder/records/oversized_skipped``,
  ``filemq_agent_oversized_records_skipped_total``). A collector closes the connection on an
  oversized PUBLISH (MQTT 3.1.1 has no refusal), so sending it would wedge every record
  after it forever.

Timeouts use ``asyncio.timeout`` rather than ``asyncio.wait_for``, which on Python 3.11 can
swallow a cancellation that races with its inner result and leave a task running.

The forwarder knows nothing about sockets itself: ``connect`` builds an :class:`Upstream`
(an :class:`filemq.mqtt.MQTTClient` in production, a fake in tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, islice
from typing import TYPE_CHECKING, Protocol

from filemq.common.aio import cancel_and_wait
from filemq.upstream.batch import DEFAULT_STREAM, batch_topic, check_name, encode_batch
from filemq.upstream.health import health_topic

if TYPE_CHECKING:
    from segments import Record

log = logging.getLogger(__name__)

CONSUMER = "upstream"
RECORD_OVERHEAD = 21  # bytes per record in a batch besides topic, payload and headers (columns)
PUBLISH_OVERHEAD = 9  # a QoS 1 PUBLISH besides topic and payload: fixed header <= 5, lengths, id
DEFAULT_UPSTREAM_MAX_PACKET = 64 << 20  # every collector accepts at least this (MIN_PACKET_SIZE)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Upstream(Protocol):
    """One connection to the collector (``filemq.mqtt.MQTTClient`` fits)."""

    closed: asyncio.Event

    async def connect(self, timeout: float = 10.0) -> object: ...

    def publish_nowait(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False
    ) -> asyncio.Future[None]: ...

    async def disconnect(self, timeout: float = 5.0) -> None: ...


class ForwardGroup(Protocol):
    """What the forwarder needs of its consumer group (``filemq.queue.groups.ConsumerGroup``)."""

    @property
    def name(self) -> str: ...

    @property
    def pending_offset(self) -> int: ...

    @property
    def doing_offset(self) -> int: ...

    @property
    def lag(self) -> int: ...

    def fetch(self, max_records: int = 100, consumer: str = "") -> list[Record]: ...

    def ack(self, offset: int) -> bool: ...

    def release(self, consumer: str) -> int: ...

    def has_work(self) -> bool: ...


class RateLimiter(Protocol):
    """Paces sending: ``take(n)`` returns when ``n`` more bytes may go (:class:`TokenBucket` fits)."""

    async def take(self, n: int) -> None: ...


class UpstreamTimeout(Exception):
    """The collector did not acknowledge a batch in time (it may be out of disk)."""

    def __init__(self, first_offset: int, last_offset: int, seconds: float) -> None:
        super().__init__(
            f"collector did not acknowledge batch {first_offset}..{last_offset} within"
            f" {seconds:g} s; reconnecting"
        )
        self.first_offset = first_offset
        self.last_offset = last_offset


@dataclass(frozen=True)
class ForwarderConfig:
    """Batching, window, backoff and rate settings (``[agent]`` in the config file)."""

    device_id: str
    stream: str = DEFAULT_STREAM
    batch_records: int = 10_000
    batch_bytes: int = 1 << 20
    linger_s: float = 0.2
    window: int = 4
    compression: str = "none"
    rate_limit_bytes_per_s: int | None = None
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 60.0
    ack_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    upstream_max_packet_size: int = DEFAULT_UPSTREAM_MAX_PACKET

    def __post_init__(self) -> None:
        check_name("device id", self.device_id)
        check_name("stream", self.stream)
        if self.batch_records < 1 or self.batch_bytes < 1 or self.window < 1:
            raise ValueError("batch_records, batch_bytes and window must be at least 1")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.upstream_max_packet_size < 1024:
            raise ValueError("upstream_max_packet_size must be at least 1024 bytes")


@dataclass
class ForwarderStats:
    """Counters for ``$SYS``, ``filemq status`` and Prometheus (read them, don't write)."""

    connected: bool = False
    connects: int = 0
    connect_failures: int = 0
    disconnects: int = 0
    ack_timeouts: int = 0
    batches_sent: int = 0
    batches_acked: int = 0
    records_sent: int = 0
    records_acked: int = 0
    bytes_sent: int = 0
    bytes_acked: int = 0
    resent_records: int = 0  # records handed back to the group by a lost connection
    oversized_records: int = 0  # records too large for the collector: skipped (a counted loss)
    oversized_bytes: int = 0
    inflight_batches: int = 0
    health_reports_sent: int = 0
    acked_offset: int = -1  # highest offset acked by the collector (in order)
    last_ack_unix: float | None = None
    latency_sum_s: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def observe_latency(self, seconds: float) -> None:
        self.latency_sum_s += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_buckets[i] += 1
                return
        self.latency_buckets[-1] += 1


class TokenBucket:
    """A byte-rate limiter: ``take(n)`` waits until ``n`` bytes fit the rate.

    The bucket holds at most one second of tokens; a take larger than that is allowed and
    pays for itself by waiting (so a batch bigger than the rate is sent, then paused after).
    """

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = float(rate)
        self._clock = clock
        self._tokens = self.rate
        self._stamp = clock()

    def delay_for(self, n: int) -> float:
        """Take ``n`` tokens; the seconds to wait before using them (0 if available)."""
        now = self._clock()
        self._tokens = min(self.rate, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def take(self, n: int) -> None:
        delay = self.delay_for(n)
        if delay > 0:
            await asyncio.sleep(delay)


def backoff_delay(attempt: int, initial: float, maximum: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(maximum, initial * 2**attempt)]."""
    cap = min(maximum, initial * (2 ** min(attempt, 62)))
    return rng.uniform(0.0, cap)


@dataclass(slots=True)
class _Batch:
    """An encoded batch not yet acknowledged: sent again verbatim after a reconnect."""

    offsets: list[int]
    payload: bytes


@dataclass(slots=True)
class _InFlight:
    batch: _Batch
    future: asyncio.Future[None]
    sent_at: float


class Forwarder:
    """Forward one consumer group upstream until :meth:`stop`.

    ``wait_for_records(offset)`` must return once the log may hold a record at ``offset``
    (or later), e.g. ``Queue.wait_for_records``; the forwarder re-checks, so an early
    return is harmless.
    """

    def __init__(
        self,
        group: ForwardGroup,
        wait_for_records: Callable[[int], Awaitable[object]],
        connect: Callable[[], Upstream],
        config: ForwarderConfig,
        *,
        rng: random.Random | None = None,
        limiter: RateLimiter | None = None,
        health: Callable[[], bytes] | None = None,
        health_interval_s: float = 30.0,
    ) -> None:
        self.group = group
        self.config = config
        self.stats = ForwarderStats()
        self.topic = batch_topic(config.device_id, config.stream)
        self._publish_overhead = PUBLISH_OVERHEAD + len(self.topic.encode())
        self._wait_for_records = wait_for_records
        self._connect = connect
        self._rng = rng or random.Random()
        # ``limiter`` (the agent's shared uplink, worker_agent.uplink) replaces the own bucket.
        self._bucket: RateLimiter | None = limiter or (
            TokenBucket(config.rate_limit_bytes_per_s) if config.rate_limit_bytes_per_s else None
        )
        self._inflight: deque[_InFlight] = deque()  # sent on this connection, unacked
        self._unsent: deque[_Batch] = deque()  # encoded, not (or no longer) in flight
        self._carry: list[Record] = []  # fetched from the group, not yet in a batch
        self._building: list[Record] = []  # the batch being collected
        self._building_bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._attempt = 0
        # Health reports (worker_agent.health): sent at each connect and every interval; None:
        # never. Built when sent, so a report carries the figures of its moment.
        self._health = health
        if health is not None and health_interval_s <= 0:
            raise ValueError("health_interval_s must be positive (pass health=None to send no reports)")
        self._health_interval_s = health_interval_s
        self._health_topic = health_topic(config.device_id)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start forwarding in a background task (call on the event loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="filemq-forwarder")

    async def stop(self) -> None:
        """Stop: disconnect and hand every unacknowledged record back to the group."""
        self._stopping.set()
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        self._unsent.clear()
        self._carry = []
        self._building = []
        self._building_bytes = 0
        self.group.release(CONSUMER)

    @property
    def backlog(self) -> int:
        """Records in the log not yet acknowledged by the collector."""
        return self.group.lag

    # -- the connection loop ---------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._connection()
            except asyncio.CancelledError:
                raise
            except Exception:
                # Never let the forwarder die silently: log, back off, try again.
                log.exception("forwarder: unexpected error; reconnecting")
                await self._backoff("unexpected error")

    async def _connection(self) -> None:
        """One connection attempt and, if it succeeds, forwarding until it ends."""
        upstream = self._connect()
        try:
            await upstream.connect(timeout=self.config.connect_timeout_s)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stopping.is_set() or (task is not None and task.cancelling()):
                raise
            # A CancelledError from inside the client, not for us: a failed attempt.
            self.stats.connect_failures += 1
            await self._backoff("connection attempt cancelled")
            return
        except Exception as exc:
            self.stats.connect_failures += 1
            await self._backoff(f"cannot connect to the collector: {exc}")
            return
        self.stats.connects += 1
        self.stats.connected = True
        log.info("forwarder connected upstream; backlog %d records", self.group.lag)
        reason = "stopped"
        try:
            reason = await self._forward(upstream)
        finally:
            self.stats.connected = False
            self._abandon_inflight()
            with contextlib.suppress(Exception):
                # Bounded even if the client's own shutdown hangs: the next attempt matters more.
                async with asyncio.timeout(3.0):
                    await asyncio.shield(upstream.disconnect(timeout=1.0))
        self.stats.disconnects += 1
        if not self._stopping.is_set():
            await self._backoff(reason)

    async def _backoff(self, reason: str) -> None:
        delay = backoff_delay(
            self._attempt, self.config.backoff_initial_s, self.config.backoff_max_s, self._rng
        )
        self._attempt += 1
        log.warning("forwarder: %s; retrying in %.2f s", reason, delay)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._stopping.wait()

    async def _forward(self, upstream: Upstream) -> str:
        """Run one connection; returns why it ended."""
        window = asyncio.Semaphore(self.config.window)
        wake = asyncio.Event()
        sender = asyncio.create_task(self._send_loop(upstream, window, wake), name="forwarder-send")
        acker = asyncio.create_task(self._ack_loop(window, wake), name="forwarder-ack")
        closed = asyncio.create_task(upstream.closed.wait(), name="forwarder-closed")
        tasks = {sender, acker, closed}
        if self._health is not None:
            tasks.add(asyncio.create_task(self._health_loop(upstream), name="forwarder-health"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            # Bounded: a task that swallowed its cancellation must not wedge the forwarder.
            _, stuck = await asyncio.wait(tasks, timeout=5.0)
            if stuck:
                log.error("forwarder: %d connection task(s) did not stop; abandoning them", len(stuck))
        if closed in done:
            return "connection to the collector closed"
        for task in done:
            if task.cancelled():
                continue
            exc = task.exception()
            if isinstance(exc, UpstreamTimeout):
                self.stats.ack_timeouts += 1
                return str(exc)
            if exc is not None:
                if not isinstance(exc, OSError | ConnectionError):
                    log.error("forwarder: unexpected error", exc_info=exc)
                return f"connection failed: {exc}"
        return "connection ended"

    def _abandon_inflight(self) -> None:
        """The connection is gone: its unacknowledged batches go first in line for the next one.

        They are sent again verbatim (the collector drops what it already has), so nothing
        is re-read from the log and no record can be skipped.
        """
        resent = 0
        for item in reversed(self._inflight):
            if not item.future.done():
                item.future.cancel()
            self._unsent.appendleft(item.batch)
            resent += len(item.batch.offsets)
        self._inflight.clear()
        self.stats.inflight_batches = 0
        self.stats.resent_records += resent

    # -- health reports ----------------------------------------------------------------------

    async def _health_loop(self, upstream: Upstream) -> None:
        """One report right after the connect, then one every interval, QoS 0 (no in-flight
        slot, no PUBACK to wait for: the batches are neither delayed nor reordered). A report
        that cannot be built or sent is logged and skipped; it never ends the connection."""
        health = self._health
        assert health is not None
        while True:
            try:
                payload = health()
                sent = upstream.publish_nowait(self._health_topic, payload, qos=0)
                failed = sent.exception() if sent.done() and not sent.cancelled() else None
                if failed is not None:
                    raise failed
                self.stats.health_reports_sent += 1
            except (OSError, ConnectionError, ValueError) as exc:
                log.warning("forwarder: health report not sent: %s", exc)
            except Exception:
                log.exception("forwarder: health report not sent")
            await asyncio.sleep(self._health_interval_s)

    # -- sending ---------------------------------------------------------------------------

    async def _send_loop(self, upstream: Upstream, window: asyncio.Semaphore, wake: asyncio.Event) -> None:
        unsent = self._unsent
        while True:
            await window.acquire()
            if not unsent:
                records = await self._collect()
                unsent.extend(self._encode(records))
                if not unsent:  # every record was set aside as too large
                    window.release()
                    continue
            # The batch leaves `unsent` only when it is in flight: a cancellation at any await
            # (a lost connection) leaves every record either in flight or waiting here.
            batch = unsent[0]
            if self._bucket is not None:
                await self._bucket.take(len(batch.payload))
            future = upstream.publish_nowait(self.topic, batch.payload, qos=1)
            unsent.popleft()
            self._inflight.append(_InFlight(batch, future, time.monotonic()))
            stats = self.stats
            stats.batches_sent += 1
            stats.records_sent += len(batch.offsets)
            stats.bytes_sent += len(batch.payload)
            stats.inflight_batches = len(self._inflight)
            wake.set()
            await asyncio.sleep(0)  # let the local broker run between batches of a backlog

    def _encode(self, records: list[Record]) -> list[_Batch]:
        """``records`` as batches that each fit one PUBLISH within the collector's limit.

        A batch over the limit is split in halves; a single record that does not fit alone
        is set aside (acked in the group, logged, counted) so that it cannot wedge the stream.
        """
        cfg = self.config
        payload = encode_batch(cfg.device_id, cfg.stream, records, compression=cfg.compression)
        if len(payload) + self._publish_overhead <= cfg.upstream_max_packet_size:
            return [_Batch([r.offset for r in records], payload)]
        if len(records) > 1:
            half = len(records) // 2
            return self._encode(records[:half]) + self._encode(records[half:])
        record = records[0]
        self.stats.oversized_records += 1
        self.stats.oversized_bytes += len(record.payload)
        log.error(
            "forwarder: record at offset %d (topic %r, %d payload bytes) does not fit the collector's"
            " packet limit of %d bytes even alone; skipped upstream (it stays in the device log"
            " until retention removes it). Lower broker.max_packet_size to refuse such records"
            " at publish time.",
            record.offset, record.topic, len(record.payload), cfg.upstream_max_packet_size,
        )
        self.group.ack(record.offset)
        return []

    async def _collect(self) -> list[Record]:
        """The next batch: waits for at least one record, then up to the linger time for more.

        The batch being built lives in ``self._building`` so a cancellation (lost connection)
        keeps its records for the next connection.
        """
        cfg = self.config
        deadline: float | None = None
        group = self.group
        while True:
            carry = self._carry
            batch = self._building
            if carry:
                # Take as many fetched records as fit both bounds (at least one), in bulk.
                room_records = cfg.batch_records - len(batch)
                sizes = accumulate(len(r.payload) + len(r.topic) + len(r.headers) + RECORD_OVERHEAD
                                   for r in islice(carry, room_records))
                cumulative = list(sizes)
                take = bisect_right(cumulative, cfg.batch_bytes - self._building_bytes)
                if take == 0 and not batch:
                    take = 1  # a record bigger than batch_bytes still goes, alone
                if take:
                    batch.extend(carry[:take])
                    self._building_bytes += cumulative[take - 1]
                    del carry[:take]
                if carry or len(batch) >= cfg.batch_records or self._building_bytes >= cfg.batch_bytes:
                    return self._take_building()
            fetched = group.fetch(cfg.batch_records - len(batch), CONSUMER)
            if fetched:
                self._carry = fetched
                continue
            if group.has_work():
                await asyncio.sleep(0)  # fetch reads a bounded amount per call: call again
                continue
            if batch:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + cfg.linger_s
                if now >= deadline:
                    return self._take_building()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(deadline - now):
                        await self._wait_for_records(group.doing_offset)
            else:
                await self._wait_for_records(group.doing_offset)

    def _take_building(self) -> list[Record]:
        batch = self._building
        self._building = []
        self._building_bytes = 0
        return batch

    # -- acknowledgements --------------------------------------------------------------------

    async def _ack_loop(self, window: asyncio.Semaphore, wake: asyncio.Event) -> None:
        timeout = self.config.ack_timeout_s
        inflight = self._inflight
        group = self.group
        stats = self.stats
        while True:
            while not inflight:
                wake.clear()
                await wake.wait()
            head = inflight[0]
            remaining = head.sent_at + timeout - time.monotonic()
            try:
                # In order: the head first, whatever order the PUBACKs arrive in.
                async with asyncio.timeout(max(remaining, 0.0)):
                    await asyncio.shield(head.future)
            except TimeoutError:
                raise UpstreamTimeout(head.batch.offsets[0], head.batch.offsets[-1], timeout) from None
            inflight.popleft()
            offsets = head.batch.offsets
            for offset in offsets:
                group.ack(offset)
            window.release()
            now = time.monotonic()
            stats.batches_acked += 1
            stats.records_acked += len(offsets)
            stats.bytes_acked += len(head.batch.payload)
            stats.inflight_batches = len(inflight)
            stats.acked_offset = offsets[-1]
            stats.last_ack_unix = time.time()
            stats.observe_latency(now - head.sent_at)
            # Offsets reach disk in the queue's housekeeping (batched, off the loop).
            self._attempt = 0

    def sys_messages(self) -> list[tuple[str, bytes]]:
        """``$SYS/broker/forwarder/...`` topics and values describing progress and backlog."""
        s = self.stats
        g = self.group
        prefix = "$SYS/broker/forwarder/"
        values: Sequence[tuple[str, object]] = (
            ("connected", int(s.connected)),
            ("backlog", g.lag),
            ("pending", g.pending_offset),
            ("acked_offset", s.acked_offset),
            ("batches/sent", s.batches_sent),
            ("batches/acked", s.batches_acked),
            ("batches/inflight", s.inflight_batches),
            ("records/acked", s.records_acked),
            ("bytes/sent", s.bytes_sent),
            ("reconnects", s.disconnects),
            ("ack_timeouts", s.ack_timeouts),
            ("records/oversized_skipped", s.oversized_records),
        )
        return [(prefix + name, str(value).encode()) for name, value in values]
