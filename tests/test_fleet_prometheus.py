"""The shipped Prometheus alert rules, scrape configuration and Grafana dashboard
(docs/prometheus/, docs/grafana/): `promtool check rules` / `check config` pass, every metric
they name exists in a scrape of a running collector and agent, and Debian's prometheus,
scraping both, evaluates every rule without error and gets data for every dashboard expression
(skipped, with the reason, where the `prometheus` package is not installed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from collector.ops import start_ops_server
from collector.server import Collector
from filemq.broker.server import free_port
from tests.collector_harness import collector_config
from tests.pipeline_harness import agent_config, publish_local, run, until
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


def test_prometheus_evaluates_every_rule_and_dashboard_expression(tmp_path: Path) -> None:
    """Debian's prometheus scrapes a running collector and agent (every second): every shipped
    rule evaluates without error, and every dashboard expression returns data."""
    server = shutil.which("prometheus")
    if server is None:
        pytest.skip("prometheus not installed (Debian package `prometheus`; make system-deps installs it)")
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.fleet_device_labels": True,
                                                             "collector.roll_seconds": 1}))
        await collector.start()
        ops = start_ops_server(collector, 0)
        dead = free_port()  # an export with a backlog: the oldest unacknowledged ages exist
        agent = Agent(agent_config(tmp_path, f"""
[agent]
collector = "127.0.0.1:{collector.port}"
health_interval_s = 1

[[export]]
name = "dead"
url = "filemq://127.0.0.1:{dead}"
""", **{"log.fsync": "always"}))
        await agent.start()
        metrics = start_metrics_server(agent, 0)
        web = free_port()
        rules = tmp_path / "rules.yml"
        rules.write_text(RULES.read_text())
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{rules}]\n"
            "scrape_configs:\n"
            f"  - {{job_name: filemq-collector, static_configs: [{{targets: ['127.0.0.1:{ops.port}']}}]}}\n"
            f"  - {{job_name: filemq-agent, static_configs: [{{targets: ['127.0.0.1:{metrics.port}']}}]}}\n")
        proc = await asyncio.create_subprocess_exec(
            server, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}", stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        base = f"http://127.0.0.1:{web}/api/v1/"
        try:
            for i in range(6):  # keep data flowing: rates need a few samples
                await publish_local(agent.broker.port, 10, prefix=f"p{i}")
                await asyncio.sleep(1.0)

            def query(expr: str) -> Any:
                url = base + "query?" + urllib.parse.urlencode({"query": expr})
                with urllib.request.urlopen(url, timeout=10) as resp:
                    return json.loads(resp.read())

            def rule_groups() -> Any:
                with urllib.request.urlopen(base + "rules", timeout=10) as resp:
                    return json.loads(resp.read())["data"]["groups"]

            async def ready() -> bool:
                try:
                    groups = await asyncio.to_thread(rule_groups)
                except OSError:
                    return False
                rules = [r for g in groups for r in g["rules"]]
                return bool(rules) and all(r.get("lastEvaluation", "").startswith("20") for r in rules)

            deadline = asyncio.get_running_loop().time() + 40
            while not await ready():
                assert asyncio.get_running_loop().time() < deadline, "prometheus never evaluated the rules"
                await asyncio.sleep(0.5)
            await asyncio.sleep(3.0)
            out["rules"] = [r for g in await asyncio.to_thread(rule_groups) for r in g["rules"]]
            exprs = [e.replace("$device", ".*").replace("$agent", ".*") for e in dashboard_exprs()
                     if not e.startswith("label_values")]
            out["dashboard"] = {e: await asyncio.to_thread(query, e) for e in exprs}
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            await asyncio.wait_for(proc.wait(), 20)
            metrics.shutdown()
            await agent.stop()
            ops.shutdown()
            await collector.stop()

    run(scenario(), timeout=110)
    assert len(out["rules"]) == 16
    bad = [(r["name"], r.get("lastError")) for r in out["rules"] if r["health"] != "ok"]
    assert not bad, bad
    empty = [e for e, answer in out["dashboard"].items()
             if answer["status"] != "success" or not answer["data"]["result"]]
    assert not empty, f"dashboard expressions without data: {empty}"
