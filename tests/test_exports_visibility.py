"""What an operator sees of the exports: ``filemq status`` (text and JSON), the
``$SYS/broker/export/NAME/...`` topics and Prometheus metrics labelled ``export="NAME"``."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

import cli
from filemq.broker.server import free_port
from filemq.mqtt.client import MQTTClient
from tests.pipeline_harness import agent_config, publish_local, run, until
from tests.scripted_brokers import ScriptedBroker
from worker_agent.app import Agent
from worker_agent.metrics import start_metrics_server

pytestmark = pytest.mark.timeout(60)


def test_status_sys_and_metrics_show_each_export(tmp_path: Path) -> None:
    async def scenario() -> None:
        up = ScriptedBroker()
        await up.start()
        dead = free_port()
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "cloud"
url = "mqtt://127.0.0.1:{up.port}"
priority = 5

[[export]]
name = "dc"
url = "filemq://127.0.0.1:{dead}"

[[export]]
name = "lab"
url = "mqtt://127.0.0.1:{dead}"
enabled = false
"""))
        await agent.start()
        server = start_metrics_server(agent, 0)
        try:
            await publish_local(agent.broker.port, 30)
            cloud, dc = agent.exports.get("cloud"), agent.exports.get("dc")
            assert cloud is not None and dc is not None
            await until(lambda: cloud.group is not None and cloud.group.lag == 0, what="cloud drained")
            await until(lambda: dc.state() == "backoff", what="dc backing off")
            status = {e["name"]: e for e in agent.exports.status()}
            assert status["cloud"]["state"] == "connected" and status["cloud"]["lag_records"] == 0
            assert status["cloud"]["last_ack_unix"] is not None and status["cloud"]["priority"] == 5
            assert status["dc"]["state"] == "backoff" and "cannot connect" in status["dc"]["last_error"]
            assert status["dc"]["lag_records"] == 30 and status["dc"]["lag_bytes"] > 0
            assert status["dc"]["oldest_unsent_age_s"] is not None
            assert status["lab"]["state"] == "disabled"

            watcher = MQTTClient("watcher", port=agent.broker.port)
            await watcher.connect()
            await watcher.subscribe([("$SYS/broker/export/#", 0)])
            seen: dict[str, bytes] = {}
            async with asyncio.timeout(10):
                async for message in watcher.messages():
                    seen[message.topic] = message.payload
                    if "$SYS/broker/export/dc/lag/records" in seen and "$SYS/broker/export/cloud/state" in seen:
                        break
            await watcher.disconnect()
            assert seen["$SYS/broker/export/cloud/state"] == b"connected"
            assert seen["$SYS/broker/export/dc/lag/records"] == b"30"

            url = f"http://127.0.0.1:{server.port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
            assert 'filemq_agent_export_lag_records{export="dc"} 30.0' in text
            assert 'filemq_agent_export_connected{export="cloud"} 1.0' in text
            assert 'filemq_agent_export_backoff{export="dc"} 1.0' in text
            assert 'filemq_agent_export_records_acked_total{export="cloud"} 30.0' in text
            await until(lambda: (tmp_path / "agent" / "exports.json").is_file(), what="status file")
        finally:
            server.shutdown()
            await agent.stop()
            await up.stop()

    run(scenario())
    result = CliRunner().invoke(cli.main, ["status", str(tmp_path / "agent"), "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output.strip().splitlines()[-1])
    exports = {e["name"]: e for e in body["exports"]}
    # Written at shutdown: stopped, with what was last wrong and the backlog left.
    assert exports["dc"]["state"] == "stopped" and exports["dc"]["lag_records"] == 30
    assert "cannot connect" in exports["dc"]["last_error"]
    assert exports["cloud"]["url"].startswith("mqtt://127.0.0.1:")
    text = CliRunner().invoke(cli.main, ["status", str(tmp_path / "agent")]).output
    assert "export 'dc' -> filemq://127.0.0.1:" in text and "stopped, last error: cannot connect" in text
    assert "lag 30 records" in text and "export 'lab'" in text and ": disabled" in text
