"""What a load of :mod:`bench.loadgen` is and what it measured: the specs of its publisher and
subscriber processes, their results and a run's :class:`LoadResult`.

Plain data, importing nothing else of bench/, so the process bodies of other clients
(:mod:`bench.paho_sub`) and the harness (:mod:`bench.harness`) use them without importing
the load generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from filemq.mqtt.packets import PROTOCOL_LEVEL, Properties

# --------------------------------------------------------------------------- publishers


@dataclass(frozen=True)
class PublisherSpec:
    """One publishing process. ``rate`` 0 = as fast as the in-flight window allows."""

    host: str
    port: int
    client_id: str
    topic: str
    messages: int
    payload_size: int = 100
    inflight: int = 100
    qos: int = 1
    rate: float = 0.0
    max_seconds: float = 60.0
    protocol: int = PROTOCOL_LEVEL  # 5: MQTT 5 CONNECT and PUBLISH
    properties: Properties | None = None  # MQTT 5 message properties on every PUBLISH
    client: str = "loadgen"  # "loadgen": the PUBLISHes a read of PUBACKs frees in one sendall;
    # "single": each in a sendall of its own (a naive raw-socket client); "nagle": "single"
    # without TCP_NODELAY


@dataclass
class PublisherResult:
    client_id: str
    sent: int = 0
    acked: int = 0  # PUBACKs with a success reason code (< 0x80; every PUBACK on 3.1.1)
    refused: int = 0  # MQTT 5 PUBACKs with a reason code >= 0x80 (not in ``acked``)
    started: float = 0.0  # time.monotonic() of the first send
    finished: float = 0.0  # time.monotonic() of the last PUBACK
    error: str | None = None
    connack_code: int | None = None  # set when the broker refused the CONNECT

    @property
    def seconds(self) -> float:
        return max(self.finished - self.started, 0.0)


# --------------------------------------------------------------------------- subscribers


@dataclass(frozen=True)
class SubscriberSpec:
    """One subscribing process; ``clean_session=False`` makes it a persistent session."""

    host: str
    port: int
    client_id: str
    topic_filter: str
    qos: int = 1
    clean_session: bool = False
    stamped: bool = False  # payloads carry bench.loadgen's stamp: collect latencies
    idle_seconds: float = 5.0  # give up after this long without a message once the load is over
    max_seconds: float = 120.0
    protocol: int = PROTOCOL_LEVEL  # 5: MQTT 5 CONNECT (session expiry when persistent) and SUBSCRIBE
    client: str = "loadgen"  # "paho": a paho-mqtt 2.x client, one PUBACK per message (bench.paho_sub);
    # "single": this generator, but each PUBACK in a send of its own (a naive raw-socket client);
    # "nagle": "single" without TCP_NODELAY (such a client's socket as it usually is)


@dataclass
class SubscriberResult:
    client_id: str
    received: int = 0
    first: float = 0.0  # time.monotonic() of the first message
    last: float = 0.0  # time.monotonic() of the last message
    latencies_ns: list[int] = field(default_factory=list)
    error: str | None = None
    connack_code: int | None = None  # set when the broker refused the CONNECT


# --------------------------------------------------------------------------- a run


@dataclass
class LoadResult:
    """What one run of :func:`run_load` measured."""

    publishers: list[PublisherResult]
    subscribers: list[SubscriberResult]
    broker_cpu_pct: float | None = None  # set by callers that own the broker process
    broker_cpu_seconds: float | None = None  # user + system, threads and helper processes; ditto
    broker_user_seconds: float | None = None  # the user part of it; ditto

    @property
    def acked(self) -> int:
        return sum(p.acked for p in self.publishers)

    @property
    def refused(self) -> int:
        """MQTT 5 PUBACKs with a failure reason code (>= 0x80), over all publishers."""
        return sum(p.refused for p in self.publishers)

    @property
    def connack_code(self) -> int | None:
        """The CONNACK code of the first client whose CONNECT the broker refused, else None."""
        results: list[PublisherResult | SubscriberResult] = [*self.subscribers, *self.publishers]
        return next((r.connack_code for r in results if r.connack_code is not None), None)

    @property
    def started(self) -> float:
        return min((p.started for p in self.publishers if p.started), default=0.0)

    @property
    def ack_seconds(self) -> float:
        ends = [p.finished for p in self.publishers if p.finished]
        return max(ends) - self.started if ends else 0.0

    @property
    def ack_rate(self) -> float:
        """PUBACKs per second over all publishers, first send to last PUBACK."""
        return self.acked / self.ack_seconds if self.ack_seconds > 0 else 0.0

    @property
    def delivered(self) -> int:
        return sum(s.received for s in self.subscribers)

    @property
    def delivery_seconds(self) -> float:
        ends = [s.last for s in self.subscribers if s.last]
        return max(ends) - self.started if ends else 0.0

    @property
    def delivery_rate(self) -> float:
        """Messages delivered per second across subscribers, first publish to last delivery."""
        return self.delivered / self.delivery_seconds if self.delivery_seconds > 0 else 0.0

    @property
    def errors(self) -> list[str]:
        results: list[PublisherResult | SubscriberResult] = [*self.publishers, *self.subscribers]
        return [f"{r.client_id}: {r.error}" for r in results if r.error]
