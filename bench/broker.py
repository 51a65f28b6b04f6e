"""`filemq bench broker`: the broker's acceptance figures, each against its baseline in the same run.

Every scenario drives real broker processes (``filemq broker`` started through ``cli.py``,
Debian mosquitto and stock amqtt from :mod:`bench.harness.processes`) with the same load generator
(:mod:`bench.loadgen`) and returns one flat dict per scenario (the ``--json`` line):

* ``ingest``  durable QoS 1 PUBACKs/s, filemq ``fsync=always`` vs mosquitto and amqtt, plus the
  generator's own ceiling against a null sink (:mod:`bench.throughput`);
* ``fanout``  deliveries/s to persistent QoS 1 subscribers, filemq vs mosquitto (ditto);
* ``latency`` publish -> subscriber p50/p99/max at a paced rate (mosquitto for reference);
* ``idle``    RSS and CPU of filemq with idle clients and an on-disk backlog (mosquitto's RSS
  with the same clients for reference);
* ``startup`` spawn -> first CONNACK on a big log with a torn tail vs a full scan of the log;
* ``trie``    subscription matching, :class:`filemq.common.topics.TopicTrie` vs brute force;
* ``kill9``   ``kill -9`` under load; every PUBACKed message must reach the persistent
  subscriber after the restart (:func:`run_kill9`, also used by tests/test_broker_kill9.py).

Each dict carries the measured figures, the ratio and a ``meets_target`` flag; nothing here
asserts, so one slow figure does not hide the others.  ``protocol=5`` (``--protocol 5``) runs
ingest and fanout only, with MQTT 5 clients, against filemq's own 3.1.1 figures and mosquitto
with MQTT 5 clients (:mod:`bench.throughput`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.everyday import SensorLoad, run_sensors
from bench.everyday import figures as everyday_figures
from bench.harness.alternate import contenders, start_contender
from bench.harness.brokers import BrokerBenchOptions, Progress, start_filemq, workdir
from bench.harness.processes import (
    LOOPBACK,
    BrokerProcess,
    BrokerStartError,
    free_port,
    mosquitto_available,
    start_mosquitto,
)
from bench.harness.summary import percentile_ms, rnd
from bench.loadgen import RawClient, run_load
from bench.loadspec import PublisherSpec, SubscriberSpec
from bench.throughput import SCENARIOS as THROUGHPUT_SCENARIOS
from bench.throughput import scenario_fanout, scenario_ingest, throughput_lines
from filemq.mqtt.codec import Decoder, ProtocolError, encode, encode_puback
from filemq.mqtt.packets import (
    PROTOCOL_LEVEL_5,
    Connack,
    Connect,
    Puback,
    Publish,
    Suback,
    Subscribe,
)
from segments import Log, LogConfig

LOG_DIR = "log"  # filemq.queue.LOG_DIR: where the broker keeps its log inside the data dir
SCENARIOS = ("ingest", "fanout", "everyday", "latency", "idle", "startup", "trie", "kill9")
BACKLOG_TOPIC = "sensors/x"


# --------------------------------------------------------------------------- scenarios


def scenario_everyday(opts: BrokerBenchOptions, say: Progress) -> dict[str, Any]:
    """A device's everyday load (:mod:`bench.everyday`): ``opts.sensors`` sensor loops, one QoS 1
    PUBLISH in a send of its own each, waiting for its PUBACK, at each of ``opts.everyday_rates``
    msg/s in all; filemq and mosquitto alternately, ``opts.repeat`` runs each, the lowest CPU
    counts. Rate 0 is the idle case (connected, silent): its figure is the share of a core."""
    out: dict[str, Any] = {"bench": "broker", "scenario": "everyday", "sensors": opts.sensors,
                           "payload": opts.sensor_size, "seconds": opts.everyday_seconds, "fsync": opts.fsync,
                           "rates": []}
    say(f"everyday: {opts.sensors} sensors, one {opts.sensor_size}-byte QoS 1 PUBLISH per send (TCP_NODELAY), "
        f"each waiting for its PUBACK; {opts.everyday_seconds:g} s per run at "
        f"{', '.join(f'{r:g}' for r in opts.everyday_rates)} msg/s")
    sides = contenders(opts, amqtt=False)
    with workdir(opts, "everyday") as work:
        for rate in opts.everyday_rates:
            row: dict[str, Any] = {"rate": rate}
            for rep in range(opts.repeat):
                for side in sides:
                    name = side.name
                    with start_contender(side, opts, work / f"{name}-{rate:g}-{rep}") as broker:
                        load = SensorLoad(broker.host, broker.port, opts.sensors, rate, opts.everyday_seconds,
                                          opts.sensor_size, seed=(opts.seed or 0) + rep)
                        fig = everyday_figures(run_sensors(load, broker))
                    row.setdefault(f"{name}_runs", []).append(fig)
                    per_msg = f"{fig['cpu_us_per_msg']} us/msg (user {fig['user_us_per_msg']})" \
                        if "cpu_us_per_msg" in fig else "no messages"
                    say(f"  {rate:>6g} msg/s {name:9}: {fig['acked']:,} acked ({fig['rate']:g}/s), CPU {per_msg}, "
                        f"{fig['cpu_pct']}% of a core, PUBACK p50 {fig['puback_p50_ms']} ms p99 "
                        f"{fig['puback_p99_ms']} ms" + (f"; errors: {fig['errors'][:2]}" if "errors" in fig else ""))
            for name in (side.name for side in sides):
                runs = row[f"{name}_runs"]
                key = "cpu_us_per_msg" if rate > 0 else "cpu_pct"
                best = min(runs, key=lambda f: f.get(key, float("inf")))
                for k in ("cpu_us_per_msg", "user_us_per_msg", "cpu_pct", "puback_p50_ms", "puback_p99_ms"):
                    if k in best:
                        row[f"{name}_{k}"] = best[k]
            if rate > 0 and row.get("filemq_cpu_us_per_msg") and row.get("mosquitto_cpu_us_per_msg"):
                row["cpu_ratio_vs_mosquitto"] = rnd(row["mosquitto_cpu_us_per_msg"] / row["filemq_cpu_us_per_msg"], 2)
                row["meets_target"] = row["cpu_ratio_vs_mosquitto"] >= 1.0
            elif rate == 0 and "mosquitto_cpu_pct" in row:
                row["idle_excess_pct"] = rnd(row["filemq_cpu_pct"] - row["mosquitto_cpu_pct"], 2)
                row["meets_target"] = row["idle_excess_pct"] <= 0.1
            out["rates"].append(row)
    verdicts = [r["meets_target"] for r in out["rates"] if "meets_target" in r]
    out["meets_target"] = all(verdicts) if verdicts else None
    return out


def everyday_summary(result: dict[str, Any]) -> str:
    lines = [f"everyday {result['sensors']} sensors, one PUBLISH per send, {result['payload']}-byte payloads"]
    for row in result["rates"]:
        if row["rate"] > 0:
            lines.append(f"         {row['rate']:>6g} msg/s: filemq {row.get('filemq_cpu_us_per_msg', '-')} us/msg "
                         f"({row.get('filemq_cpu_pct', '-')}% of a core, PUBACK p99 "
                         f"{row.get('filemq_puback_p99_ms', '-')} ms); mosquitto "
                         f"{row.get('mosquitto_cpu_us_per_msg', '-')} us/msg ({row.get('mosquitto_cpu_pct', '-')}%, "
                         f"p99 {row.get('mosquitto_puback_p99_ms', '-')} ms); ratio "
                         f"{row.get('cpu_ratio_vs_mosquitto', '-')}x (>= 1.0)")
        else:
            lines.append(f"         idle: filemq {row.get('filemq_cpu_pct', '-')}% of a core, mosquitto "
                         f"{row.get('mosquitto_cpu_pct', '-')}%; excess {row.get('idle_excess_pct', '-')} (<= 0.1)")
    ok = {True: "meets target", False: "MISSES target", None: "no baseline"}[result.get("meets_target")]
    return "\n".join(lines) + f"  [{ok}]"


def _latency_run(broker: BrokerProcess, opts: BrokerBenchOptions, messages: int) -> dict[str, Any]:
    sub = SubscriberSpec(broker.host, broker.port, "bench-lat-sub", "bench/latency", qos=1, clean_session=True,
                         stamped=True, idle_seconds=5.0, max_seconds=messages / opts.rate + 30)
    pub = PublisherSpec(broker.host, broker.port, "bench-lat-pub", "bench/latency", messages, opts.size,
                        opts.inflight, rate=opts.rate, max_seconds=messages / opts.rate + 20)
    result = run_load([pub], [sub], timeout=messages / opts.rate + 60)
    lat = sorted(x for s in result.subscribers for x in s.latencies_ns)

    def ms(q: float) -> float:  # NaN, not None, when nothing arrived: the progress line formats it
        value = percentile_ms(lat, q, per_ms=1_000_000)
        return float("nan") if value is None else value

    out: dict[str, Any] = {"p50_ms": ms(0.5), "p99_ms": ms(0.99),
           "max_ms": rnd(lat[-1] / 1e6 if lat else float("nan"), 2), "received": len(lat),
           "achieved_rate": round(result.acked / result.ack_seconds) if result.ack_seconds else 0}
    if result.errors:
        out["errors"] = result.errors[:4]
    return out


def scenario_latency(opts: BrokerBenchOptions, say: Progress) -> dict[str, Any]:
    """Publish -> subscriber latency at a paced rate, QoS 1 both ways."""
    messages = opts.messages or int(opts.rate * 5)
    out: dict[str, Any] = {"bench": "broker", "scenario": "latency", "rate": opts.rate, "messages": messages,
                           "fsync": opts.fsync}
    say(f"latency: one publisher paced at {opts.rate:,.0f} msg/s ({messages:,} messages), one subscriber, QoS 1")
    with workdir(opts, "latency") as work:
        for side in contenders(opts, amqtt=False):
            name = side.name
            with start_contender(side, opts, work / name) as broker:
                figures = _latency_run(broker, opts, messages)
            for key, value in figures.items():
                out[f"{name}_{key}"] = value
            say(f"  {name:9}: p50 {figures['p50_ms']:.2f} ms, p99 {figures['p99_ms']:.2f} ms, "
                f"max {figures['max_ms']:.2f} ms ({figures['received']:,} received, "
                f"{figures['achieved_rate']:,} msg/s acked)")
    out["target_p99_ms"] = 20.0
    out["meets_target"] = out["filemq_p99_ms"] <= 20.0 and out["filemq_received"] >= messages
    return out


# --------------------------------------------------------------------------- backlog (idle, startup)


def register_offline_subscriber(data_dir: Path, client_id: str, topic_filter: str, say: Progress) -> None:
    """Create a persistent session subscribed to ``topic_filter`` through a real broker run, then
    leave it offline: whatever is appended to the log afterwards is its backlog."""
    with start_filemq(data_dir) as broker:
        client = RawClient.connect(broker.host, broker.port, client_id, clean_session=False)
        codes, _ = client.subscribe([(topic_filter, 1)])
        client.close()
        if codes[0] == 0x80:
            raise RuntimeError(f"filemq refused the subscription {topic_filter!r} for {client_id!r}")
        code = broker.stop()
    if code != 0:
        raise RuntimeError(f"filemq broker did not shut down cleanly (exit {code}); see {broker.log_path}")
    say(f"  persistent session {client_id!r} subscribed to {topic_filter!r}, now offline")


def append_backlog(log_dir: Path, size_bytes: int, payload_size: int, say: Progress) -> int:
    """Append records to the log at ``log_dir`` directly until it holds ``size_bytes`` and its
    active segment is at least half full (so a torn tail has something to cut); returns records."""
    config = LogConfig(fsync="never")
    lg = Log.open(log_dir, config)
    try:
        payload = bytes(payload_size)
        append = lg.append
        started = time.monotonic()
        next_report = 0
        half_segment = min(size_bytes, config.segment_bytes) // 2
        while lg.size_bytes() < size_bytes or lg.segments()[-1].size < half_segment:
            for _ in range(20_000):
                append(BACKLOG_TOPIC, payload, qos=1)
            lg.flush()
            if lg.size_bytes() >= next_report:
                say(f"  backlog {lg.size_bytes() / 2**20:,.0f} MiB")
                next_report += 256 << 20
        lg.sync()
        say(f"  backlog of {lg.next_offset:,} records ({lg.size_bytes() / 2**20:,.0f} MiB) "
            f"written in {time.monotonic() - started:.1f} s")
        return lg.next_offset
    finally:
        lg.close()


def mark_retained_snapshot_current(data_dir: Path, next_offset: int) -> None:
    """Advance the retained-message snapshot over the directly written (non-retained) records.

    A broker that had written this log itself would have snapshotted every few seconds; without
    this the first start would replay the whole backlog looking for retained messages, which
    measures the bench's shortcut, not the broker.  Only valid because the backlog holds no
    retained records and the snapshot (from :func:`register_offline_subscriber`) is empty.
    """
    from filemq.queue.retained import RetainedStore, decode_snapshot

    store = RetainedStore(data_dir)
    messages, _ = decode_snapshot(store.path.read_bytes(), str(store.path))
    if messages:
        raise RuntimeError(f"{store.path} holds retained messages; refusing to rewrite it")
    store.advance(next_offset)
    store.snapshot()


def backlog_data_dir(opts: BrokerBenchOptions, root: Path, say: Progress) -> Path:
    """A filemq data dir with an offline persistent subscriber behind ``backlog_mb`` of records.

    Built once per run and shared by ``idle`` and ``startup`` (building 1 GB takes a while).
    """
    if opts.shared_backlog_dir is not None and opts.shared_backlog_dir.exists():
        return opts.shared_backlog_dir
    data = root / "backlog-data"
    say(f"building a {opts.backlog_mb:,} MiB backlog in {data}")
    register_offline_subscriber(data, "bench-offline", "sensors/#", say)
    records = append_backlog(data / LOG_DIR, opts.backlog_mb << 20, opts.size, say)
    mark_retained_snapshot_current(data, records)
    opts.shared_backlog_dir = data
    return data


def _connect_idle(broker: BrokerProcess, n: int, prefix: str) -> list[RawClient]:
    return [RawClient.connect(broker.host, broker.port, f"{prefix}-{i}", keepalive=600) for i in range(n)]


def scenario_idle(opts: BrokerBenchOptions, say: Progress, root: Path | None = None) -> dict[str, Any]:
    """RSS and idle CPU of filemq with idle clients and an offline subscriber's on-disk backlog."""
    out: dict[str, Any] = {"bench": "broker", "scenario": "idle", "clients": opts.idle_clients,
                           "backlog_mb": opts.backlog_mb, "idle_seconds": opts.idle_seconds}
    with contextlib.ExitStack() as stack:
        work = root or stack.enter_context(workdir(opts, "idle"))
        data = backlog_data_dir(opts, work, say)
        say(f"idle: filemq with {opts.idle_clients:,} idle clients and the backlog")
        with start_filemq(data, fsync=opts.fsync) as broker:
            out["filemq_ready_seconds"] = rnd(broker.ready_seconds, 3)
            clients = _connect_idle(broker, opts.idle_clients, "bench-idle")
            try:
                time.sleep(2.0)  # let connection set-up work settle before measuring
                cpu0, t0 = broker.cpu_seconds(), time.monotonic()
                rss = broker.rss_bytes()
                time.sleep(opts.idle_seconds)
                cpu1, t1 = broker.cpu_seconds(), time.monotonic()
                rss = max(rss, broker.rss_bytes())
            finally:
                for c in clients:
                    c.close()
        cpu_pct = 100.0 * (cpu1 - cpu0) / (t1 - t0)
        out.update(filemq_rss_mb=rnd(rss / 2**20), filemq_idle_cpu_pct=rnd(cpu_pct, 2))
        say(f"  filemq   : RSS {rss / 2**20:.1f} MiB, idle CPU {cpu_pct:.2f}% over {t1 - t0:.1f} s")
        if opts.baselines and mosquitto_available():
            with start_mosquitto(work / "mosquitto-idle") as mosq:
                clients = _connect_idle(mosq, opts.idle_clients, "bench-idle")
                try:
                    time.sleep(1.0)
                    mrss = mosq.rss_bytes()
                finally:
                    for c in clients:
                        c.close()
            out["mosquitto_rss_mb"] = rnd(mrss / 2**20)
            say(f"  mosquitto: RSS {mrss / 2**20:.1f} MiB with the same clients (no backlog; reference)")
    out.update(target_rss_mb=60, target_idle_cpu_pct=1.0,
               meets_target=out["filemq_rss_mb"] <= 60 and out["filemq_idle_cpu_pct"] < 1.0)
    return out


