"""The issue's done criterion, with real processes: three agents feeding one collector appear in
/api/fleet as connected with their export lag; a kill -9 of one shows it disconnected within 15 s;
`filemq fleet` (table and --json) shows the same."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from filemq.broker.server import free_port
from filemq.mqtt.client import MQTTClient
from tests.pipeline_harness import REPO, kill9, kill_leftovers, start_process, terminate

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

DEVICES = ("dev-a", "dev-b", "dev-c")


def api(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/api/fleet", timeout=5) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


async def filemq(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "cli", *args, cwd=REPO,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


def test_three_agents_one_killed(tmp_path: Path) -> None:
    started: list[asyncio.subprocess.Process] = []
    ops_port = free_port()
    url = f"http://127.0.0.1:{ops_port}"
    result: dict[str, Any] = {}

    async def scenario() -> None:
        collector_port = free_port()
        await start_process(["collector", "--data-dir", str(tmp_path / "collector"), "--landing",
                             str(tmp_path / "landing"), "--port", str(collector_port), "--collector-id", "c1",
                             "--roll-seconds", "1", "--metrics-port", str(ops_port),
                             # 1 s reports on a loaded test machine: no "stale" from a late one
                             "--fleet-stale-intervals", "30"], "filemq collector", started)
        agents: dict[str, asyncio.subprocess.Process] = {}
        ports: dict[str, int] = {}
        for device in DEVICES:
            ports[device] = free_port()
            extra = ["--rate-limit-bytes-per-s", "2000"] if device == "dev-c" else []  # dev-c stays behind
            agents[device] = await start_process(
                ["agent", "--data-dir", str(tmp_path / device), "--device-id", device, "--collector",
                 f"127.0.0.1:{collector_port}", "--port", str(ports[device]), "--health-interval-s", "1",
                 "--backoff-max-ms", "500", "--batch-records", "50", *extra], "filemq agent", started)
        for device in DEVICES:
            client = MQTTClient(f"sensor-{device}", port=ports[device])
            await client.connect()
            for i in range(200):
                await client.publish(f"sensors/{device}", b"x" * 100 + str(i).encode(), qos=1, timeout=5)
            await client.disconnect()

        def lags(body: dict[str, Any]) -> dict[str, Any]:
            return {d["device_id"]: [e["lag_records"] for e in d["exports"]] for d in body["devices"]}

        deadline = time.monotonic() + 30
        while True:
            body = await asyncio.to_thread(api, url)
            seen = {d["device_id"]: d for d in body["devices"]}
            if (set(seen) == set(DEVICES) and all(d["connected"] for d in seen.values())
                    and seen["dev-a"]["exports"] and seen["dev-a"]["exports"][0]["lag_records"] == 0
                    and seen["dev-c"]["exports"] and seen["dev-c"]["exports"][0]["lag_records"] > 0):
                break
            assert time.monotonic() < deadline, f"fleet never showed three connected devices with lag: {body}"
            await asyncio.sleep(0.3)
        result["before"] = body
        result["before_lags"] = lags(body)
        await kill9(agents["dev-b"])
        killed_at = time.monotonic()
        while True:
            body = await asyncio.to_thread(api, url)
            dev_b = next(d for d in body["devices"] if d["device_id"] == "dev-b")
            if not dev_b["connected"]:
                break
            assert time.monotonic() - killed_at < 15, "kill -9 not visible within 15 s"
            await asyncio.sleep(0.2)
        result["noticed_s"] = time.monotonic() - killed_at
        result["after"] = body
        result["table"] = await filemq("fleet", "--url", url)
        result["json"] = await filemq("fleet", "--url", url, "--json")
        for device in ("dev-a", "dev-c"):
            assert await terminate(agents[device]) == 0

    async def guarded() -> None:
        try:
            await scenario()
        finally:
            await kill_leftovers(started)

    asyncio.run(asyncio.wait_for(guarded(), 140))
    before = {d["device_id"]: d for d in result["before"]["devices"]}
    assert all(before[d]["connected"] and before[d]["state"] in ("online", "behind") for d in DEVICES)
    assert result["before_lags"]["dev-a"] == [0] and result["before_lags"]["dev-c"][0] > 0
    assert all(before[d]["exports"][0]["name"] == "collector" for d in DEVICES)
    assert all(isinstance(before[d]["exports"][0]["oldest_unacked_age_s"], float | None) for d in DEVICES)
    logging.getLogger(__name__).info("kill -9 of dev-b visible in /api/fleet after %.2f s", result["noticed_s"])
    assert result["noticed_s"] < 15
    after = {d["device_id"]: d for d in result["after"]["devices"]}
    assert after["dev-b"]["state"] == "offline" and after["dev-b"]["disconnect_reason"]
    assert after["dev-a"]["connected"] and after["dev-c"]["connected"]
    assert result["after"]["counts"]["offline"] == 1 and result["after"]["counts"]["total"] == 3
    code, table = result["table"]
    assert code == 0
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert rows["dev-b"][1:3] == ["offline", "no"]
    assert rows["dev-a"][2] == "yes" and rows["dev-c"][2] == "yes"
    code, text = result["json"]
    assert code == 0
    body = json.loads(text)
    assert {d["device_id"]: d["connected"] for d in body["devices"]} == {"dev-a": True, "dev-b": False,
                                                                        "dev-c": True}
