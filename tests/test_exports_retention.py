"""Retention and exports: a segment is deleted only when every enabled export is past it,
unless log.retention_bytes forces it; then what each export lost unsent is counted (status,
$SYS, metrics) and logged once per export and deletion (docs/FORWARDING.md, "Retention")."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from filemq.broker.server import free_port
from filemq.queue.groups import escape_group_name
from tests.pipeline_harness import agent_config, publish_local, run, until
from tests.scripted_brokers import ScriptedBroker
from worker_agent.app import Agent

pytestmark = pytest.mark.timeout(60)

SMALL_SEGMENTS = {"log.segment_bytes": 4096}


def test_age_retention_waits_for_an_enabled_export_but_not_a_disabled_one(tmp_path: Path) -> None:
    async def scenario() -> None:
        dead = free_port()
        toml = f'[[export]]\nname = "down"\nurl = "mqtt://127.0.0.1:{dead}"\n'
        agent = Agent(agent_config(tmp_path, toml, **SMALL_SEGMENTS, **{"log.retention_ms": 1}))
        await agent.start()
        try:
            await publish_local(agent.broker.port, 400, prefix="x" * 100)
            queue = agent.broker.queue
            assert queue is not None and len(queue.log.segments()) > 3
            report = queue.run_retention()
            assert report.segments_deleted == 0 and queue.log.first_offset == 0
        finally:
            await agent.stop()
        # The same export disabled: its group keeps its position on disk but no longer holds
        # back retention.
        agent = Agent(agent_config(tmp_path, toml + "enabled = false\n", **SMALL_SEGMENTS, **{"log.retention_ms": 1}))
        await agent.start()
        try:
            queue = agent.broker.queue
            assert queue is not None
            assert queue.get_group("export.down") is None
            report = queue.run_retention()
            assert report.segments_deleted > 0 and report.dropped_needed == 0
            (entry,) = agent.exports.status()
            assert entry["state"] == "disabled"
        finally:
            await agent.stop()
        assert (tmp_path / "agent" / "groups" / escape_group_name("export.down") / "pending").is_file()

    run(scenario())


def test_forced_retention_counts_and_logs_what_each_export_lost(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        up = ScriptedBroker()
        await up.start()
        dead = free_port()
        agent = Agent(agent_config(tmp_path, **SMALL_SEGMENTS, **{
            "log.retention_bytes": 8192,
            "agent.export": [f"live=mqtt://127.0.0.1:{up.port}", f"down=mqtt://127.0.0.1:{dead}"]}))
        await agent.start()
        try:
            await publish_local(agent.broker.port, 400, prefix="x" * 100)
            live, down = agent.exports.get("live"), agent.exports.get("down")
            assert live is not None and down is not None and live.group is not None and down.group is not None
            live_group = live.group
            await until(lambda: live_group.lag == 0, what="live export drained")
            queue = agent.broker.queue
            assert queue is not None
            with caplog.at_level(logging.WARNING, logger="worker_agent.exports"):
                report = queue.run_retention()
                agent.exports.note_retention()
            first = queue.log.first_offset
            assert report.segments_deleted > 0 and first > 0
            assert live.lost_records == 0
            assert down.lost_records == first
            lines = [r.getMessage() for r in caplog.records if r.name == "worker_agent.exports"]
            assert lines == [f"export 'down': retention (log.retention_bytes) deleted offsets 0..{first - 1} "
                             f"({first} records) before the export shipped them"]
            status = {e["name"]: e for e in agent.exports.status()}
            assert status["down"]["lost_records"] == first and status["live"]["lost_records"] == 0
            sys_topics = dict(agent.exports.sys_messages())
            assert sys_topics["$SYS/broker/export/down/lost_records"] == str(first).encode()
        finally:
            await agent.stop()
            await up.stop()

    run(scenario())
