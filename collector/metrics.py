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
Admission and the ingest budget, as the broker's (:mod:`filemq.broker.availability`):
``filemq_collector_connections_half_open``, ``filemq_collector_admission_*_total``,
``filemq_collector_ingest_*``.

The fleet (:mod:`collector.fleet`), as aggregates without a label per device:
``filemq_collector_fleet_devices{state="online|behind|disk_low|stale|offline"}``,
``filemq_collector_fleet_devices_connected``, ``filemq_collector_fleet_max_lag_records``,
``filemq_collector_fleet_oldest_unacked_age_seconds`` (the worst connected device),
``filemq_collector_health_reports_total``, ``filemq_collector_health_rejected_total``,
``filemq_collector_health_malformed_total``. With ``collector.fleet_device_labels = true``
also, labelled ``device``: ``filemq_collector_device_connected``, ``filemq_collector_device_lag_records``,
``filemq_collector_device_oldest_unacked_age_seconds``, ``filemq_collector_device_disk_free_bytes``,
``filemq_collector_device_last_seen_timestamp_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from collector.fleet import STATES, device_state
from filemq.broker.metrics import availability_families
from filemq.ops.metrics_http import on_loop

if TYPE_CHECKING:
    from collector.server import Collector

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0


class CollectorMetrics(PromCollector):
    """Exposes one :class:`collector.server.Collector`'s counters."""

    def __init__(self, collector: Collector, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.collector = collector
        self.loop = loop  # the collector's loop: the fleet registry is read there

    def collect(self) -> Iterator[Metric]:
        yield from self._door_and_lander()
        try:
            fleet = on_loop(self.loop, self._fleet_figures, SCRAPE_TIMEOUT_S) if self.loop is not None \
                else self._fleet_figures()
        except Exception as exc:
            log.warning("fleet metrics not read: %r", exc)
            return
        yield from self._fleet(fleet)

    def _fleet_figures(self) -> dict[str, Any]:
        """Read on the collector's loop: counts by state and, when asked for, per device values."""
        fleet = self.collector.fleet
        now = fleet.now()
        counts = dict.fromkeys(STATES, 0)
        lags = []
        devices = []
        per_device = self.collector.config.collector.fleet_device_labels
        for d in fleet.devices.values():
            counts[device_state(d, now, fleet.thresholds)] += 1
            lag = d.lag_records() if d.connected else None
            if lag is not None:
                lags.append(lag)
            if per_device:
                devices.append((d.device_id, d.connected, d.lag_records(), d.oldest_unacked_age_s(),
                                (d.health or {}).get("disk_free_bytes"), d.last_seen))
        return {"counts": counts, "connected": sum(1 for d in fleet.devices.values() if d.connected),
                "max_lag": max(lags, default=0), "oldest": fleet.oldest_backlog_age_s(), "devices": devices}

    def _fleet(self, f: dict[str, Any]) -> Iterator[Metric]:
        p = "filemq_collector_"
        door = self.collector.stats
        for name, doc, value in (
            ("health_reports", "Health reports received from devices", door.health_reports),
            ("health_rejected", "Health reports refused (CRC mismatch or wrong device; connection closed)",
             door.health_rejected),
            ("health_malformed", "Health reports dropped as malformed", door.health_malformed),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        by_state = GaugeMetricFamily(p + "fleet_devices", "Devices in the fleet registry by state", labels=["state"])
        for state, n in f["counts"].items():
            by_state.add_metric([state], float(n))
        yield by_state
        yield GaugeMetricFamily(p + "fleet_devices_connected", "Devices connected now", value=f["connected"])
        yield GaugeMetricFamily(p + "fleet_max_lag_records", "Largest export lag (records) a connected device"
                                " reported", value=f["max_lag"])
        yield GaugeMetricFamily(p + "fleet_oldest_unacked_age_seconds", "Oldest unacknowledged record age any"
                                " connected device reported", value=f["oldest"])
        if not self.collector.config.collector.fleet_device_labels:
            return
        families = [
            (GaugeMetricFamily(p + "device_connected", "1 while the device is connected", labels=["device"]), 1),
            (GaugeMetricFamily(p + "device_lag_records", "Device export lag (records)", labels=["device"]), 2),
            (GaugeMetricFamily(p + "device_oldest_unacked_age_seconds", "Device oldest unacknowledged age",
                               labels=["device"]), 3),
            (GaugeMetricFamily(p + "device_disk_free_bytes", "Device free disk", labels=["device"]), 4),
            (GaugeMetricFamily(p + "device_last_seen_timestamp_seconds", "Unix time the device was last seen",
                               labels=["device"]), 5),
        ]
        for row in f["devices"]:
            for family, i in families:
                if row[i] is not None:
                    family.add_metric([row[0]], float(row[i]))
        for family, _ in families:
            yield family

    def _door_and_lander(self) -> Iterator[Metric]:
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
        # Admission and the ingest budget (issue 30): the broker's families, named for the collector.
        for fam in availability_families(self.collector.broker, p):
            figure = fam.samples[0][2]
            if fam.kind == "counter":
                yield CounterMetricFamily(fam.name, fam.help, value=figure)
            else:
                yield GaugeMetricFamily(fam.name, fam.help, value=figure)
