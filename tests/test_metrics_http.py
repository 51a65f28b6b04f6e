"""Prometheus metrics of the broker's own figures (filemq/broker/metrics.py, filemq/ops/metrics_http.py).

Scraped over loopback from a running `filemq broker` (``broker.metrics_port``) and a running
agent (``agent.metrics_port``), and parsed with prometheus-client's own text-format parser
(an independent reader of the exposition format).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from filemq.broker.core import SESSION_GROUP_PREFIX
from filemq.broker.metrics import Family, render_text
from filemq.broker.server import free_port
from filemq.common.config import load_config
from filemq.mqtt.client import MQTTClient
from filemq.ops.broker_app import serve

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """(family name -> type, (sample name, sorted labels) -> value)."""
    kinds: dict[str, str] = {}
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        kinds[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return kinds, samples


def test_render_text_escapes_labels_and_names_counters_with_total() -> None:
    fam = Family("filemq_broker_x", "counter", "A\\B\nC", [("filemq_broker_x_total", {"g": 'a"b\\c\nd'}, 3)])
    text = render_text([fam, Family("filemq_broker_y_seconds", "gauge", "y", [("filemq_broker_y_seconds", {}, 0.25)])])
    assert text.splitlines()[:2] == ["# HELP filemq_broker_x_total A\\\\B\\nC", "# TYPE filemq_broker_x_total counter"]
    kinds, samples = parse(text)
    assert kinds == {"filemq_broker_x": "counter", "filemq_broker_y_seconds": "gauge"}
    assert samples == {("filemq_broker_x_total", (("g", 'a"b\\c\nd'),)): 3.0,
                       ("filemq_broker_y_seconds", ()): 0.25}


def test_broker_metrics_endpoint_exports_the_sys_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`filemq broker` with broker.metrics_port: clients, messages in/out, dropped, store and
    free bytes, fsyncs, per-group lag and oldest unacknowledged age -- without prometheus-client."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # a device install without it
    port, mport = free_port(), free_port()
    config = load_config(None, {"data_dir": str(tmp_path), "broker.port": port, "broker.metrics_port": mport,
                                "broker.sys_interval_s": 0})

    async def main() -> tuple[str, str, float, float, int]:
        stop = asyncio.Event()
        ready = asyncio.Event()
        task = asyncio.create_task(serve(config, ready=lambda line: ready.set(), stop=stop))
        await asyncio.wait_for(ready.wait(), 30)
        sub = MQTTClient("sub-1", port=port, clean_session=False)
        await sub.connect()
        await sub.subscribe([("t/#", 1)])
        await sub.disconnect()  # a persistent session: what follows is its backlog
        first = time.time()
        pub = MQTTClient("pub", port=port)
        await pub.connect()
        for i in range(5):
            await pub.publish("t/x", b"%05d" % i, qos=1)
        await pub.publish("$SYS/forged", b"x", qos=1)  # denied by the $-topic rule: dropped
        await pub.disconnect()
        kind, text = await asyncio.to_thread(scrape, mport)
        with pytest.raises(urllib.error.HTTPError) as missing:
            await asyncio.to_thread(scrape, mport, "/nothing")
        scraped = time.time()
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0
        return kind, text, first, scraped, missing.value.code

    kind, text, first, scraped, missing = asyncio.run(main())
    assert kind.startswith("text/plain; version=0.0.4") and missing == 404
    kinds, s = parse(text)
    assert all(name.startswith("filemq_broker_") for name in kinds)
    assert all(name.endswith("_total") for name, _ in s if kinds.get(name.removesuffix("_total")) == "counter")
    assert s[("filemq_broker_messages_received_total", ())] == 6
    assert s[("filemq_broker_publish_dropped_total", ())] == 1
    assert s[("filemq_broker_sys_skipped_total", ())] == 0
    assert s[("filemq_broker_connections_total", ())] == 2
    assert s[("filemq_broker_messages_sent_total", ())] == 0
    assert s[("filemq_broker_received_bytes_total", ())] > 6 * 5
    assert s[("filemq_broker_log_records", ())] == 5
    assert s[("filemq_broker_store_bytes", ())] == sum(p.stat().st_size for p in (tmp_path / "log").glob("*.log"))
    assert abs(s[("filemq_broker_free_bytes", ())] - shutil.disk_usage(tmp_path).free) < 256 << 20
    assert s[("filemq_broker_fsyncs_total", ())] >= 1 and s[("filemq_broker_fsync_seconds_total", ())] > 0
    assert kinds["filemq_broker_uptime_seconds"] == "gauge" and kinds["filemq_broker_clients_connected"] == "gauge"
    group = (("group", SESSION_GROUP_PREFIX + "sub-1"),)
    assert s[("filemq_broker_group_lag_records", group)] == 5
    age = s[("filemq_broker_group_oldest_unacked_age_seconds", group)]
    assert 0 < age <= scraped - first + 0.5


def test_agent_metrics_include_the_device_broker(tmp_path: Path) -> None:
    """The agent's /metrics has the broker's figures next to the forwarder's."""
    from worker_agent.app import GROUP_NAME, Agent
    from worker_agent.metrics import start_metrics_server

    config = load_config(None, {"data_dir": str(tmp_path), "broker.port": 0, "broker.sys_interval_s": 0,
                                "agent.device_id": "dev-1", "agent.collector": f"127.0.0.1:{free_port()}"})

    async def main() -> str:
        agent = Agent(config)
        await agent.start()
        server: Any = start_metrics_server(agent, 0)
        try:
            pub = MQTTClient("pub", port=agent.broker.port)
            await pub.connect()
            for i in range(3):
                await pub.publish("t/x", b"%d" % i, qos=1)
            await pub.disconnect()
            return (await asyncio.to_thread(scrape, server.port))[1]
        finally:
            server.shutdown()
            await agent.stop()

    kinds, s = parse(asyncio.run(main()))
    assert s[("filemq_broker_messages_received_total", ())] == 3
    assert s[("filemq_broker_group_lag_records", (("group", GROUP_NAME),))] == 3
    assert s[("filemq_agent_lag_records", ())] == 3  # the collector is down: nothing shipped
    assert kinds["filemq_broker_store_bytes"] == "gauge"