def scenario_startup(opts: BrokerBenchOptions, say: Progress, root: Path | None = None) -> dict[str, Any]:
    """Spawn -> first CONNACK on the backlog log with its tail cut at a random byte."""
    out: dict[str, Any] = {"bench": "broker", "scenario": "startup", "backlog_mb": opts.backlog_mb}
    with contextlib.ExitStack() as stack:
        work = root or stack.enter_context(workdir(opts, "startup"))
        data = backlog_data_dir(opts, work, say)
        tail = sorted((data / LOG_DIR).glob("*.log"))[-1]
        size = tail.stat().st_size
        cut = random.Random(opts.seed).randrange(1, size) if size > 1 else 0
        with open(tail, "r+b") as f:
            f.truncate(cut)
        say(f"startup: cut {tail.name} from {size:,} to {cut:,} bytes; spawning filemq broker")
        with start_filemq(data, fsync=opts.fsync) as broker:
            ready = broker.ready_seconds
        line = next((ln for ln in reversed(broker.log_path.read_text(errors="replace").splitlines())
                     if "listening on" in ln), "")
        say(f"  spawn -> first CONNACK: {ready:.3f} s ({line.strip()})")
        say("  full CRC scan of the log (comparison)")
        started = time.monotonic()
        lg = Log.open(data / LOG_DIR, LogConfig(fsync="never"))
        try:
            scanned = sum(1 for item in lg.scan() if item.crc_ok)
            log_bytes = lg.size_bytes()
        finally:
            lg.close()
        scan_s = time.monotonic() - started
        say(f"  full scan: {scanned:,} records in {scan_s:.2f} s")
    out.update(log_mb=rnd(log_bytes / 2**20), cut_bytes=size - cut, filemq_ready_seconds=rnd(ready, 3),
               full_scan_seconds=rnd(scan_s, 2), full_scan_records=scanned,
               full_scan_over_ready=rnd(scan_s / ready, 1) if ready else None,
               target_ready_seconds=1.0, meets_target=ready <= 1.0)
    return out


