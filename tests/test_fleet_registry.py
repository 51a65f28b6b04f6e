"""The collector's fleet registry (collector/fleet.py) and its operations port (collector/ops.py):
states and thresholds, connection tracking, durability across a restart, the bound, /api/fleet,
/api/fleet/<device>, /fleet, /metrics aggregates and the logins."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from collector.fleet import FLEET_FILE, CachedBody, Device, FleetRegistry, Thresholds, device_state
from collector.fleet_view import fleet_table
from collector.ops import start_ops_server
from collector.server import Collector
from filemq.broker.auth import add_or_update
from filemq.mqtt.client import MQTTClient
from filemq.upstream.health import encode_health, health_topic
from segments.fileio import atomic_write
from tests.collector_harness import collector_config, collector_run, collector_until
from tests.fleet_harness import Conn, batch, health

pytestmark = pytest.mark.timeout(90)


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def test_states_follow_the_thresholds() -> None:
    clock = Clock()
    t = Thresholds(behind_records=1000, behind_age_s=600, disk_low_bytes=1 << 20, stale_intervals=3)
    reg = FleetRegistry(None, t, clock=clock)
    conn = Conn()
    reg.seen("d", "d", "10.0.0.1:5", conn)
    d = reg.devices["d"]
    assert device_state(d, clock.t, t) == "online"  # connected, no report yet
    reg.health("d", health(), 0, 1)
    assert device_state(d, clock.t, t) == "online"
    reg.health("d", health(lag=1001), 0, 2)
    assert device_state(d, clock.t, t) == "behind"
    reg.health("d", health(age=601), 0, 3)
    assert device_state(d, clock.t, t) == "behind"
    reg.health("d", health(free=(1 << 20) - 1, lag=5000), 0, 4)
    assert device_state(d, clock.t, t) == "disk_low"  # disk low outranks behind
    clock.t += 3 * 30 + 1
    assert device_state(d, clock.t, t) == "stale"  # nothing for three intervals
    conn.closed, conn.close_reason = True, "connection lost"
    reg.sweep({})
    assert device_state(d, clock.t, t) == "offline"
    assert d.disconnect_reason == "connection lost"
    assert reg.counts(clock.t) == {"online": 0, "behind": 0, "disk_low": 0, "stale": 0, "offline": 1, "total": 1}
    # Offline keeps the last known state: the report and its figures are still there.
    assert reg.summary(d, clock.t)["lag_records"] == 5000


def test_sweep_tracks_connects_disconnects_and_takeovers() -> None:
    clock = Clock()
    events: list[tuple[str, str, Any]] = []
    reg = FleetRegistry(None, clock=clock)
    reg.on_event = lambda dev, kind, t, details: events.append((dev, kind, dict(details)))
    first = Conn()
    reg.seen("d", "cid", "a:1", first, "main", 10)
    second = Conn()  # the same client id again: the old connection is replaced
    first.closed, first.close_reason = True, "session taken over"
    reg.seen("d", "cid", "a:2", second, "main", 5)
    second.closed, second.close_reason = True, "connection lost"
    reg.sweep({})
    third = Conn("a:3")
    reg.sweep({"cid": third})  # a known client id connected again before publishing anything
    d = reg.devices["d"]
    assert d.connected and d.conn is third and d.connects == 3 and d.remote == "a:3"
    assert [(k, det.get("reason")) for _, k, det in events] == [
        ("connect", None), ("disconnect", "session taken over"), ("connect", None),
        ("disconnect", "connection lost"), ("connect", None)]
    assert d.streams == {"main": {"records_received": 15, "records_landed": 0}}
    reg.landed({("d", "main"): 12})
    assert d.streams["main"]["records_landed"] == 12


def test_registry_is_bounded_and_evicts_the_longest_offline() -> None:
    clock = Clock()
    reg = FleetRegistry(None, max_devices=3, clock=clock)
    conns = {}
    for name in ("a", "b", "c"):
        clock.t += 1
        conns[name] = Conn()
        reg.seen(name, name, "", conns[name])
    conns["b"].closed = True
    conns["a"].closed = True
    reg.sweep({})  # a and b offline; a went first but both at the same time: the older last_seen goes
    reg.devices["a"].last_seen -= 10
    reg.seen("d", "d", "", Conn())
    assert sorted(reg.devices) == ["b", "c", "d"] and reg.evicted == 1
    # Connected devices are never evicted: with none offline, the registry grows past the bound.
    reg2 = FleetRegistry(None, max_devices=1, clock=clock)
    reg2.seen("x", "x", "", Conn())
    reg2.seen("y", "y", "", Conn())
    assert sorted(reg2.devices) == ["x", "y"]


def test_snapshot_survives_a_restart_and_a_damaged_one_is_set_aside(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / FLEET_FILE
    reg = FleetRegistry(path, clock=clock)
    reg.seen("d", "cid", "10.1.1.1:4", Conn(), "main", 7)
    reg.health("d", health(lag=3), 1_700_000_000_000_000, 9)
    reg.landed({("d", "main"): 7})
    reg.save(atomic_write)
    again = FleetRegistry(path, clock=clock)
    assert again.load() == 1
    d = again.devices["d"]
    assert not d.connected and d.disconnect_reason == "collector restarted"
    assert d.streams == {"main": {"records_received": 7, "records_landed": 7}}
    assert d.health == health(lag=3) and d.health_sequence == 9 and d.remote == "10.1.1.1:4"
    assert again.summary(d, clock.t)["state"] == "offline"
    path.write_bytes(b'{"version": 1, "devices": [{"nope": 1}]}')
    broken = FleetRegistry(path, clock=clock)
    assert broken.load() == 0 and not path.exists() and path.with_suffix(".damaged").exists()


def test_fleet_table_prints_counts_and_rows() -> None:
    clock = Clock()
    reg = FleetRegistry(None, clock=clock)
    reg.seen("dev-b", "dev-b", "1.2.3.4:5", Conn())
    reg.health("dev-b", health(lag=42, free=3 << 30), 0, 1)
    lines = fleet_table(reg.fleet(), now=clock.t + 5)
    assert lines[0] == "1 devices: 1 online, 0 behind, 0 disk_low, 0 stale, 0 offline"
    assert lines[1].split() == ["DEVICE", "STATE", "CONNECTED", "LAST", "SEEN", "LAG", "OLDEST", "DISK", "FREE",
                                "REMOTE"]
    assert lines[2].split() == ["dev-b", "online", "yes", "5s", "ago", "42", "1s", "3.0GiB", "1.2.3.4:5"]


# -- the collector, in process ------------------------------------------------------------------------


def _get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, bytes, str]:
    req = urllib.request.Request(url)
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def test_collector_registry_ops_port_and_restart(tmp_path: Path) -> None:
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.roll_seconds": 1}))
        await collector.start()
        server = start_ops_server(collector, 0)
        base = f"http://127.0.0.1:{server.port}"
        try:
            client = MQTTClient("dev-1", port=collector.port)
            await client.connect()
            await client.publish(health_topic("dev-1"), encode_health("dev-1", 0, 1, health(lag=17)), qos=0)
            await client.publish("filemq/v1/dev-1/main", batch(0, 7), qos=1, timeout=5)
            await collector_until(lambda: collector.lander is not None and collector.lander.stats.rows_landed == 7)
            await collector_until(lambda: collector.fleet.devices["dev-1"].streams["main"]["records_landed"] == 7)
            out["fleet"] = json.loads((await asyncio.to_thread(_get, base + "/api/fleet"))[1])
            out["detail"] = await asyncio.to_thread(_get, base + "/api/fleet/dev-1")
            out["missing"] = await asyncio.to_thread(_get, base + "/api/fleet/nope")
            out["page"] = await asyncio.to_thread(_get, base + "/fleet")
            out["js"] = await asyncio.to_thread(_get, base + "/fleet/fleet.js")
            out["metrics"] = (await asyncio.to_thread(_get, base + "/metrics"))[1].decode()
            # The agent dies without a DISCONNECT: its socket closes, the sweep sees it within a second.
            assert client._writer is not None
            client._writer.transport.abort()
            loop = asyncio.get_running_loop()
            gone = loop.time()
            await collector_until(lambda: not collector.fleet.devices["dev-1"].connected, timeout=5)
            out["noticed_s"] = loop.time() - gone
            for _ in range(50):  # /api/fleet's body may be up to max_age_s (2 s) old
                out["after"] = json.loads((await asyncio.to_thread(_get, base + "/api/fleet"))[1])
                if not out["after"]["devices"][0]["connected"]:
                    break
                await asyncio.sleep(0.1)
            await client.disconnect()
        finally:
            server.shutdown()
            await collector.stop()
        again = Collector(collector_config(tmp_path))
        await again.start()
        try:
            out["restarted"] = again.fleet.detail("dev-1")
        finally:
            await again.stop()

    collector_run(scenario(), timeout=60)
    fleet = out["fleet"]
    (dev,) = fleet["devices"]
    assert fleet["counts"]["online"] == 1 and fleet["counts"]["total"] == 1 and fleet["collector_id"] == "c1"
    assert dev["device_id"] == "dev-1" and dev["connected"] is True and dev["state"] == "online"
    assert dev["exports"] == [{"name": "collector", "state": "connected", "lag_records": 17, "lag_bytes": 1700,
                               "oldest_unacked_age_s": 1.0}]
    assert dev["disk_free_bytes"] == 10**10 and dev["last_seen"].endswith("Z") and dev["remote"].startswith("127.0.0.1:")
    assert dev["records_received"] == 7 and dev["records_landed"] == 7
    code, body, ctype = out["detail"]
    detail = json.loads(body)
    assert code == 200 and ctype == "application/json"
    assert detail["history"][0]["lag_records"] == 17 and detail["events"][0]["event"] == "connect"
    assert detail["streams"] == {"main": {"records_received": 7, "records_landed": 7}}
    assert out["missing"][0] == 404
    assert out["page"][0] == 200 and b"/fleet/fleet.js" in out["page"][1] and b"http" not in out["page"][1]
    assert out["js"][0] == 200 and out["js"][2].startswith("text/javascript")
    metrics = out["metrics"]
    assert 'filemq_collector_fleet_devices{state="online"} 1.0' in metrics
    assert "filemq_collector_fleet_devices_connected 1.0" in metrics
    assert "filemq_collector_fleet_max_lag_records 17.0" in metrics
    assert "filemq_collector_health_reports_total 1.0" in metrics
    assert "device=" not in metrics  # no label per device by default
    assert out["noticed_s"] < 3.0
    (after,) = out["after"]["devices"]
    assert after["connected"] is False and after["state"] == "offline" and after["exports"][0]["lag_records"] == 17
    restarted = out["restarted"]
    assert restarted["connected"] is False and restarted["streams"]["main"]["records_landed"] == 7
    assert restarted["health"]["exports"][0]["lag_records"] == 17


def test_ops_port_needs_the_device_logins_and_labels_devices_on_request(tmp_path: Path) -> None:
    passwords = tmp_path / "passwd"
    add_or_update(passwords, "ops", "s3cret", iterations=1000)
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.password_file": str(passwords),
                                                  "collector.fleet_device_labels": True}))
        await collector.start()
        server = start_ops_server(collector, 0)
        base = f"http://127.0.0.1:{server.port}"
        try:
            client = MQTTClient("dev-9", port=collector.port, username="ops", password="s3cret")
            await client.connect()
            await client.publish(health_topic("dev-9"), encode_health("dev-9", 0, 1, health(lag=3)), qos=0)
            await collector_until(lambda: "dev-9" in collector.fleet.devices and collector.fleet.devices["dev-9"].reports == 1)
            for name, auth in (("none", None), ("wrong", ("ops", "nope")), ("right", ("ops", "s3cret"))):
                out[name] = await asyncio.to_thread(_get, base + "/api/fleet", auth)
            out["metrics"] = (await asyncio.to_thread(_get, base + "/metrics", ("ops", "s3cret")))[1].decode()
            await client.disconnect()
        finally:
            server.shutdown()
            await collector.stop()

    collector_run(scenario(), timeout=60)
    assert out["none"][0] == 401 and out["wrong"][0] == 401
    assert out["right"][0] == 200 and json.loads(out["right"][1])["devices"][0]["device_id"] == "dev-9"
    assert 'filemq_collector_device_lag_records{device="dev-9"} 3.0' in out["metrics"]


def test_damaged_and_malformed_reports_at_the_door(tmp_path: Path) -> None:
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        try:
            client = MQTTClient("dev-1", port=collector.port)
            await client.connect()
            await client.publish(health_topic("dev-1"), b"FMQH" + bytes(40), qos=0)  # CRC mismatch
            await collector_until(lambda: collector.stats.health_rejected == 1)
            await client.disconnect()
            client = MQTTClient("dev-2", port=collector.port)
            await client.connect()
            # A valid report of another device on dev-2's topic: refused, never filed under either.
            await client.publish(health_topic("dev-2"), encode_health("dev-3", 0, 1, {}), qos=0)
            await collector_until(lambda: collector.stats.health_rejected == 2)
            await client.disconnect()
            out["devices"] = sorted(collector.fleet.devices)
            out["quarantined"] = collector.stats.quarantined
        finally:
            await collector.stop()

    collector_run(scenario(), timeout=60)
    assert out["devices"] == [] and out["quarantined"] == 0


def test_device_state_without_health_reports_is_online_while_connected() -> None:
    d = Device("x", 0.0, 0.0, connected=True)
    assert device_state(d, 10**9, Thresholds()) == "online"


def test_fleet_json_is_fleet_and_follows_every_change() -> None:
    clock = Clock()
    reg = FleetRegistry(None, clock=clock)
    conns = {name: Conn() for name in ("a", "b")}
    for name, conn in conns.items():
        reg.seen(name, name, "h:1", conn, "main", 3)

    def same() -> None:
        decoded = json.loads(reg.fleet_json({"collector_id": "c9"}))
        assert decoded.pop("collector_id") == "c9"
        assert decoded == reg.fleet()

    same()
    reg.health("a", health(lag=7), 0, 1)  # a change after the fragment was kept
    same()
    clock.t += 1000  # time alone changes a's state (stale) without a change to the device
    assert json.loads(reg.fleet_json({}))["devices"][0]["state"] == "stale"
    same()
    conns["b"].closed = True
    reg.sweep({})
    reg.landed({("b", "main"): 3})
    same()


def test_iso_matches_datetime() -> None:
    from datetime import UTC, datetime

    from collector.fleet import iso

    for ts in (0.0, 1.9995, 1_700_000_000.123456, 1_764_277_440.999999):
        want = datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        assert iso(ts) == want


def test_cached_fleet_body_shows_a_report_within_its_age_bound() -> None:
    """/api/fleet's body is served from a cache (collector.fleet.CachedBody): a health report
    shows once a build ran, and a body is fresh for max_age_s; past it one build is queued on
    the loop however many ask, and past stale_s nothing is served."""
    clock = Clock()
    reg = FleetRegistry(None, clock=clock)
    reg.seen("a", "a", "h:1", Conn(), "main", 3)
    reg.health("a", health(lag=7), 0, 1)
    mono = Clock()
    cache = CachedBody(lambda: reg.fleet_json({}), max_age_s=2.0, stale_s=60.0, clock=mono)

    def lag() -> tuple[int | None, bool]:
        body, fresh = cache.get()
        return (None if body is None else json.loads(body)["devices"][0]["lag_records"]), fresh

    assert lag() == (None, False)  # nothing built yet: the caller waits for a build
    assert json.loads(cache.refresh())["devices"][0]["lag_records"] == 7
    reg.health("a", health(lag=99), 0, 2)
    mono.t += 1.9
    assert lag() == (7, True)  # within the bound the kept body is served
    mono.t += 0.2
    assert lag() == (7, False)  # past it: served only while a new one is built
    loop = asyncio.new_event_loop()
    try:
        build = cache.build_on(loop)
        assert cache.build_on(loop) is build  # one build however many ask
        loop.run_until_complete(asyncio.sleep(0))
        assert build.done() and json.loads(build.result())["devices"][0]["lag_records"] == 99
        assert lag() == (99, True) and cache.builds == 2
        assert cache.build_on(loop) is not build  # a later request asks for a later build
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    mono.t += 60.01  # past stale_s: nothing served, the caller waits for a build
    assert lag() == (None, False)


def test_ops_port_shows_a_new_report_within_the_bound_without_the_loop(tmp_path: Path) -> None:
    """A running collector: a health report is in /api/fleet's answer within max_age_s, and
    answers come from the cache: 20 requests in a row build the body about once, not 20 times."""
    out: dict[str, Any] = {}

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        server = start_ops_server(collector, 0)
        url = f"http://127.0.0.1:{server.port}/api/fleet"
        try:
            client = MQTTClient("dev-1", port=collector.port)
            await client.connect()
            await client.publish(health_topic("dev-1"), encode_health("dev-1", 0, 1, health(lag=5)), qos=0)
            await collector_until(lambda: collector.stats.health_reports == 1)
            first = json.loads((await asyncio.to_thread(_get, url))[1])
            out["first"] = first["devices"][0]["lag_records"]
            await client.publish(health_topic("dev-1"), encode_health("dev-1", 0, 2, health(lag=77)), qos=0)
            await collector_until(lambda: collector.stats.health_reports == 2)
            loop = asyncio.get_running_loop()
            sent = loop.time()
            for _ in range(100):
                body = json.loads((await asyncio.to_thread(_get, url))[1])
                if body["devices"][0]["lag_records"] == 77:
                    break
                await asyncio.sleep(0.1)
            out["seen_after_s"] = loop.time() - sent
            out["lag"] = body["devices"][0]["lag_records"]
            builds = collector.fleet_api.builds
            started = loop.time()
            for _ in range(20):
                assert (await asyncio.to_thread(_get, url))[0] == 200
            out["builds_per_s"] = (collector.fleet_api.builds - builds) / max(loop.time() - started, 1.0)
            req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip, deflate"})
            with await asyncio.to_thread(urllib.request.urlopen, req, timeout=5) as resp:
                out["gzip"] = (resp.headers.get("Content-Encoding"), resp.read())
            out["plain"] = (await asyncio.to_thread(_get, url))[1]
            await client.disconnect()
        finally:
            server.shutdown()
            await collector.stop()

    collector_run(scenario(), timeout=60)
    assert out["first"] == 5 and out["lag"] == 77
    assert out["seen_after_s"] <= CachedBody(bytes).max_age_s + 1.0  # (the loop here is never late)
    assert out["builds_per_s"] <= 1.0
    # A client that accepts gzip (a browser) gets the same object compressed.
    encoding, packed = out["gzip"]
    assert encoding == "gzip" and json.loads(gzip.decompress(packed))["devices"] == json.loads(out["plain"])["devices"]
