"""The second curated table, ``fleet_events``: every connect, disconnect and health report of the
devices, from ``<landing>/fleet_events/`` (:mod:`collector.fleet_events`), exactly once.

It is the same job as the messages' (:func:`spark_ingest.job.run_ingest`: its checkpoint, its
dedup by ``(device_id, stream, offset)``, its idempotent append), run on the fleet-event landing
directory into its own table and checkpoint, with the event payload parsed into typed columns
(:data:`EVENT_SCHEMA`; the whole JSON object stays in ``payload``). ``topic`` is the event:
``connect``, ``disconnect`` or ``health``; ``publish_ts`` when it happened. docs/INGEST.md shows
the availability query.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from pyspark.sql import SparkSession

from collector.fleet_events import LANDING_SUBDIR
from collector.landing import INCOMING_DIR
from spark_ingest.job import BatchReport, IngestConfig, IngestSummary, run_ingest

log = logging.getLogger(__name__)

TABLE_NAME = "fleet_events"
EVENT_SCHEMA = (
    "event string, reason string, remote string, client_id string, sequence bigint, lag_records bigint,"
    " oldest_unacked_age_s double, disk_free_bytes bigint, log_bytes bigint, agent_version string,"
    " uptime_s double, clients_connected bigint"
)
"""The typed columns of ``fleet_events`` parsed from each event's JSON payload."""


def fleet_events_config(config: IngestConfig, *, table: Path | None = None,
                        checkpoint: Path | None = None) -> IngestConfig:
    """The ingest settings of ``fleet_events`` beside the messages' ``config``: landing
    ``<landing>/fleet_events``, table ``table`` or ``fleet_events`` beside the messages table,
    checkpoint ``checkpoint`` or ``<checkpoint>_fleet_events`` (one checkpoint per table)."""
    return dataclasses.replace(
        config,
        landing=config.landing / LANDING_SUBDIR,
        table=table or config.table.parent / TABLE_NAME,
        checkpoint=checkpoint or config.checkpoint.with_name(config.checkpoint.name + "_" + TABLE_NAME),
        payload_schema=EVENT_SCHEMA,
        archive=config.archive / LANDING_SUBDIR if config.archive is not None else None,
    )


def has_fleet_events(config: IngestConfig) -> bool:
    """Whether a collector has landed fleet events under ``config.landing`` (a collector older
    than the fleet registry never creates the directory)."""
    return (config.landing / LANDING_SUBDIR / INCOMING_DIR).is_dir()


def run_with_fleet_events(
    spark: SparkSession,
    config: IngestConfig,
    events: IngestConfig | None,
    *,
    once: bool = True,
    every: float | None = None,
    on_batch: Callable[[str, BatchReport], None] | None = None,
) -> tuple[IngestSummary, IngestSummary | None]:
    """Ingest the messages and, when ``events`` is given, the fleet events.

    ``once``: one after the other. ``every``: the fleet events' query runs in a thread beside
    the messages' one and stops with it. ``on_batch`` gets the table name with each batch.
    """

    def reporter(name: str) -> Callable[[BatchReport], None] | None:
        return (lambda r: on_batch(name, r)) if on_batch is not None else None

    if events is None:
        return run_ingest(spark, config, once=once, every=every, on_batch=reporter("messages")), None
    if once:
        messages = run_ingest(spark, config, once=True, on_batch=reporter("messages"))
        return messages, run_ingest(spark, events, once=True, on_batch=reporter(TABLE_NAME))
    stop = threading.Event()
    result: list[IngestSummary] = []
    failure: list[BaseException] = []

    def events_loop() -> None:
        try:
            result.append(run_ingest(spark, events, once=False, every=every, on_batch=reporter(TABLE_NAME),
                                     stop=stop))
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)
            log.error("fleet_events ingest failed: %s", exc)

    thread = threading.Thread(target=events_loop, name="filemq-ingest-fleet-events", daemon=True)
    thread.start()
    try:
        messages = run_ingest(spark, config, once=False, every=every, on_batch=reporter("messages"))
    finally:
        stop.set()
        thread.join(60)
    if failure:
        raise failure[0]
    return messages, result[0] if result else None