def trie_filters(n: int, rng: random.Random) -> list[str]:
    """``n`` distinct filters over a site/device/metric tree: ~60% exact, ~25% '+', ~15% '#'."""
    metrics = ["temp", "hum", "volt", "amps", "state", "rssi", "fw", "cmd"]
    out: set[str] = set()
    while len(out) < n:
        site, dev, metric = rng.randrange(100), rng.randrange(200), rng.choice(metrics)
        kind = rng.random()
        if kind < 0.6:
            f = f"site/{site}/dev/{dev}/{metric}"
        elif kind < 0.85:
            f = rng.choice([f"site/+/dev/{dev}/{metric}", f"site/{site}/dev/+/{metric}",
                            f"site/{site}/dev/{dev}/+", f"+/{site}/dev/+/{metric}"])
        else:
            f = rng.choice([f"site/{site}/#", f"site/{site}/dev/{dev}/#", f"site/+/dev/{dev}/#"])
        out.add(f)
    return sorted(out)


def scenario_trie(opts: BrokerBenchOptions, say: Progress, n_filters: int = 10_000) -> dict[str, Any]:
    """Matching topics against ``n_filters`` subscriptions: TopicTrie vs topic_matches over all."""
    from filemq.common.topics import TopicTrie, topic_matches

    rng = random.Random(opts.seed if opts.seed is not None else 7)
    filters = trie_filters(n_filters, rng)
    trie: TopicTrie[int] = TopicTrie()
    for i, f in enumerate(filters):
        trie.add(f, i)
    metrics = ["temp", "hum", "volt", "amps", "state", "rssi", "fw", "cmd"]
    topics = [f"site/{rng.randrange(100)}/dev/{rng.randrange(200)}/{rng.choice(metrics)}" for _ in range(20_000)]
    say(f"trie: {len(filters):,} filters, matching {len(topics):,} topics (brute force on the first 300)")
    started = time.perf_counter()
    trie_hits = [trie.match(t) for t in topics]
    trie_s = (time.perf_counter() - started) / len(topics)
    brute_topics = topics[:300]
    started = time.perf_counter()
    brute_hits = [{i for i, f in enumerate(filters) if topic_matches(f, t)} for t in brute_topics]
    brute_s = (time.perf_counter() - started) / len(brute_topics)
    if brute_hits != trie_hits[: len(brute_topics)]:
        raise AssertionError("TopicTrie and brute-force topic_matches disagree")
    mean_matches = sum(len(h) for h in trie_hits) / len(trie_hits)
    say(f"  trie {trie_s * 1e6:,.1f} us/topic, brute force {brute_s * 1e6:,.0f} us/topic "
        f"({brute_s / trie_s:,.0f}x), {mean_matches:.1f} matches/topic")
    return {"bench": "broker", "scenario": "trie", "filters": len(filters), "topics": len(topics),
            "trie_us_per_topic": rnd(trie_s * 1e6, 2), "brute_us_per_topic": rnd(brute_s * 1e6, 1),
            "ratio_trie_vs_brute": rnd(brute_s / trie_s, 1), "mean_matches": rnd(mean_matches, 2),
            "trie_matches_per_s": round(1 / trie_s)}


