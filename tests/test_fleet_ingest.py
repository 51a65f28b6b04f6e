"""`filemq ingest` writes the second curated table, fleet_events (spark_ingest/fleet_events.py):
every connect, disconnect and health report a collector landed, exactly once across reruns and
re-landed files, with typed columns; the availability query of docs/INGEST.md runs on it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from collector.server import Collector
from filemq.mqtt.client import MQTTClient
from filemq.upstream.health import encode_health, health_topic
from tests.collector_harness import collector_config, collector_run, collector_until
from tests.fleet_harness import batch, health

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

AVAILABILITY = """
WITH ev AS (
  SELECT device_id, topic AS event, publish_ts,
         LEAD(publish_ts) OVER (PARTITION BY device_id ORDER BY publish_ts, offset) AS next_ts
  FROM fleet_events WHERE topic IN ('connect', 'disconnect')
)
SELECT device_id,
       SUM(CASE WHEN event = 'connect'
                THEN unix_timestamp(COALESCE(next_ts, current_timestamp())) - unix_timestamp(publish_ts)
                ELSE 0 END) AS connected_s,
       COUNT_IF(event = 'disconnect') AS disconnects
FROM ev GROUP BY device_id ORDER BY device_id
"""


def land(tmp_path: Path) -> None:
    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.roll_seconds": 1}))
        await collector.start()
        for device in ("dev-1", "dev-2"):
            client = MQTTClient(device, port=collector.port)
            await client.connect()
            await client.publish(health_topic(device), encode_health(device, 0, 1, health(lag=7)), qos=0)
            await client.publish(f"filemq/v1/{device}/main", batch(0, 3, device), qos=1, timeout=5)
            await client.disconnect()
            await collector_until(lambda d=device: not collector.fleet.devices[d].connected)  # type: ignore[misc]
        await collector_until(lambda: collector.lander is not None and collector.lander.lag == 0)
        await collector.stop()

    collector_run(scenario(), timeout=60)


def test_fleet_events_table_exactly_once(spark: Any, tmp_path: Path) -> None:
    from spark_ingest.fleet_events import (
        fleet_events_config,
        has_fleet_events,
        run_with_fleet_events,
    )
    from spark_ingest.job import IngestConfig

    land(tmp_path)
    cfg = IngestConfig(landing=tmp_path / "landing", table=tmp_path / "tables" / "messages",
                       checkpoint=tmp_path / "ckpt" / "messages")
    assert has_fleet_events(cfg)
    events = fleet_events_config(cfg)
    assert events.table == tmp_path / "tables" / "fleet_events"
    messages, first = run_with_fleet_events(spark, cfg, events)
    assert messages.rows_written == 6 and first is not None and first.rows_written == 6
    # A landing file landed again (a collector crash between landing and its offset write):
    # same keys, nothing new in the table.
    (src,) = sorted((tmp_path / "landing" / "fleet_events" / "incoming").rglob("*.parquet"))[:1]
    shutil.copy(src, src.with_name("z-relanded-" + src.name))
    _, second = run_with_fleet_events(spark, cfg, events)
    assert second is not None and second.files == 1 and second.rows_in > 0
    assert second.rows_written == 0 and second.duplicates_removed == second.rows_in
    table = spark.read.parquet(str(events.table))
    rows = sorted(table.collect(), key=lambda r: (r["device_id"], r["offset"]))
    assert [(r["device_id"], r["topic"]) for r in rows] == [
        (d, e) for d in ("dev-1", "dev-2") for e in ("connect", "health", "disconnect")]
    assert all(r["event"] == r["topic"] for r in rows)
    by_event = {(r["device_id"], r["topic"]): r for r in rows}
    assert by_event[("dev-1", "health")]["lag_records"] == 7
    assert by_event[("dev-1", "health")]["disk_free_bytes"] == 10**10
    assert by_event[("dev-1", "disconnect")]["reason"]
    assert by_event[("dev-1", "connect")]["remote"].startswith("127.0.0.1:")
    table.createOrReplaceTempView("fleet_events")
    availability = spark.sql(AVAILABILITY).collect()
    assert [(r["device_id"], r["disconnects"]) for r in availability] == [("dev-1", 1), ("dev-2", 1)]
    assert all(0 <= r["connected_s"] < 60 for r in availability)
    # The messages table holds the messages only.
    topics = {r["topic"] for r in spark.read.parquet(str(cfg.table)).select("topic").collect()}
    assert topics == {"t"}
