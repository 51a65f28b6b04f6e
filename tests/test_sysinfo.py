"""$SYS statistics: counters, fsync percentiles and the bounded hot-topics tracker."""

from __future__ import annotations

import json
import math
import random

import pytest

from filemq.broker.sysinfo import BrokerStats, HotTopics, LatencyRing


def as_dict(stats: BrokerStats, now: float) -> dict[str, str]:
    return {topic: payload.decode() for topic, payload in stats.sys_messages(now)}


def test_counters_appear_under_mosquitto_names() -> None:
    s = BrokerStats(started_at=1000.0)
    for _ in range(3):
        s.client_connected()
    s.client_disconnected()
    s.client_connected()
    s.client_disconnected()
    s.sessions_offline = 4
    for i in range(7):
        s.publish_received(f"t/{i % 2}", 1001.0)
    s.publish_denied()
    s.publish_sent(5)
    s.publish_sent()
    s.received_bytes(700)
    s.sent_bytes(450)
    s.store_bytes = 123456
    s.set_backlog("fwd", 42)
    s.set_backlog("g1", 0)
    s.remove_backlog("g1")
    d = as_dict(s, 1123.9)
    assert d["$SYS/broker/uptime"] == "123 seconds"
    assert d["$SYS/broker/clients/connected"] == "2"
    assert d["$SYS/broker/clients/maximum"] == "3"
    assert d["$SYS/broker/clients/disconnected"] == "4"
    assert d["$SYS/broker/clients/total"] == "6"
    assert d["$SYS/broker/connections/total"] == "4"
    assert d["$SYS/broker/messages/received"] == "7"
    assert d["$SYS/broker/messages/sent"] == "6"
    assert d["$SYS/broker/publish/messages/dropped"] == "1"
    assert d["$SYS/broker/bytes/received"] == "700"
    assert d["$SYS/broker/bytes/sent"] == "450"
    assert d["$SYS/broker/store/bytes"] == "123456"
    assert d["$SYS/broker/backlog/fwd"] == "42"
    assert "$SYS/broker/backlog/g1" not in d
    assert all(t.startswith("$SYS/broker/") for t in d)


def test_disconnect_never_goes_negative() -> None:
    s = BrokerStats(started_at=0.0)
    s.client_disconnected()
    assert as_dict(s, 0.0)["$SYS/broker/clients/connected"] == "0"


def test_fsync_percentiles_only_after_samples() -> None:
    s = BrokerStats(started_at=0.0)
    assert "$SYS/broker/fsync/latency_ms/p50" not in as_dict(s, 1.0)
    samples = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    random.Random(7).shuffle(samples)
    for x in samples:
        s.fsync_done(x)
    d = as_dict(s, 1.0)
    assert d["$SYS/broker/fsync/latency_ms/p50"] == "50.000"
    assert d["$SYS/broker/fsync/latency_ms/p99"] == "99.000"


def test_latency_ring_keeps_only_the_last_samples() -> None:
    ring = LatencyRing(size=10)
    assert ring.percentile(50) is None
    for x in range(100):
        ring.add(float(x))
    assert len(ring) == 10
    assert ring.percentile(100) == 99.0 and ring.percentile(1) == 90.0
    assert ring.percentile(50) == 94.0
    with pytest.raises(ValueError):
        LatencyRing(0)


def test_hot_topic_rate_converges_to_the_publish_rate() -> None:
    hot = HotTopics(window_s=10.0)
    t = 0.0
    for _ in range(2000):  # 20 msg/s on "fast", 2 msg/s on "slow", for 100 s
        t += 0.05
        hot.record("fast", t)
        if round(t / 0.05) % 10 == 0:
            hot.record("slow", t)
    (fast, fast_rate), (slow, slow_rate) = hot.top(2, t)
    assert (fast, slow) == ("fast", "slow")
    assert fast_rate == pytest.approx(20.0, rel=0.05)
    assert slow_rate == pytest.approx(2.0, rel=0.1)


def test_hot_topics_decay_when_a_topic_goes_quiet() -> None:
    hot = HotTopics(window_s=5.0)
    for i in range(100):
        hot.record("burst", i * 0.01)
    before = hot.top(1, 1.0)[0][1]
    after = hot.top(1, 11.0)[0][1]
    assert after == pytest.approx(before * math.exp(-10.0 / 5.0))


def test_hot_topics_memory_is_bounded_and_the_hot_one_survives() -> None:
    hot = HotTopics(window_s=30.0, capacity=64)
    rng = random.Random(1)
    t = 0.0
    for i in range(20_000):
        t += 0.001
        if i % 4 == 0:
            hot.record("hot/topic", t)
        else:
            hot.record(f"noise/{rng.randrange(100_000)}", t)
        assert len(hot) <= 64
    top = hot.top(3, t)
    assert top[0][0] == "hot/topic"
    assert top[0][1] > 10 * top[1][1]


def test_sys_hot_topics_is_a_json_list() -> None:
    s = BrokerStats(started_at=0.0, hot_window_s=10.0, hot_top=2)
    for i in range(30):
        s.publish_received("a", i * 0.1)
        if i % 3 == 0:
            s.publish_received("b", i * 0.1)
        if i % 10 == 0:
            s.publish_received("c", i * 0.1)
    hot = json.loads(as_dict(s, 3.0)["$SYS/broker/topics/hot"])
    assert [h["topic"] for h in hot] == ["a", "b"]
    assert hot[0]["rate"] > hot[1]["rate"] > 0
