"""The agent's health reports as the collector receives them (worker_agent/health.py), the
interval key (0 = none), and the operations port over TLS with logins, read by `filemq fleet`."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from collector.ops import start_ops_server
from collector.server import Collector
from filemq.broker.auth import add_or_update
from filemq.ops.build import version
from tests.collector_harness import collector_config
from tests.pipeline_harness import DEVICE, REPO, agent_config, publish_local, run, until
from worker_agent.app import Agent

pytestmark = pytest.mark.timeout(90)


def test_agent_reports_version_disk_log_exports_and_counters(tmp_path: Path) -> None:
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.roll_seconds": 1}))
        await collector.start()
        agent = Agent(agent_config(tmp_path, **{"agent.collector": f"127.0.0.1:{collector.port}",
                                                "agent.health_interval_s": 1}))
        await agent.start()
        try:
            await publish_local(agent.broker.port, 25)
            fleet = collector.fleet

            def settled() -> bool:
                d = fleet.devices.get(DEVICE)
                h = d.health if d is not None else None
                return (h is not None and h.get("messages_received", 0) >= 25
                        and h["exports"][0].get("lag_records") == 0 and d is not None and d.reports >= 2)

            await until(settled, what="a report after the messages were acknowledged")
            out["detail"] = fleet.detail(DEVICE)
            out["sent"] = agent.forwarder.stats.health_reports_sent if agent.forwarder else 0
        finally:
            await agent.stop()
            await collector.stop()

    run(scenario())
    detail = out["detail"]
    h = detail["health"]
    assert h["agent_version"] == version() and h["build"] in ("pure", "compiled") and h["stream"] == "main"
    assert h["interval_s"] == 1 and h["uptime_s"] > 0
    assert h["log_bytes"] > 25 * 10 and h["disk_free_bytes"] > 0
    assert h["messages_received"] >= 25 and h["messages_dropped"] == 0 and h["oversized_skipped"] == 0
    assert h["recovery_corrupt_records"] == 0 and h["recovery_truncated_bytes"] == 0
    (export,) = h["exports"]
    assert export["name"] == "collector" and export["state"] == "connected" and export["kind"] == "filemq"
    assert export["lag_records"] == 0 and export["oldest_unacked_age_s"] is None and export["records_acked"] >= 25
    assert detail["connected"] and detail["state"] == "online" and detail["health_sequence"] >= 2
    assert detail["streams"]["main"]["records_received"] == 25
    assert out["sent"] >= detail["reports"]


def test_interval_zero_sends_no_reports(tmp_path: Path) -> None:
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.roll_seconds": 1}))
        await collector.start()
        agent = Agent(agent_config(tmp_path, **{"agent.collector": f"127.0.0.1:{collector.port}",
                                                "agent.health_interval_s": 0}))
        await agent.start()
        try:
            await publish_local(agent.broker.port, 5)
            await until(lambda: collector.lander is not None and collector.lander.stats.rows_landed == 5)
            out["reports"] = collector.stats.health_reports
            out["health"] = agent.health
            out["device"] = collector.fleet.detail(DEVICE)
        finally:
            await agent.stop()
            await collector.stop()

    run(scenario())
    assert out["reports"] == 0 and out["health"] is None
    # The device is still known and connected: from its batches.
    assert out["device"]["connected"] and out["device"]["state"] == "online" and out["device"]["health"] is None


def test_ops_port_over_tls_with_logins_and_filemq_fleet(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    passwords = tmp_path / "passwd"
    add_or_update(passwords, "ops", "s3cret", iterations=1000)
    (tmp_path / "ops-password").write_text("s3cret\n")
    out: dict[str, Any] = {}

    def get(url: str, ctx: ssl.SSLContext | None, auth: str | None) -> int:
        req = urllib.request.Request(url)
        if auth is not None:
            import base64
            req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.password_file": str(passwords),
                                                             "broker.tls_cert": str(cert), "broker.tls_key": str(key),
                                                             "broker.tls_port": 0}))
        await collector.start()
        server = start_ops_server(collector, 0)
        try:
            ctx = ssl.create_default_context(cafile=str(cert))
            base = f"https://localhost:{server.port}"
            out["https_no_login"] = await asyncio.to_thread(get, base + "/api/fleet", ctx, None)
            out["https_login"] = await asyncio.to_thread(get, base + "/api/fleet", ctx, "ops:s3cret")
            try:
                await asyncio.to_thread(get, f"http://localhost:{server.port}/api/fleet", None, "ops:s3cret")
                out["plain"] = "answered"
            except (urllib.error.URLError, ConnectionError, OSError) as exc:
                out["plain"] = f"refused: {exc}"
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "cli", "fleet", "--url", base, "--tls-ca", str(cert), "--username", "ops",
                "--password-file", str(tmp_path / "ops-password"), "--json", cwd=REPO,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
            out["cli"] = (proc.returncode, stdout.decode(), stderr.decode())
        finally:
            server.shutdown()
            await collector.stop()

    run(scenario())
    assert out["https_no_login"] == 401 and out["https_login"] == 200
    assert out["plain"].startswith("refused")
    code, stdout, stderr = out["cli"]
    assert code == 0, stderr
    assert json.loads(stdout)["counts"]["total"] == 0


def test_ops_port_off_loopback_without_logins_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        try:
            with caplog.at_level("WARNING", logger="collector.ops"):
                server = start_ops_server(collector, 0, "0.0.0.0")
                server.shutdown()
                quiet = start_ops_server(collector, 0, "127.0.0.1")
                quiet.shutdown()
        finally:
            await collector.stop()

    run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.name == "collector.ops" and r.levelname == "WARNING"]
    assert len(warnings) == 1 and "without logins" in warnings[0] and "0.0.0.0" in warnings[0]
