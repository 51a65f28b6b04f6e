"""Fleet events landed like data (collector/fleet_events.py): connects, disconnects with their
reason and health reports become rows under <landing>/fleet_events/, keyed by
(device, fleet@<collector>, WAL offset), each once; disconnects the collector could not record
(stopped or killed while devices were connected) are recorded at its next start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.fleet import FLEET_FILE, FleetRegistry, Thresholds, device_state
from collector.fleet_events import event_topic, fleet_record, health_event, parse_event_topic
from collector.landing import LANDING_SCHEMA
from collector.server import Collector
from filemq.mqtt.client import MQTTClient
from filemq.upstream.health import decode_health, encode_health, health_topic
from segments.fileio import atomic_write
from tests.collector_harness import collector_config, collector_run, collector_until
from tests.fleet_harness import Conn, batch, health

pytestmark = pytest.mark.timeout(90)


def events(landing: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for f in sorted((landing / "fleet_events" / "incoming").rglob("*.parquet")):
        table = pq.read_table(f, partitioning=None)
        assert table.schema.equals(LANDING_SCHEMA)
        rows.extend(table.to_pylist())
    return sorted(rows, key=lambda r: r["offset"])


def test_event_topics_and_records() -> None:
    assert parse_event_topic(event_topic("dev-1", "connect")) == ("dev-1", "connect")
    assert parse_event_topic("filemq/fleet/v1/dev-1/reboot") is None
    assert parse_event_topic("filemq/v1/dev-1/main") is None
    report = decode_health(encode_health("d", 5, 2, {**health(lag=4), "extra": [1, {"a": None}]}))
    payload = health_event(report.body, report.body_json, report.sequence, report.sent_at_us)
    assert json.loads(payload) == {**health(lag=4), "extra": [1, {"a": None}], "event": "health", "sequence": 2,
                                   "sent_at_us": 5, "lag_records": 4, "oldest_unacked_age_s": 1.0}
    empty = decode_health(encode_health("d", 5, 3, {}))
    assert json.loads(health_event(empty.body, empty.body_json, 3, 5)) == {
        "event": "health", "sequence": 3, "sent_at_us": 5, "lag_records": None, "oldest_unacked_age_s": None}
    assert fleet_record(health_topic("d"), payload) == ("d", "health", payload)
    assert fleet_record(health_topic("d"), b"FMQH" + bytes(40)) is None  # not what the door stores


_EXPORT = st.fixed_dictionaries({"name": st.text(min_size=1, max_size=4)}, optional={
    "lag_records": st.none() | st.integers(0, 2**63 - 1),
    "oldest_unacked_age_s": st.none() | st.integers(0, 10**6) | st.floats(0, 1e9),
    "state": st.none() | st.sampled_from(["connected", "backoff"]),
})
_BODY = st.fixed_dictionaries({}, optional={
    "exports": st.lists(_EXPORT, max_size=4), "disk_free_bytes": st.none() | st.integers(0, 2**40),
    "interval_s": st.none() | st.integers(0, 120),
})


@settings(max_examples=200, deadline=None)
@given(_BODY, st.integers(1, 2**40), st.integers(0, 2**62))
def test_health_event_with_the_registrys_figures_is_the_same_bytes(body: dict[str, Any], sequence: int,
                                                                    sent_at_us: int) -> None:
    """Issue 32: the door passes the registry's lag and age of a report (worked out once per
    report) to health_event instead of letting it sum the exports again: for every checked body,
    the same payload bytes; and a device's state, worked out once per report, is the state the
    thresholds give at any time (stale after the window, offline once disconnected)."""
    report = decode_health(encode_health("d", sent_at_us, sequence, body))
    clock = [1000.0]
    t = Thresholds(behind_records=1000, behind_age_s=600, disk_low_bytes=1 << 20, stale_intervals=3)
    reg = FleetRegistry(None, t, clock=lambda: clock[0])
    conn = Conn()
    reg.seen("d", "d", "peer", conn)
    d = reg.health("d", report.body, report.sent_at_us, report.sequence, report.body_json)
    assert d is not None
    alone = health_event(report.body, report.body_json, report.sequence, report.sent_at_us)
    assert health_event(report.body, report.body_json, report.sequence, report.sent_at_us,
                        (d.lag_records(), d.oldest_unacked_age_s())) == alone
    exports = body.get("exports") or []
    lags = [e["lag_records"] for e in exports if e.get("lag_records") is not None]
    ages = [e["oldest_unacked_age_s"] for e in exports if e.get("oldest_unacked_age_s") is not None]
    free = body.get("disk_free_bytes")
    window = 3 * (body.get("interval_s") or 30)
    expected = ("disk_low" if free is not None and free < 1 << 20 else
                "behind" if (lags and sum(lags) > 1000) or (ages and max(ages) > 600) else "online")
    assert device_state(d, 1000.0, t) == expected
    assert device_state(d, 1000.0 + window, t) == expected
    assert device_state(d, 1000.0 + window + 0.5, t) == "stale"
    conn.closed = True
    reg.sweep({})
    assert device_state(d, 1000.0, t) == "offline"


def test_connects_disconnects_and_health_land_once(tmp_path: Path) -> None:
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.roll_seconds": 1}))
        await collector.start()
        client = MQTTClient("dev-1", port=collector.port)
        await client.connect()
        await client.publish(health_topic("dev-1"), encode_health("dev-1", 0, 1, health(lag=9)), qos=0)
        await client.publish("filemq/v1/dev-1/main", batch(0, 3), qos=1, timeout=5)
        assert client._writer is not None
        client._writer.transport.abort()  # the agent dies
        await collector_until(lambda: not collector.fleet.devices["dev-1"].connected)
        await client.disconnect()
        client = MQTTClient("dev-1", port=collector.port)
        await client.connect()
        await client.publish("filemq/v1/dev-1/main", batch(3, 2), qos=1, timeout=5)
        await collector.stop()  # dev-1 still connected: "collector stopping"
        await client.disconnect()
        out["first"] = events(tmp_path / "landing")
        again = Collector(collector_config(tmp_path, **{"collector.roll_seconds": 1}))
        await again.start()  # no disconnect pending; what the last roll did not take lands now
        await collector_until(lambda: again.lander is not None and again.lander.lag == 0)
        await asyncio.sleep(0.2)
        await again.stop()
        out["second"] = events(tmp_path / "landing")

    collector_run(scenario(), timeout=60)
    rows = out["second"]
    assert rows[: len(out["first"])] == out["first"]  # landed once: before the restart or after it
    assert [(r["device_id"], r["topic"]) for r in rows] == [
        ("dev-1", "connect"), ("dev-1", "health"), ("dev-1", "disconnect"), ("dev-1", "connect"),
        ("dev-1", "disconnect")]
    payloads = [json.loads(r["payload"]) for r in rows]
    assert payloads[2]["reason"] and payloads[4]["reason"] == "collector stopping"
    assert payloads[1]["lag_records"] == 9 and payloads[1]["event"] == "health"
    assert all(r["stream"] == "fleet@c1" and r["collector_id"] == "c1" for r in rows)
    assert len({(r["device_id"], r["stream"], r["offset"]) for r in rows}) == len(rows)


def test_a_killed_collector_records_the_disconnects_at_its_next_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(parents=True)
    # The registry as a collector killed with dev-k connected left it.
    reg = FleetRegistry(data / FLEET_FILE)
    reg.seen("dev-k", "dev-k", "10.0.0.9:1", Conn())
    reg.save(atomic_write)
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.roll_seconds": 1}))
        await collector.start()
        await collector.stop()
        out["rows"] = events(tmp_path / "landing")
        out["pending"] = collector.fleet.devices["dev-k"].pending_disconnect

    collector_run(scenario(), timeout=60)
    (row,) = out["rows"]
    assert row["device_id"] == "dev-k" and row["topic"] == "disconnect"
    assert json.loads(row["payload"])["reason"] == "collector restarted"
    assert out["pending"] is None