# --------------------------------------------------------------------------- kill -9


@dataclass
class Kill9Result:
    """Outcome of :func:`run_kill9`: ``lost`` acknowledged messages never delivered (must be 0)."""

    broker: str
    rounds: int
    acked: int = 0
    delivered: int = 0  # distinct messages the subscriber received
    duplicates: int = 0  # deliveries beyond the first of a message
    lost: int = 0
    delivered_unacked: int = 0  # stored but the PUBACK died with the broker: allowed
    sessions_lost: int = 0  # reconnects that found no session (CONNACK session present = 0)
    seconds: float = 0.0
    lost_examples: list[str] = field(default_factory=list)
    final_exit_code: int | None = None
    acked_per_round: list[int] = field(default_factory=list)
    duplicates_per_round: list[int] = field(default_factory=list)  # redeliveries after each restart

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(bench="broker", scenario="kill9", seconds=rnd(self.seconds, 1),
                 rounds_without_acks=sum(1 for n in self.acked_per_round if n == 0),
                 duplicates_pct=rnd(100.0 * self.duplicates / self.acked, 2) if self.acked else 0.0,
                 duplicates_max_round=max(self.duplicates_per_round, default=0))
        del d["acked_per_round"]
        return d


_KEY = struct.Struct(">IHQ")  # round, publisher, sequence: the message's identity in its payload


