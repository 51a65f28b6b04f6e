"""How `filemq bench broker --scenario ingest|fanout` builds its results from the runs, for
either protocol version (bench.throughput), checked without a broker: the runs are made up,
the figures, ratios, verdicts and text lines derived from them are checked."""

from __future__ import annotations

import pytest

from bench.broker import run_broker_bench, summary_line
from bench.harness import alternate
from bench.harness.alternate import contenders
from bench.harness.brokers import BrokerBenchOptions
from bench.loadspec import LoadResult, PublisherResult, SubscriberResult
from bench.throughput import fill_figures, header, throughput_lines


def _run(acked: int, seconds: float, cpu_seconds: float, *, delivered: int = 0, delivery_seconds: float = 0.0,
         connack_code: int | None = None, refused: int = 0) -> LoadResult:
    """One run's result: ``acked`` PUBACKs over ``seconds`` (and ``delivered`` messages over
    ``delivery_seconds``), the broker busy ``cpu_seconds``."""
    pub = PublisherResult("pub", sent=acked, acked=acked, refused=refused, started=10.0, finished=10.0 + seconds,
                          connack_code=connack_code)
    subs = [SubscriberResult("sub", received=delivered, first=10.0, last=10.0 + delivery_seconds)] if delivered else []
    result = LoadResult([pub], subs)
    result.broker_cpu_seconds, result.broker_user_seconds, result.broker_cpu_pct = cpu_seconds, cpu_seconds / 2, 50.0
    return result


@pytest.mark.parametrize(("mosquitto_seconds", "meets"), [(0.4, True), (0.3, False)])
def test_v311_ingest_sets_filemq_against_mosquitto_and_amqtt(mosquitto_seconds: float, meets: bool) -> None:
    """The best run's rate counts, the lowest CPU per message counts; filemq's rate must be at
    least 0.5 x mosquitto's and 4 x amqtt's."""
    runs = {"filemq": [_run(40_000, 1.0, 0.2), _run(40_000, 0.8, 0.16)],
            "mosquitto": [_run(40_000, 0.5, 0.32), _run(40_000, mosquitto_seconds, 0.4)],
            "amqtt": [_run(40_000, 20.0, 8.0)]}
    out = header(BrokerBenchOptions(), "ingest")
    fill_figures(out, "ingest", 4, runs)
    assert out["filemq_acks_per_s"] == 50_000 and out["filemq_runs_acks_per_s"] == [40_000, 50_000]
    assert out["filemq_acked"] == 40_000
    assert out["filemq_runs_cpu_us_per_msg"] == [5.0, 4.0] and out["filemq_cpu_us_per_msg"] == 4.0
    mosquitto = round(40_000 / mosquitto_seconds)
    assert out["mosquitto_acks_per_s"] == mosquitto
    assert out["ratio_vs_mosquitto"] == round(50_000 / mosquitto, 2) and out["target_vs_mosquitto"] == 0.5
    assert out["ratio_vs_amqtt"] == 25.0 and out["target_vs_amqtt"] == 4.0
    assert out["cpu_ratio_vs_mosquitto"] == 2.0 and out["cpu_ratio_vs_amqtt"] == 50.0
    assert out["meets_target"] is meets
    assert "ratio_v5_vs_v311" not in out and "protocol" not in out and out["publisher_client"] == "loadgen"
    first, second = throughput_lines(out).split("\n")
    assert first.startswith(f"ingest   filemq 50,000 acks/s; vs mosquitto {out['ratio_vs_mosquitto']}x (>= 0.5), "
                            "vs amqtt 25.0x (>= 4)")
    assert first.endswith("[meets target]" if meets else "[MISSES target]")
    assert "mosquitto 8.0 us/msg (ratio 2.0x); amqtt 200.0 us/msg (ratio 50.0x)" in second


def test_v311_fanout_without_baselines_has_no_verdict() -> None:
    runs = {"filemq": [_run(2_000, 0.5, 0.06, delivered=20_000, delivery_seconds=0.8)]}
    out = header(BrokerBenchOptions(baselines=False), "fanout")
    fill_figures(out, "fanout", 4, runs)
    assert out["filemq_deliveries_per_s"] == 25_000 and out["filemq_delivered"] == 20_000
    assert out["filemq_published"] == 2_000 and out["filemq_cpu_us_per_msg"] == 3.0
    assert out["meets_target"] is None and "ratio_vs_mosquitto" not in out
    assert out["subscriber_client"] == "loadgen"
    text = summary_line(out)
    assert text.startswith("fanout   filemq 25,000 deliveries/s; vs mosquitto -x (>= 0.5)  [no baseline]")
    assert "per delivery; loadgen subscribers, in-flight window filemq" in text


