"""Fleet events as landing rows: connects, disconnects and health reports, landed like data.

The collector writes a connect or disconnect of a device to its WAL as a record on
``filemq/fleet/v1/<device_id>/<event>`` (:func:`event_topic`, a JSON payload: :func:`event_payload`);
a health report (:mod:`filemq.upstream.health`) is stored by the door on its own topic with the
event payload in place of the report's bytes (:func:`health_event`: its CRC was checked at the
door, the WAL record's CRC covers it from there; the lander parses nothing).
The lander turns each such WAL record into one row of the landing schema
(:func:`event_row`), landed in ``<landing>/fleet_events/`` beside the messages, and
``filemq ingest`` writes those into the curated table ``fleet_events`` (docs/INGEST.md).

The row's key is ``(device_id, stream, offset)`` = ``(device, "fleet@<collector_id>", WAL
offset)``: the WAL offset names the event uniquely within a collector, the stream keeps
collectors apart, and a WAL record landed twice (a crash between landing and the offset
write) gives the same key, so the ingest keeps it once. ``topic`` is the event
(``connect``, ``disconnect``, ``health``), ``publish_ts`` when it happened (the collector's
clock), ``payload`` a JSON object (docs/INGEST.md lists its fields).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from collector.landing import LANDING_SCHEMA, PROPERTY_FIELDS, SCHEMA_VERSION
from filemq.upstream.health import parse_health_topic

EVENT_PREFIX = "filemq/fleet/v1/"  # not a $-topic: a consumer group's "#" would skip it
EVENTS = ("connect", "disconnect")
LANDING_SUBDIR = "fleet_events"
STREAM_PREFIX = "fleet@"

_TS = pa.timestamp("us", tz="UTC")


def event_topic(device_id: str, event: str) -> str:
    return f"{EVENT_PREFIX}{device_id}/{event}"


def parse_event_topic(topic: str) -> tuple[str, str] | None:
    """``(device_id, event)`` of a fleet event topic, or None."""
    if not topic.startswith(EVENT_PREFIX):
        return None
    device, _, event = topic[len(EVENT_PREFIX):].rpartition("/")
    if not device or "/" in device or event not in EVENTS:
        return None
    return device, event


def event_payload(event: str, details: Mapping[str, Any]) -> bytes:
    return json.dumps({"event": event, **details}, separators=(",", ":")).encode()


def health_event(body: Mapping[str, Any], body_json: bytes, sequence: int, sent_at_us: int,
                 figures: tuple[int | None, float | None] | None = None) -> bytes:
    """A health report as a fleet event payload: ``event``, ``sequence``, ``sent_at_us`` and the
    aggregates the table types (``lag_records`` summed over the exports, ``oldest_unacked_age_s``
    their largest), then the report's body, its JSON text passed on as sent (``body_json``,
    whose fields :func:`filemq.upstream.health.check_body` checked) rather than encoded again.
    ``figures``: those two aggregates when the caller has them already (the fleet registry
    works them out for each report, :meth:`collector.fleet.Device.lag_records`)."""
    if figures is None:
        exports = body.get("exports") or []
        lags = [e["lag_records"] for e in exports if type(e.get("lag_records")) is int]
        ages = [e["oldest_unacked_age_s"] for e in exports if type(e.get("oldest_unacked_age_s")) in _NUMBER]
        figures = (sum(lags) if lags else None, max(ages) if ages else None)
    # Formatted, not json.dumps'ed (once per report): ints and finite floats (check_body)
    # have the same text in both.
    head = (f'{{"event":"health","sequence":{int(sequence)},"sent_at_us":{int(sent_at_us)},'
            f'"lag_records":{_number(figures[0])},"oldest_unacked_age_s":{_number(figures[1])}').encode()
    rest = body_json.strip()[1:]  # the body object without its "{"
    if rest.lstrip().startswith(b"}"):
        return head + b"}"
    return head + b"," + rest


_NUMBER = (int, float)


def _number(value: float | None) -> str:
    return "null" if value is None else repr(value)


def fleet_record(topic: str, payload: bytes) -> tuple[str, str, bytes] | None:
    """``(device_id, event, row payload)`` of a WAL record that is a fleet event, else None.

    A health report's WAL record holds the fleet event payload already (the door wrote
    :func:`health_event`), a JSON object: it is taken as it is.
    """
    found = parse_event_topic(topic)
    if found is not None:
        return found[0], found[1], payload
    device = parse_health_topic(topic)
    if device is None or not payload.startswith(b"{"):
        return None
    return device, "health", payload


def event_rows(rows: list[tuple[str, str, bytes, int, int]], collector_id: str) -> pa.RecordBatch:
    """Landing rows of ``(device_id, event, payload, wal_offset, wal_timestamp_us)``."""
    n = len(rows)
    stream = STREAM_PREFIX + collector_id
    ts = pa.array([r[4] for r in rows], _TS)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([r[0] for r in rows], pa.string()),
            pa.repeat(pa.scalar(stream, pa.string()), n),
            pa.array([r[3] for r in rows], pa.int64()),
            pa.array([r[1] for r in rows], pa.string()),
            pa.repeat(pa.scalar(0, pa.int8()), n),
            ts,
            ts,
            pa.repeat(pa.scalar(collector_id, pa.string()), n),
            pa.array([r[2] for r in rows], pa.binary()),
            pa.repeat(pa.scalar(SCHEMA_VERSION, pa.int16()), n),
            *[pa.nulls(n, f.type) for f in PROPERTY_FIELDS],
        ],
        schema=LANDING_SCHEMA,
    )