def _describe_key(key: bytes) -> str:
    round_no, pub_no, seq = _KEY.unpack(key)
    return f"round {round_no} publisher {pub_no} seq {seq}"


_KILL9_SETTLE_S = 0.25  # a restart's drain ends this long after the last delivery and the CONNACK
_KILL9_FIRST_ACK_S = 10.0  # a round's load span starts at its first PUBACK, waited for this long at most


class _Ledger:
    """Which message keys were PUBACKed and which delivered; ``unseen`` (acked, not yet
    delivered) is kept up to date per event, so checking a drain costs O(1), not O(acked)."""

    def __init__(self) -> None:
        self.acked: set[bytes] = set()
        self.seen: dict[bytes, int] = {}
        self.unseen: set[bytes] = set()
        self.duplicates = 0
        self.last_delivery = time.monotonic()

    def ack(self, key: bytes) -> None:
        self.acked.add(key)
        if key not in self.seen:
            self.unseen.add(key)

    def deliver(self, key: bytes) -> None:
        count = self.seen.get(key, 0)
        if count:
            self.duplicates += 1
        else:
            self.unseen.discard(key)
        self.seen[key] = count + 1
        self.last_delivery = time.monotonic()


class _Kill9Subscriber:
    """The persistent subscriber: reconnects for ever, acks everything, records deliveries."""

    def __init__(self, host: str, port_of: Callable[[], int], client_id: str, topic_filter: str,
                 ledger: _Ledger) -> None:
        self.host = host
        self.port_of = port_of
        self.client_id = client_id
        self.filter = topic_filter
        self.ledger = ledger
        self.sessions_lost = 0
        self.connects = 0
        self.connack_at = 0.0  # time.monotonic() of the last CONNACK
        self.connected = asyncio.Event()
        self._stop = False

    async def run(self) -> None:
        while not self._stop:
            # A dead broker is the point of the test: reconnect until told to stop.
            with contextlib.suppress(OSError, ProtocolError, asyncio.IncompleteReadError, ConnectionError):
                await self._session()
            self.connected.clear()
            if not self._stop:
                await asyncio.sleep(0.02)

    def stop(self) -> None:
        self._stop = True

    async def _session(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port_of())
        try:
            writer.write(encode(Connect(client_id=self.client_id, clean_session=False, keepalive=600)))
            decoder = Decoder(max_packet_size=1 << 24, server=False)
            first = self.connects == 0
            deliver = self.ledger.deliver
            while not self._stop:
                data = await reader.read(1 << 16)
                if not data:
                    return
                decoder.feed(data)
                acks = []
                for p in decoder.packets():
                    if isinstance(p, Connack):
                        if p.return_code:
                            raise ConnectionError(f"CONNECT refused ({p.return_code})")
                        self.connects += 1
                        self.connack_at = time.monotonic()
                        if first or not p.session_present:
                            if not first:
                                self.sessions_lost += 1
                            writer.write(encode(Subscribe(1, [(self.filter, 1)])))
                        else:
                            self.connected.set()
                    elif isinstance(p, Suback):
                        self.connected.set()
                    elif isinstance(p, Publish):
                        deliver(p.payload[: _KEY.size])
                        if p.packet_id is not None:
                            acks.append(encode_puback(p.packet_id))
                if acks:
                    writer.write(b"".join(acks))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _kill9_publisher(host: str, port: int, round_no: int, pub_no: int, inflight: int, size: int,
                           ledger: _Ledger) -> None:
    """Publish QoS 1 flat out until the connection dies; record every PUBACKed key in ``ledger``."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return
    try:
        writer.write(encode(Connect(client_id=f"kill9-pub-{pub_no}", clean_session=True, keepalive=600)))
        decoder = Decoder(max_packet_size=1 << 24, server=False)
        topic = f"kill9/{pub_no}"
        filler = bytes(max(size - _KEY.size, 0))
        outstanding: dict[int, bytes] = {}
        seq = 0
        connected = False
        while True:
            if connected and len(outstanding) < inflight:
                chunks = []
                while len(outstanding) < inflight:
                    key = _KEY.pack(round_no, pub_no, seq)
                    pid = seq % 65535 + 1
                    outstanding[pid] = key
                    chunks.append(encode(Publish(topic, key + filler, 1, packet_id=pid)))
                    seq += 1
                writer.write(b"".join(chunks))
            data = await reader.read(1 << 16)
            if not data:
                return
            decoder.feed(data)
            for p in decoder.packets():
                if isinstance(p, Connack):
                    if p.return_code:
                        return
                    connected = True
                elif isinstance(p, Puback):
                    key = outstanding.pop(p.packet_id, b"")
                    if key:
                        ledger.ack(key)
    except (OSError, ProtocolError, ConnectionError):
        return
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def run_kill9(rounds: int, data_dir: Path, say: Progress, *, broker: str = "filemq", publishers: int = 4,
              inflight: int = 100, size: int = 100, load_seconds: tuple[float, float] = (0.05, 0.5),
              quiet_seconds: float = 5.0, seed: int | None = None, fsync: str = "always") -> Kill9Result:
    """``rounds`` x (load, kill -9 at a random moment -- ``load_seconds`` after the round's
    first PUBACK -- restart on the same data dir, drain).

    A persistent QoS 1 subscriber (clean session 0) is registered before the first load and
    stays connected, reconnecting after each restart.  After each restart the round waits
    until every PUBACKed message so far was delivered, or until ``quiet_seconds`` pass
    without a new delivery (then the missing ones count as lost).  ``broker`` is "filemq"
    or "mosquitto" (which loses messages on kill -9: a demonstration, not a baseline).
    """
    return asyncio.run(_kill9(rounds, data_dir, say, broker, publishers, inflight, size, load_seconds,
                              quiet_seconds, random.Random(seed), fsync))


async def _kill9(rounds: int, data_dir: Path, say: Progress, broker_name: str, publishers: int, inflight: int,
                 size: int, load_seconds: tuple[float, float], quiet_seconds: float, rng: random.Random,
                 fsync: str) -> Kill9Result:
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    result = Kill9Result(broker_name, rounds)

    def start() -> BrokerProcess:
        if broker_name == "filemq":
            return start_filemq(data_dir / "data", port, fsync=fsync, log_path=data_dir / "broker.log")
        if broker_name == "mosquitto":
            return start_mosquitto(data_dir, port)
        raise ValueError(f"kill9 runs against filemq or mosquitto, not {broker_name!r}")

    started = time.monotonic()
    proc = await asyncio.to_thread(start)
    ledger = _Ledger()
    acked = ledger.acked
    sub = _Kill9Subscriber(LOOPBACK, lambda: port, "kill9-subscriber", "kill9/#", ledger)
    sub_task = asyncio.create_task(sub.run())
    try:
        await asyncio.wait_for(sub.connected.wait(), 30)
        for round_no in range(rounds):
            before = len(acked)
            dups_before = ledger.duplicates
            tasks = [asyncio.create_task(_kill9_publisher(LOOPBACK, port, round_no, i, inflight, size, ledger))
                     for i in range(publishers)]
            t_load = time.monotonic()
            # The random load span starts at the round's first PUBACK (waited for up to
            # _KILL9_FIRST_ACK_S): on a loaded machine the publishers' connects alone can take
            # longer than the span, and a kill before any PUBACK tests nothing acknowledged.
            first_ack_by = t_load + _KILL9_FIRST_ACK_S
            while len(acked) == before and time.monotonic() < first_ack_by:
                await asyncio.sleep(0.005)
            await asyncio.sleep(rng.uniform(*load_seconds))
            connects_before = sub.connects
            proc.kill9()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            result.acked_per_round.append(len(acked) - before)
            t_restart = time.monotonic()
            proc = await asyncio.to_thread(start)
            t_drain = time.monotonic()
            # Drain: everything acked so far must arrive; stop waiting after a quiet spell.
            ledger.last_delivery = time.monotonic()
            while time.monotonic() - ledger.last_delivery <= quiet_seconds:
                # Done when every acked message arrived, the subscriber is back on the new broker
                # and its re-delivered window came (no delivery for _KILL9_SETTLE_S): a round whose
                # acked messages had all arrived before the kill would otherwise end at once and
                # count its re-deliveries in the next round (seen in CI: 0, then 128 = 64 + 64).
                if (not ledger.unseen and sub.connects > connects_before
                        and time.monotonic() - max(ledger.last_delivery, sub.connack_at) >= _KILL9_SETTLE_S):
                    break
                await asyncio.sleep(0.01)
            missing = len(ledger.unseen)
            result.duplicates_per_round.append(ledger.duplicates - dups_before)
            say(f"  {broker_name} round {round_no + 1}/{rounds}: {len(acked):,} acked so far, "
                f"{len(ledger.seen):,} delivered, {ledger.duplicates:,} duplicates, {missing:,} missing "
                f"(load {t_restart - t_load:.2f} s, restart {t_drain - t_restart:.2f} s, "
                f"drain {time.monotonic() - t_drain:.2f} s)")
    finally:
        sub.stop()
        sub_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sub_task
        result.final_exit_code = await asyncio.to_thread(proc.stop)
    lost = sorted(ledger.unseen)
    result.acked = len(acked)
    result.delivered = len(ledger.seen)
    result.duplicates = ledger.duplicates
    result.lost = len(lost)
    result.delivered_unacked = sum(1 for k in ledger.seen if k not in acked)
    result.sessions_lost = sub.sessions_lost
    result.seconds = time.monotonic() - started
    result.lost_examples = [_describe_key(k) for k in lost[:5]]
    return result


def scenario_kill9(opts: BrokerBenchOptions, say: Progress) -> dict[str, Any]:
    """kill -9 rounds against filemq (must lose nothing acked); mosquitto for a few rounds as a demonstration."""
    say(f"kill9: {opts.kill_rounds} rounds, {opts.publishers} QoS 1 publishers, a persistent subscriber")
    with workdir(opts, "kill9") as work:
        res = run_kill9(opts.kill_rounds, work / "filemq", say, publishers=opts.publishers, inflight=opts.inflight,
                        size=opts.size, seed=opts.seed, fsync=opts.fsync)
        out = res.as_dict()
        say(f"  filemq: {res.acked:,} acked, {res.delivered:,} delivered, {res.duplicates:,} duplicates, "
            f"{res.lost} lost in {res.rounds} rounds ({res.seconds:.0f} s)")
        if opts.baselines and mosquitto_available():
            demo_rounds = min(opts.kill_rounds, 10)
            try:
                mres = run_kill9(demo_rounds, work / "mosquitto", say, broker="mosquitto", publishers=opts.publishers,
                                 inflight=opts.inflight, size=opts.size, seed=opts.seed, quiet_seconds=1.0)
            except BrokerStartError as exc:
                say(f"  mosquitto demonstration skipped: {exc}")
            else:
                out.update(mosquitto_rounds=mres.rounds, mosquitto_acked=mres.acked, mosquitto_lost=mres.lost,
                           mosquitto_sessions_lost=mres.sessions_lost)
                say(f"  mosquitto (reference): {mres.acked:,} acked, {mres.lost:,} lost, "
                    f"{mres.sessions_lost} sessions lost in {mres.rounds} rounds")
    out["meets_target"] = res.lost == 0 and res.acked > 0
    return out


# --------------------------------------------------------------------------- driver

def run_broker_bench(scenarios: list[str], opts: BrokerBenchOptions, say: Progress) -> Iterator[dict[str, Any]]:
    """Run ``scenarios`` in order (``all`` = every one); yields one result dict per scenario.

    With ``opts.protocol`` 5 only ingest and fanout exist (``all`` = both), with MQTT 5 clients
    (:mod:`bench.throughput`)."""
    if opts.protocol == PROTOCOL_LEVEL_5:
        scenarios = list(THROUGHPUT_SCENARIOS) if "all" in scenarios else scenarios
        other = [name for name in scenarios if name not in THROUGHPUT_SCENARIOS]
        if other:
            raise ValueError(f"--protocol 5 runs {' and '.join(THROUGHPUT_SCENARIOS)} only, not {other[0]!r}")
    names = list(SCENARIOS) if "all" in scenarios else scenarios
    with contextlib.ExitStack() as stack:
        shared: Path | None = None
        if "idle" in names and "startup" in names:
            # One backlog for both: idle first (it needs the intact log), then startup cuts its tail.
            shared = stack.enter_context(workdir(opts, "backlog"))
        for name in names:
            if name == "ingest":
                yield scenario_ingest(opts, say)
            elif name == "fanout":
                yield scenario_fanout(opts, say)
            elif name == "everyday":
                yield scenario_everyday(opts, say)
            elif name == "latency":
                yield scenario_latency(opts, say)
            elif name == "idle":
                yield scenario_idle(opts, say, shared)
            elif name == "startup":
                yield scenario_startup(opts, say, shared)
            elif name == "trie":
                yield scenario_trie(opts, say)
            elif name == "kill9":
                yield scenario_kill9(opts, say)
            else:
                raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)} or all")


def summary_line(result: dict[str, Any]) -> str:
    """One human line per scenario result (what ``filemq bench broker`` prints without --json)."""
    s = result["scenario"]
    if s in THROUGHPUT_SCENARIOS:
        return throughput_lines(result)
    ok = {True: "meets target", False: "MISSES target", None: "no baseline"}[result.get("meets_target")]
    if s == "everyday":
        return everyday_summary(result)
    if s == "latency":
        ref = (f"; mosquitto p99 {result['mosquitto_p99_ms']} ms" if "mosquitto_p99_ms" in result else "")
        return (f"latency  filemq p50 {result['filemq_p50_ms']} ms, p99 {result['filemq_p99_ms']} ms, "
                f"max {result['filemq_max_ms']} ms (p99 <= 20){ref}  [{ok}]")
    if s == "idle":
        ref = f"; mosquitto RSS {result['mosquitto_rss_mb']} MiB" if "mosquitto_rss_mb" in result else ""
        return (f"idle     filemq RSS {result['filemq_rss_mb']} MiB (<= 60), idle CPU "
                f"{result['filemq_idle_cpu_pct']}% (< 1) with {result['clients']:,} clients and "
                f"{result['backlog_mb']:,} MiB backlog{ref}  [{ok}]")
    if s == "startup":
        return (f"startup  first CONNACK {result['filemq_ready_seconds']} s after spawn (<= 1) on a "
                f"{result['log_mb']:,} MiB log with a torn tail; full scan {result['full_scan_seconds']} s  [{ok}]")
    if s == "trie":
        return (f"trie     {result['filters']:,} filters: trie {result['trie_us_per_topic']} us/topic vs brute "
                f"force {result['brute_us_per_topic']} us/topic = {result['ratio_trie_vs_brute']:,}x")
    if s == "kill9":
        ref = (f"; mosquitto lost {result['mosquitto_lost']:,} of {result['mosquitto_acked']:,} acked in "
               f"{result['mosquitto_rounds']} rounds" if "mosquitto_lost" in result else "")
        return (f"kill9    {result['rounds']} rounds: {result['acked']:,} acked, {result['delivered']:,} delivered, "
                f"{result['duplicates']:,} duplicates, {result['lost']} lost{ref}  [{ok}]")
    return str(result)

