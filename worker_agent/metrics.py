"""Prometheus metrics for ``filemq agent --metrics-port P``.

Read from the forwarder's counters at scrape time (a custom collector on a private
registry); ``prometheus-client`` is imported only when metrics are enabled, so devices
without it still run the agent. Metric names: ``filemq_agent_batches_sent_total``,
``filemq_agent_batches_acked_total``, ``filemq_agent_records_acked_total``,
``filemq_agent_bytes_sent_total``, ``filemq_agent_resent_records_total``,
``filemq_agent_reconnects_total``, ``filemq_agent_ack_timeouts_total``,
``filemq_agent_connected``, ``filemq_agent_lag_records`` (backlog not yet acked upstream),
``filemq_agent_inflight_batches`` and the histogram ``filemq_agent_batch_latency_seconds``
(send to PUBACK); plus the device broker's own figures, ``filemq_broker_...``
(:mod:`filemq.broker.metrics`, read on the event loop at scrape time).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector as PromCollector

from filemq.broker.metrics import broker_families
from filemq.ops.metrics_http import MetricsServer, on_loop, serve_metrics
from worker_agent.forwarder import LATENCY_BUCKETS

if TYPE_CHECKING:
    from filemq.broker import Broker
    from worker_agent.forwarder import Forwarder


class Agent(Protocol):
    """What the metrics read of a :class:`worker_agent.app.Agent` (a Protocol, so this module
    and the app that starts it never import each other)."""

    @property
    def broker(self) -> Broker: ...

    @property
    def forwarder(self) -> Forwarder | None: ...


log = logging.getLogger("worker_agent.metrics")

SCRAPE_TIMEOUT_S = 5.0


class AgentMetrics(PromCollector):
    """Exposes one :class:`worker_agent.app.Agent`'s forwarder and broker counters; the broker's
    are read on ``loop`` (the agent's event loop) when one is given."""

    def __init__(self, agent: Agent, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.agent = agent
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        yield from self._forwarder()
        if self.loop is None:
            return
        try:
            families = on_loop(self.loop, lambda: broker_families(self.agent.broker), SCRAPE_TIMEOUT_S)
        except Exception as exc:
            log.warning("broker metrics not read: %r", exc)
            return
        for fam in families:
            metric = Metric(fam.name, fam.help, fam.kind)
            for name, labels, value in fam.samples:
                metric.add_sample(name, labels, value)
            yield metric

    def _forwarder(self) -> Iterator[Metric]:
        fwd = self.agent.forwarder
        if fwd is None:
            return
        s = fwd.stats
        p = "filemq_agent_"
        for name, doc, value in (
            ("batches_sent", "Batches published upstream", s.batches_sent),
            ("batches_acked", "Batches acknowledged by the collector", s.batches_acked),
            ("records_acked", "Records acknowledged by the collector", s.records_acked),
            ("bytes_sent", "Batch bytes published upstream", s.bytes_sent),
            ("resent_records", "Records handed back for resending after a lost connection", s.resent_records),
            ("reconnects", "Upstream connections that ended", s.disconnects),
            ("ack_timeouts", "Batches not acknowledged in time", s.ack_timeouts),
            ("oversized_records_skipped", "Records too large for the collector's packet limit, skipped",
             s.oversized_records),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        for name, doc, level in (
            ("connected", "1 while connected to the collector", float(s.connected)),
            ("lag_records", "Records in the log not yet acknowledged upstream", float(fwd.backlog)),
            ("inflight_batches", "Batches sent and not yet acknowledged", float(s.inflight_batches)),
        ):
            yield GaugeMetricFamily(p + name, doc, value=level)
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), s.latency_buckets, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        yield HistogramMetricFamily(p + "batch_latency_seconds", "Batch send to PUBACK",
                                    buckets=buckets, sum_value=s.latency_sum_s)


def start_metrics_server(agent: Agent, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``/metrics`` for ``agent`` on ``addr:port`` (0 = any free port); call from its loop."""
    return serve_metrics(AgentMetrics(agent, asyncio.get_running_loop()), port, addr)
