"""The broker's own figures for Prometheus, read from its counters at scrape time.

The same counters ``$SYS/broker/...`` publishes (:class:`filemq.broker.sysinfo.BrokerStats`), the
log's (size, fsyncs) and the consumer groups' (lag, oldest unacknowledged record), named
after Prometheus conventions: ``filemq_broker_..._total`` for counters, ``_bytes`` and
``_seconds`` for units. :func:`broker_families` must run on the broker's event loop (the
groups are not thread-safe); :func:`filemq.ops.metrics_http.serve_loop_metrics` arranges that.
Nothing here imports ``prometheus-client``.

Metric names (docs/BROKER.md, "Prometheus metrics"; tests/test_metrics_http.py):

* ``filemq_broker_uptime_seconds``, ``filemq_broker_clients_connected``,
  ``filemq_broker_clients_maximum`` (gauges)
* ``filemq_broker_connections_total``, ``filemq_broker_messages_received_total``,
  ``filemq_broker_messages_sent_total``, ``filemq_broker_publish_dropped_total``,
  ``filemq_broker_received_bytes_total``, ``filemq_broker_sent_bytes_total`` (counters)
* ``filemq_broker_store_bytes`` (segment files), ``filemq_broker_free_bytes`` (free space of
  the data dir's file system), ``filemq_broker_log_records`` (gauges)
* ``filemq_broker_fsyncs_total``, ``filemq_broker_fsync_seconds_total`` (counters: their
  ratio is the mean group-commit fdatasync time) and ``filemq_broker_fsync_latency_seconds``
  with ``quantile="0.5"``/``"0.99"`` over the last syncs (gauge, the ``$SYS`` p50/p99)
* ``filemq_broker_group_lag_records{group=...}`` and
  ``filemq_broker_group_oldest_unacked_age_seconds{group=...}`` per durable consumer group
  (a persistent session or the agent's forwarder); the age is 0 when nothing is unacked.
* admission's and the ingest budget's figures (:mod:`filemq.broker.availability`):
  ``filemq_broker_connections_half_open``, ``..._admission_*_total``, ``..._ingest_*``
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from filemq.broker.availability import AVAILABILITY_METRICS, availability_figures

if TYPE_CHECKING:
    from filemq.broker.server import Broker

log = logging.getLogger("filemq.broker")

PREFIX = "filemq_broker_"


@dataclass
class Family:
    """One metric family: ``name`` without ``_total``; samples carry their full names."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def render_text(families: list[Family]) -> str:
    """The Prometheus text exposition format (0.0.4) of ``families``."""
    out: list[str] = []
    for fam in families:
        shown = fam.name + "_total" if fam.kind == "counter" else fam.name
        doc = fam.help.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {shown} {doc}")
        out.append(f"# TYPE {shown} {fam.kind}")
        for name, labels, value in fam.samples:
            text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            out.append(f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}")
    return "\n".join(out) + "\n"


def _counter(name: str, help_: str, value: float) -> Family:
    full = PREFIX + name
    return Family(full, "counter", help_, [(full + "_total", {}, value)])


def _gauge(name: str, help_: str, value: float) -> Family:
    full = PREFIX + name
    return Family(full, "gauge", help_, [(full, {}, value)])


def broker_families(broker: Broker, now: float | None = None) -> list[Family]:
    """Every broker metric, read now (on the event loop); empty before the broker started."""
    queue = broker.queue
    if queue is None:
        return []
    now = time.monotonic() if now is None else now
    s = broker.stats
    lg = queue.log
    fams = [
        _gauge("uptime_seconds", "Seconds since the broker started", max(0.0, now - s.started_at)),
        _gauge("clients_connected", "Clients connected now", s.clients_connected),
        _gauge("clients_maximum", "Most clients connected at once since start", s.clients_maximum),
        _counter("connections", "Connections accepted since start", s.connections_total),
        _counter("messages_received", "PUBLISH packets received from clients", s.messages_received),
        _counter("messages_sent", "PUBLISH packets sent to subscribers", s.messages_sent),
        _counter("publish_dropped", "PUBLISH packets denied by the ACL or the $-topic rule", s.publish_dropped),
        _counter("sys_skipped", "$SYS messages not published: their topic was not a valid topic name",
                 s.sys_skipped),
        _counter("received_bytes", "Bytes received from clients", s.bytes_received),
        _counter("sent_bytes", "Bytes sent to clients", s.bytes_sent),
        _gauge("store_bytes", "Bytes of the log's segment files", lg.size_bytes()),
        _gauge("log_records", "Records in the log (first to next offset)", lg.next_offset - lg.first_offset),
        _counter("fsyncs", "Group-commit fdatasyncs of the log", lg.stats.fsyncs),
        _counter("fsync_seconds", "Seconds spent in the log's fdatasyncs", lg.stats.fsync_seconds_total),
    ]
    try:
        fams.append(_gauge("free_bytes", "Free bytes on the data directory's file system",
                           lg.fileio.free_bytes(lg.directory)))
    except OSError as exc:
        log.debug("metrics: free space of %s unknown: %s", lg.directory, exc)
    latency = Family(PREFIX + "fsync_latency_seconds", "gauge",
                     "fdatasync time over the last syncs, by quantile")
    for q, p in (("0.5", 50.0), ("0.99", 99.0)):
        seconds = s.fsync_latency.percentile(p)
        if seconds is not None:
            latency.samples.append((latency.name, {"quantile": q}, seconds))
    fams.append(latency)
    lag = Family(PREFIX + "group_lag_records", "gauge",
                 "Records committed to the log and not yet acknowledged, per durable consumer group")
    age = Family(PREFIX + "group_oldest_unacked_age_seconds", "gauge",
                 "Age of the oldest record not yet acknowledged, per durable consumer group (0 if none)")
    wall_us = time.time_ns() // 1000
    for group in sorted((g for g in queue.groups() if g.durable), key=lambda g: g.name):
        labels = {"group": group.name}
        records = group.lag
        lag.samples.append((lag.name, labels, records))
        seconds = 0.0
        if records > 0:
            try:
                oldest = lg.read(group.pending_offset, max_records=1)
            except Exception as exc:  # a metric must never take the broker down
                log.debug("metrics: cannot read offset %d for %s: %s", group.pending_offset, group.name, exc)
                oldest = []
            if oldest:
                seconds = max(0.0, (wall_us - oldest[0].timestamp_us) / 1e6)
        age.samples.append((age.name, labels, seconds))
    fams += [lag, age]
    fams += availability_families(broker, PREFIX)
    return fams


def availability_families(broker: Broker, prefix: str) -> list[Family]:
    """:func:`availability_figures` as metric families named ``prefix`` + name."""
    figures = availability_figures(broker.admission, broker.budget)
    fams: list[Family] = []
    for key, name, kind, help_ in AVAILABILITY_METRICS:
        if key in figures:
            full = prefix + name
            sample = full + "_total" if kind == "counter" else full
            fams.append(Family(full, kind, help_, [(sample, {}, figures[key])]))
    return fams


def backlog_status(broker: Broker) -> str:
    """One line for systemd's ``STATUS=``: clients and the largest durable group backlog."""
    queue = broker.queue
    if queue is None:
        return "starting"
    groups = [g for g in queue.groups() if g.durable]
    worst = max(groups, key=lambda g: g.lag, default=None)
    backlog = f"backlog {worst.lag} records ({worst.name})" if worst is not None and worst.lag else "backlog 0 records"
    return (f"{broker.stats.clients_connected} clients, {backlog}, "
            f"log {queue.log.next_offset - queue.log.first_offset} records")