@pytest.mark.parametrize(("v5_cpu_seconds", "meets"), [(0.2052, True), (0.24, False)])
def test_v5_is_set_against_filemq_v311_in_the_same_run(v5_cpu_seconds: float, meets: bool) -> None:
    """Issue 13: filemq v5 within 10 % of filemq 3.1.1 (rate >= 0.9 x, CPU per message
    <= 1.1 x); mosquitto v5 for reference, without a target."""
    runs = {"filemq_v311": [_run(40_000, 1.0, 0.2)], "filemq_v5": [_run(38_000, 1.0, v5_cpu_seconds)],
            "mosquitto_v5": [_run(40_000, 0.5, 0.4)]}
    out = header(BrokerBenchOptions(protocol=5, v5_properties=True), "ingest")
    fill_figures(out, "ingest", 5, runs)
    v5_cpu = round(1e6 * v5_cpu_seconds / 38_000, 2)
    assert out["ratio_v5_vs_v311"] == 0.95 and out["target_v5_vs_v311"] == 0.9
    assert out["cpu_v5_over_v311"] == round(v5_cpu / 5.0, 2) and out["target_cpu_v5_over_v311"] == 1.1
    assert out["ratio_vs_mosquitto_v5"] == round(38_000 / 80_000, 2)
    assert out["cpu_ratio_vs_mosquitto_v5"] == round(10.0 / v5_cpu, 2)
    assert "target_vs_mosquitto_v5" not in out
    assert out["meets_target"] is meets
    assert out["protocol"] == 5 and out["v5_properties"] is True and "publisher_client" not in out
    first, second = summary_line(out).split("\n")
    assert first.startswith("ingest v5 filemq v5 38,000 acks/s = 0.95x filemq 3.1.1 40,000 acks/s (>= 0.9); "
                            f"{out['ratio_vs_mosquitto_v5']}x mosquitto v5 80,000 acks/s")
    assert first.endswith(("[meets target]" if meets else "[MISSES target]") + "  (with --v5-properties)")
    assert f"v5/3.1.1 {out['cpu_v5_over_v311']} (<= 1.1)" in second


def test_protocol5_text_output_shows_a_refused_filemq_v5() -> None:
    """A broker answering the level-5 CONNECT with CONNACK 0x01 is reported as refused, and
    the run misses its target; the other contenders' figures stay."""
    runs = {"filemq_v311": [_run(40_000, 1.0, 0.6)], "filemq_v5": [_run(0, 0.0, 0.0, connack_code=1)],
            "mosquitto_v5": [_run(80_000, 1.0, 0.64)]}
    result = header(BrokerBenchOptions(protocol=5), "ingest")
    fill_figures(result, "ingest", 5, runs)
    assert result["filemq_v5_refused"] == "CONNACK 0x01" and result["filemq_v5_connack_code"] == 1
    assert "filemq_v5_acks_per_s" not in result
    assert result["meets_target"] is False
    assert "ratio_v5_vs_v311" not in result
    text = summary_line(result)
    assert "filemq v5 refused (CONNACK 0x01)" in text
    assert "filemq 3.1.1 40,000 acks/s" in text and "mosquitto v5 80,000 acks/s" in text


def test_refused_pubacks_are_reported() -> None:
    """MQTT 5 PUBACKs with a failure reason code (>= 0x80) are counted beside the rate."""
    runs = {"filemq_v311": [_run(1_000, 1.0, 0.01)], "filemq_v5": [_run(900, 1.0, 0.01, refused=100)]}
    out = header(BrokerBenchOptions(protocol=5, baselines=False), "ingest")
    fill_figures(out, "ingest", 5, runs)
    assert out["filemq_v5_refused_pubacks"] == 100 and "filemq_v311_refused_pubacks" not in out


def test_contenders_follow_the_protocol_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(alternate, "mosquitto_available", lambda: True)
    v311 = contenders(BrokerBenchOptions(), amqtt=True)
    assert [(c.name, c.broker, c.protocol, c.runs) for c in v311] == [
        ("filemq", "filemq", 4, None), ("mosquitto", "mosquitto", 4, None), ("amqtt", "amqtt", 4, 1)]
    assert [c.name for c in contenders(BrokerBenchOptions(), amqtt=False)] == ["filemq", "mosquitto"]
    assert [c.name for c in contenders(BrokerBenchOptions(baselines=False), amqtt=True)] == ["filemq"]
    v5 = contenders(BrokerBenchOptions(protocol=5), amqtt=True)
    assert [(c.name, c.broker, c.protocol) for c in v5] == [
        ("filemq_v311", "filemq", 4), ("filemq_v5", "filemq", 5), ("mosquitto_v5", "mosquitto", 5)]
    assert [c.name for c in contenders(BrokerBenchOptions(protocol=5, baselines=False), amqtt=True)] == [
        "filemq_v311", "filemq_v5"]


def test_protocol5_refuses_other_scenarios_before_running_any() -> None:
    with pytest.raises(ValueError, match="ingest and fanout only, not 'latency'"):
        next(run_broker_bench(["ingest", "latency"], BrokerBenchOptions(protocol=5), lambda _m: None))
