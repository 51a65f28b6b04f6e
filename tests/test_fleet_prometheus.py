"""The shipped Prometheus alert rules, scrape configuration and Grafana dashboard
(docs/prometheus/, docs/grafana/): `promtool check rules` / `check config` pass, and every
metric they name exists in a scrape of a running collector and agent (skipped, with the
reason, where Debian's `prometheus` package -- promtool -- is not installed)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from collector.ops import start_ops_server
from collector.server import Collector
from filemq.broker.server import free_port
from tests.test_collector import config as collector_config
from tests.test_e2e_forward import run, until
from tests.test_exports_mqtt import agent_config, publish_local
from worker_agent.app import Agent
from worker_agent.metrics import start_metrics_server

pytestmark = pytest.mark.timeout(120)

DOCS = Path(__file__).resolve().parent.parent / "docs"
RULES = DOCS / "prometheus" / "filemq-rules.yml"
SCRAPE = DOCS / "prometheus" / "prometheus.yml"
DASHBOARD = DOCS / "grafana" / "filemq-fleet.json"
METRIC = re.compile(r"\bfilemq_[a-z0-9_]+")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; make system-deps installs it)")
    return found


def test_promtool_accepts_the_rules_and_the_scrape_config() -> None:
    tool = promtool()
    for args in (["check", "rules", str(RULES)], ["check", "config", "--syntax-only", str(SCRAPE)]):
        done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 16 rules found" in subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True,
                                                       text=True, timeout=60, check=False).stdout


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def names_in(texts: list[str]) -> set[str]:
    return {m for t in texts for m in METRIC.findall(t)}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text: str = resp.read().decode()
    return text


def exported(text: str) -> set[str]:
    """Metric names with at least one sample in a Prometheus text scrape."""
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_metric_named_exists_in_a_scrape(tmp_path: Path) -> None:
    rule_names = names_in([RULES.read_text()])
    dash_names = names_in(dashboard_exprs())
    assert len(rule_names) >= 15 and len(dash_names) >= 20  # the files were read
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.fleet_device_labels": True,
                                                             "collector.roll_seconds": 1}))
        await collector.start()
        ops = start_ops_server(collector, 0)
        dead = free_port()  # a second export that cannot connect: lag and oldest unsent age exist
        agent = Agent(agent_config(tmp_path, f"""
[agent]
collector = "127.0.0.1:{collector.port}"
health_interval_s = 1

[[export]]
name = "dead"
url = "filemq://127.0.0.1:{dead}"
""", **{"log.fsync": "always"}))  # fsync latency exists once the log has synced
        await agent.start()
        metrics = start_metrics_server(agent, 0)
        try:
            await publish_local(agent.broker.port, 20)
            await until(lambda: collector.lander is not None and collector.lander.stats.rows_landed == 20,
                        what="rows landed")
            await until(lambda: any(d.reports >= 2 for d in collector.fleet.devices.values()), what="health")
            out["collector"] = await asyncio.to_thread(scrape, f"http://127.0.0.1:{ops.port}/metrics")
            out["agent"] = await asyncio.to_thread(scrape, f"http://127.0.0.1:{metrics.port}/metrics")
        finally:
            metrics.shutdown()
            await agent.stop()
            ops.shutdown()
            await collector.stop()

    run(scenario())
    have = exported(out["collector"]) | exported(out["agent"])
    missing_rules = sorted(rule_names - have)
    missing_dash = sorted(dash_names - have)
    assert not missing_rules, f"alert rules name metrics no scrape has: {missing_rules}"
    assert not missing_dash, f"the dashboard names metrics no scrape has: {missing_dash}"
