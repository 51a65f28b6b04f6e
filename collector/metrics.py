"""Prometheus metrics for ``filemq collector --metrics-port P``.

Values are read from the collector's counters at scrape time (a custom collector on a
private registry), so the hot path never touches prometheus-client. Metric names:

``filemq_collector_batches_received_total``, ``filemq_collector_records_received_total``,
``filemq_collector_bytes_received_total``, ``filemq_collector_duplicate_records_dropped_total``
(at the door and in the lander), ``filemq_collector_quarantined_total``,
``filemq_collector_crc_rejected_total``, ``filemq_collector_topic_rejected_total``, ``filemq_collector_rows_landed_total``,
``filemq_collector_files_landed_total``, ``filemq_collector_land_failures_total``,
``filemq_collector_lag_batches`` (WAL batches not yet landed),
``filemq_collector_buffered_rows``, ``filemq_collector_land_seconds`` (last roll).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from filemq.ops.metrics_http import MetricsServer, serve_metrics

if TYPE_CHECKING:
    from collector.server import Collector


class CollectorMetrics(PromCollector):
    """Exposes one :class:`collector.server.Collector`'s counters."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        door = self.collector.stats
        lander = self.collector.lander
        p = "filemq_collector_"
        counters = [
            ("batches_received", "Batches stored in the WAL", door.batches_received),
            ("records_received", "Records stored in the WAL", door.records_received),
            ("bytes_received", "Batch bytes stored in the WAL", door.bytes_received),
            ("duplicate_records_dropped", "Records dropped as duplicates (door and lander)",
             door.duplicate_records + door.trimmed_records
             + (lander.stats.duplicate_rows_dropped if lander else 0)),
            ("quarantined", "Malformed batches quarantined", door.quarantined),
            ("crc_rejected", "Batches refused for a CRC mismatch (resent by the agent)", door.crc_rejected),
            ("topic_rejected", "Batches refused: topic disagrees with the batch header (resent by the agent)",
             door.topic_rejected),
            ("rows_landed", "Rows landed in Parquet files", lander.stats.rows_landed if lander else 0),
            ("files_landed", "Parquet files landed", lander.stats.files_landed if lander else 0),
            ("land_failures", "Failed landing attempts (retried)", lander.stats.land_failures if lander else 0),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(p + name, doc, value=value)
        gauges: list[tuple[str, str, float]] = [
            ("lag_batches", "WAL batches not yet landed", lander.lag if lander else 0),
            ("buffered_rows", "Rows read from the WAL awaiting the next roll",
             lander.stats.buffered_rows if lander else 0),
            ("land_seconds", "Duration of the last roll (write, fsync, rename, offset)",
             lander.stats.last_land_seconds if lander else 0.0),
        ]
        for name, doc, level in gauges:
            yield GaugeMetricFamily(p + name, doc, value=level)


def start_metrics_server(collector: Collector, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``/metrics`` for ``collector`` on ``addr:port`` (0 = any free port)."""
    return serve_metrics(CollectorMetrics(collector), port, addr)
