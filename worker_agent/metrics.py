"""Prometheus metrics for ``filemq agent --metrics-port P``.

Read from the forwarder's counters at scrape time (a custom collector on a private
registry); ``prometheus-client`` is imported only when metrics are enabled, so devices
without it still run the agent. Metric names: ``filemq_agent_batches_sent_total``,
``filemq_agent_batches_acked_total``, ``filemq_agent_records_acked_total``,
``filemq_agent_bytes_sent_total``, ``filemq_agent_resent_records_total``,
``filemq_agent_reconnects_total``, ``filemq_agent_ack_timeouts_total``,
``filemq_agent_connected``, ``filemq_agent_lag_records`` (backlog not yet acked upstream),
``filemq_agent_inflight_batches`` and the histogram ``filemq_agent_batch_latency_seconds``
(send to PUBACK) -- these for the collector export's forwarder. Every export, of either kind,
also has ``filemq_agent_export_<metric>{export="NAME"}``: gauges ``connected``, ``backoff``,
``lag_records``, ``lag_bytes``, ``oldest_unsent_age_seconds``, ``last_ack_timestamp_seconds``,
``priority`` and counters ``records_sent``, ``records_acked``, ``bytes_sent``,
``connect_failures``, ``lost_records``, ``oversized_skipped``, ``ack_timeouts``.
Plus the device broker's own figures, ``filemq_broker_...``
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
    from worker_agent.exports import Exports
    from worker_agent.forwarder import Forwarder


class Agent(Protocol):
    """What the metrics read of a :class:`worker_agent.app.Agent` (a Protocol, so this module
    and the app that starts it never import each other)."""

    @property
    def broker(self) -> Broker: ...

    @property
    def forwarder(self) -> Forwarder | None: ...

    @property
    def exports(self) -> Exports: ...


log = logging.getLogger("worker_agent.metrics")

SCRAPE_TIMEOUT_S = 5.0


class AgentMetrics(PromCollector):
    """Exposes one :class:`worker_agent.app.Agent`'s forwarder and broker counters; the broker's
    are read on ``loop`` (the agent's event loop) when one is given."""

    def __init__(self, agent: Agent, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.agent = agent
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        yield from self._exports()
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

    def _exports(self) -> Iterator[Metric]:
        """Per-export families, labelled ``export="NAME"`` (see the module doc)."""
        status = self.agent.exports.status
        try:  # on the agent's loop when there is one: it reads groups and the log
            entries = on_loop(self.loop, status, SCRAPE_TIMEOUT_S) if self.loop is not None else status()
        except Exception as exc:
            log.warning("export metrics not read: %r", exc)
            return
        p = "filemq_agent_export_"
        gauges = (
            ("connected", "1 while the export is connected to its destination", "state"),
            ("backoff", "1 while the export waits to reconnect (see last_error in filemq status)", "state"),
            ("lag_records", "Records in the log the export has not had acknowledged", "lag_records"),
            ("lag_bytes", "Approximate bytes of those records in the log", "lag_bytes"),
            ("oldest_unsent_age_seconds", "Age of the oldest record not yet acknowledged", "oldest_unsent_age_s"),
            ("last_ack_timestamp_seconds", "Unix time of the last acknowledgement", "last_ack_unix"),
            ("priority", "The export's priority on the shared uplink", "priority"),
        )
        for name, doc, key in gauges:
            family = GaugeMetricFamily(p + name, doc, labels=["export"])
            for e in entries:
                value = float(e["state"] == name) if key == "state" else e.get(key)
                if value is not None:
                    family.add_metric([e["name"]], float(value))
            yield family
        for name, doc, key in (
            ("records_sent", "Records published by the export", "records_sent"),
            ("records_acked", "Records acknowledged by the export's destination", "records_acked"),
            ("bytes_sent", "Payload bytes published by the export", "bytes_sent"),
            ("connect_failures", "Failed connection attempts", "connect_failures"),
            ("lost_records", "Records retention deleted before the export shipped them", "lost_records"),
            ("oversized_skipped", "Records over the export's max_packet_size, set aside unsent", "oversized_skipped"),
            ("ack_timeouts", "Connections ended because the destination did not acknowledge in time", "ack_timeouts"),
        ):
            counter = CounterMetricFamily(p + name, doc, labels=["export"])
            for e in entries:
                if e.get(key) is not None:
                    counter.add_metric([e["name"]], float(e[key]))
            yield counter


def start_metrics_server(agent: Agent, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``/metrics`` for ``agent`` on ``addr:port`` (0 = any free port); call from its loop."""
    return serve_metrics(AgentMetrics(agent, asyncio.get_running_loop()), port, addr)
