"""The /fleet page as a person sees it, in headless Chromium (Debian's `chromium`; skipped with
the reason where it is missing): three agents, one killed with kill -9, read from the page's
DOM after its scripts ran; screenshots at desktop and phone sizes are kept as artifacts in
build/artifacts/fleet/ (the desktop one is docs/images/fleet-desktop.png). A second test
renders a registry of 5,000 devices."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from collector.fleet import FleetRegistry
from collector.ops import start_ops_server
from collector.server import Collector
from filemq.broker.server import free_port
from filemq.mqtt.client import MQTTClient
from tests.collector_harness import collector_config
from tests.fleet_harness import Conn, health
from tests.pipeline_harness import REPO, kill9, kill_leftovers, start_process, terminate

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

ARTIFACTS = REPO / "build" / "artifacts" / "fleet"
SIZES = {"desktop": "1280,900", "phone": "390,844"}


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium not installed (Debian package `chromium`; make browser-deps installs it)")
    return found


def browse(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on ``url``, its scripts given up to 3 s of (virtual) time: the fetch and the first render."""
    argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--virtual-time-budget=3000", *extra, url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)


def rows_of(dom: str) -> dict[str, str]:
    """device id -> the class of its table row."""
    return {m.group(1): m.group(2) for m in re.finditer(r'<tr data-device="([^"]*)" class="([^"]*)"', dom)}


def api(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/api/fleet", timeout=5) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


def test_page_shows_three_agents_one_killed(tmp_path: Path) -> None:
    chromium()
    started: list[asyncio.subprocess.Process] = []
    ops_port = free_port()
    url = f"http://127.0.0.1:{ops_port}"

    async def scenario() -> None:
        collector_port = free_port()
        await start_process(["collector", "--data-dir", str(tmp_path / "collector"), "--landing",
                             str(tmp_path / "landing"), "--port", str(collector_port), "--collector-id", "c1",
                             "--roll-seconds", "1", "--metrics-port", str(ops_port),
                             # 1 s reports on a loaded test machine: no "stale" from a late one
                             "--fleet-stale-intervals", "30"], "filemq collector", started)
        agents = {}
        for device in ("dev-a", "dev-b", "dev-c"):
            port = free_port()
            agents[device] = await start_process(
                ["agent", "--data-dir", str(tmp_path / device), "--device-id", device, "--collector",
                 f"127.0.0.1:{collector_port}", "--port", str(port), "--health-interval-s", "1"],
                "filemq agent", started)
            client = MQTTClient(f"s-{device}", port=port)
            await client.connect()
            for i in range(20):
                await client.publish("sensors/t", str(i).encode(), qos=1, timeout=5)
            await client.disconnect()
        deadline = time.monotonic() + 30
        while True:
            body = await asyncio.to_thread(api, url)
            if len(body["devices"]) == 3 and all(d["connected"] and d["exports"] for d in body["devices"]):
                break
            assert time.monotonic() < deadline, body
            await asyncio.sleep(0.3)
        await kill9(agents["dev-b"])
        while True:
            body = await asyncio.to_thread(api, url)
            if not next(d for d in body["devices"] if d["device_id"] == "dev-b")["connected"]:
                break
            assert time.monotonic() < deadline + 15, body
            await asyncio.sleep(0.2)
        results["dom"] = await asyncio.to_thread(browse, url + "/fleet", tmp_path / "profile-dom", "--dump-dom")
        results["detail"] = await asyncio.to_thread(browse, url + "/fleet#device=dev-a", tmp_path / "profile-detail",
                                                    "--dump-dom")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for name, size in SIZES.items():
            shot = ARTIFACTS / f"fleet-{name}.png"
            shot.unlink(missing_ok=True)
            done = await asyncio.to_thread(browse, url + "/fleet", tmp_path / f"profile-{name}",
                                           f"--screenshot={shot}", f"--window-size={size}", "--hide-scrollbars")
            results[name] = (done, shot)
        for device in ("dev-a", "dev-c"):
            assert await terminate(agents[device]) == 0

    results: dict[str, Any] = {}

    async def guarded() -> None:
        try:
            await scenario()
        finally:
            await kill_leftovers(started)

    asyncio.run(asyncio.wait_for(guarded(), 170))
    dom = results["dom"].stdout
    assert results["dom"].returncode == 0, results["dom"].stderr[-2000:]
    rows = rows_of(dom)
    assert rows == {"dev-a": "", "dev-b": "offline", "dev-c": ""}, dom[-3000:]
    # The killed device keeps its last known state, marked as such; the others are online.
    assert re.search(r'data-device="dev-b" class="offline"><td>dev-b</td><td class="state state-offline">offline', dom)
    assert dom.count('class="state state-online">online') == 2
    assert '<span class="state-offline">1 offline</span>' in dom and 'data-devices="3"' in dom
    # One device's details: its lag over time (a line once it has two reports) and its connects.
    detail = results["detail"].stdout
    assert '<section id="detail">' in detail and "dev-a — online — export lag over time" in detail, detail[-3000:]
    assert re.search(r'<svg id="detail-plot"[^>]*><polyline points="[0-9., ]+">', detail)
    assert "connect 127.0.0.1:" in detail
    for name in SIZES:
        done, shot = results[name]
        assert done.returncode == 0 and shot.exists() and shot.stat().st_size > 5000, done.stderr[-2000:]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_renders_five_thousand_devices(tmp_path: Path) -> None:
    chromium()
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        fill(collector.fleet, 5000)
        server = start_ops_server(collector, 0)
        try:
            url = f"http://127.0.0.1:{server.port}/fleet"
            out["dom"] = await asyncio.to_thread(browse, url, tmp_path / "profile", "--dump-dom")
        finally:
            server.shutdown()
            await collector.stop()

    asyncio.run(asyncio.wait_for(scenario(), 150))
    dom = out["dom"].stdout
    assert out["dom"].returncode == 0, out["dom"].stderr[-2000:]
    assert len(rows_of(dom)) == 5000 and 'data-devices="5000"' in dom
    assert "5000 of 5000 devices shown" in dom
    assert re.search(r'data-render-ms="[0-9.]+"', dom)


def fill(registry: FleetRegistry, n: int) -> None:
    """``n`` devices, every tenth offline, some behind."""
    for i in range(n):
        device = f"dev-{i:05d}"
        conn = Conn()
        registry.seen(device, device, f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:40000", conn, "main", 100)
        registry.health(device, health(lag=i * 50), 0, 1)
        if i % 10 == 0:
            conn.closed, conn.close_reason = True, "connection lost"
    registry.sweep({})