def test_admission_and_ingest_budget_figures_in_metrics_and_sys(tmp_path: Path) -> None:
    """Issue 30's mechanisms are visible: three sockets that never send a CONNECT to a broker
    with ``max_connecting = 2`` fill the half-open set and stop accepting (the gauge and the
    counter say so), and the ingest budget's limit and use are exported; ``$SYS`` publishes
    the same figures under ``$SYS/broker/availability/``."""
    import socket

    port, mport = free_port(), free_port()
    limit = 8 << 20
    config = load_config(None, {"data_dir": str(tmp_path), "broker.port": port, "broker.metrics_port": mport,
                                "broker.sys_interval_s": 1, "broker.max_connecting": 2,
                                "broker.max_uncommitted_bytes": limit})

    async def main() -> tuple[str, dict[str, bytes]]:
        stop = asyncio.Event()
        ready = asyncio.Event()
        task = asyncio.create_task(serve(config, ready=lambda line: ready.set(), stop=stop))
        await asyncio.wait_for(ready.wait(), 30)
        sys_values: dict[str, bytes] = {}
        sub = MQTTClient("sys-reader", port=port)
        await sub.connect()
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            await sub.subscribe([("$SYS/broker/availability/#", 0)])
            deadline = time.monotonic() + 10
            text = ""
            while time.monotonic() < deadline:  # until the broker accepted two and paused
                _, text = await asyncio.to_thread(scrape, mport)
                _, s = parse(text)
                if s.get(("filemq_broker_connections_half_open", ()), 0) >= 2 \
                        and s.get(("filemq_broker_admission_accept_paused_total", ()), 0) >= 1:
                    break
                await asyncio.sleep(0.05)

            async def read_sys() -> None:  # retained now, then every sys_interval_s
                async for msg in sub.messages():
                    sys_values[msg.topic.rsplit("/", 1)[1]] = msg.payload
                    if int(sys_values.get("half_open", b"0")) >= 2 and "reader_holds" in sys_values:
                        return

            await asyncio.wait_for(read_sys(), max(0.1, deadline - time.monotonic()))
        finally:
            for sock in silent:
                sock.close()
            await sub.disconnect()
            stop.set()
            assert await asyncio.wait_for(task, 30) == 0
        return text, sys_values

    text, sys_values = asyncio.run(main())
    kinds, s = parse(text)
    assert s[("filemq_broker_connections_half_open", ())] >= 2
    assert s[("filemq_broker_admission_accept_paused_total", ())] >= 1
    assert kinds["filemq_broker_admission_evicted_silent"] == "counter"
    assert s[("filemq_broker_ingest_uncommitted_limit_bytes", ())] == limit
    assert 0 <= s[("filemq_broker_ingest_uncommitted_bytes", ())] < limit
    assert s[("filemq_broker_ingest_readers_held", ())] == 0
    assert int(sys_values["half_open"]) >= 2
    assert int(sys_values["uncommitted_limit_bytes"]) == limit
    assert {"accept_paused", "evicted_silent", "reader_holds"} <= set(sys_values)
