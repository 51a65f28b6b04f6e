"""`filemq bench broker --protocol 5`: ingest and fanout with MQTT 5 clients (issue 13 item 9).

Each scenario runs the load of the 3.1.1 scenario of the same name (:mod:`bench.broker`:
same publishers, in-flight window, payload size, subscribers) against three contenders,
alternating them ``--repeat`` times on fresh data directories; each one's best run counts:

* ``filemq_v5``     ``filemq broker`` with MQTT 5 clients;
* ``mosquitto_v5``  Debian mosquitto 2.0 with MQTT 5 clients (unless ``--no-baselines``);
* ``filemq_v311``   ``filemq broker`` with 3.1.1 clients, the reference the goal is set against.

The MQTT 5 clients are :mod:`bench.loadgen`'s in ``protocol=5``: level-5 CONNECT (persistent
fanout subscribers send a session expiry interval), PUBLISH with a property section, which is
empty unless ``--v5-properties`` adds a content type and one user property to every message
(:data:`V5_PROPERTIES`), and SUBSCRIBE with the options byte.

Goal (issue 13): filemq's MQTT 5 figures within 10 % of its own 3.1.1 figures in the same run,
``ratio_v5_vs_v311`` (rate) >= 0.9 and ``cpu_v5_over_v311`` (broker CPU per message) <= 1.1;
both make ``meets_target``.  A broker that refuses the level-5 CONNECT is reported as refused
(``filemq_v5_refused`` = "CONNACK 0x01", ``meets_target`` False), not as a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.harness.alternate import Contender, alternate
from bench.harness.brokers import BrokerBenchOptions, Progress, windows, windows_text, workdir
from bench.harness.cpu import cpu_detail, cpu_figures
from bench.harness.loads import fanout_run, ingest_run
from bench.harness.processes import BrokerProcess, mosquitto_available
from bench.harness.summary import rnd
from bench.loadgen import run_null_sink
from bench.loadspec import LoadResult
from filemq.mqtt.packets import PROTOCOL_LEVEL, PROTOCOL_LEVEL_5, Properties

SCENARIOS5 = ("ingest", "fanout")
# --v5-properties: what a typical MQTT 5 device adds to a message (3.3.2.3.9, 3.3.2.3.7).
V5_PROPERTIES = Properties(content_type="application/octet-stream", user_properties=[("source", "bench")])
TARGET_V5_VS_V311 = 0.9  # rate: filemq v5 / filemq 3.1.1
TARGET_CPU_V5_OVER_V311 = 1.1  # broker CPU per message: filemq v5 / filemq 3.1.1
LABELS = {"filemq_v5": "filemq v5", "mosquitto_v5": "mosquitto v5", "filemq_v311": "filemq 3.1.1"}


def contenders(opts: BrokerBenchOptions) -> list[Contender]:
    """filemq 3.1.1, filemq v5 and (with baselines) mosquitto v5, in the order they alternate."""
    out = [Contender("filemq_v311", "filemq", PROTOCOL_LEVEL), Contender("filemq_v5", "filemq", PROTOCOL_LEVEL_5)]
    if opts.baselines and mosquitto_available():
        out.append(Contender("mosquitto_v5", "mosquitto", PROTOCOL_LEVEL_5))
    return out


def _properties(opts: BrokerBenchOptions, contender: Contender) -> Properties | None:
    return V5_PROPERTIES if opts.v5_properties and contender.protocol == PROTOCOL_LEVEL_5 else None


def refusal(result: LoadResult) -> str | None:
    """"CONNACK 0xNN" when the broker refused the load clients' CONNECT, else None."""
    code = result.connack_code
    return None if code is None else f"CONNACK 0x{code:02X}"


def _progress(result: LoadResult, text: Callable[[LoadResult], str]) -> str:
    why = refusal(result)
    if why:
        return f"refused ({why}): the broker does not accept MQTT 5 CONNECT"
    errors = f"; errors: {result.errors[:2]}" if result.errors else ""
    return text(result) + errors


def _figures(out: dict[str, Any], name: str, results: list[LoadResult], rate: Callable[[LoadResult], float],
             count: Callable[[LoadResult], int], keys: tuple[str, str]) -> None:
    """One contender's keys: best rate, its count, every run's rate and CPU per message (the
    lowest counts), or ``{name}_refused`` when its CONNECT was refused."""
    why = refusal(results[0])
    if why:
        out[f"{name}_refused"] = why
        out[f"{name}_connack_code"] = results[0].connack_code
        return
    rate_key, count_key = keys
    best = max(results, key=rate)
    out[f"{name}_{rate_key}"] = round(rate(best))
    out[f"{name}_{count_key}"] = count(best)
    out[f"{name}_runs_{rate_key}"] = [round(rate(r)) for r in results]
    out[f"{name}_cpu_pct"] = rnd(best.broker_cpu_pct or 0.0)
    cpu_figures(out, name, results, [count(r) for r in results])
    if best.refused:
        out[f"{name}_refused_pubacks"] = best.refused
    if best.errors:
        out[f"{name}_errors"] = best.errors[:4]


def _ratios(out: dict[str, Any], rate_key: str) -> None:
    """``ratio_v5_vs_v311`` and ``cpu_v5_over_v311`` (the goal), ``ratio_vs_mosquitto_v5`` and
    ``cpu_ratio_vs_mosquitto_v5`` (mosquitto v5's CPU per message / filemq v5's, as the 3.1.1
    scenarios' ``cpu_ratio_vs_mosquitto``), ``meets_target``."""
    v5, v311, mosq = (out.get(f"{n}_{rate_key}") for n in ("filemq_v5", "filemq_v311", "mosquitto_v5"))
    cpu5, cpu311, cpum = (out.get(f"{n}_cpu_us_per_msg") for n in ("filemq_v5", "filemq_v311", "mosquitto_v5"))
    out["target_v5_vs_v311"] = TARGET_V5_VS_V311
    out["target_cpu_v5_over_v311"] = TARGET_CPU_V5_OVER_V311
    if v5 and v311:
        out["ratio_v5_vs_v311"] = rnd(v5 / v311, 2)
    if cpu5 and cpu311:
        out["cpu_v5_over_v311"] = rnd(cpu5 / cpu311, 2)
    if v5 and mosq:
        out["ratio_vs_mosquitto_v5"] = rnd(v5 / mosq, 2)
    if cpu5 and cpum:
        out["cpu_ratio_vs_mosquitto_v5"] = rnd(cpum / cpu5, 2)
    if "filemq_v5_refused" in out or not v5:
        out["meets_target"] = False
    elif "ratio_v5_vs_v311" in out and "cpu_v5_over_v311" in out:
        out["meets_target"] = (out["ratio_v5_vs_v311"] >= TARGET_V5_VS_V311
                               and out["cpu_v5_over_v311"] <= TARGET_CPU_V5_OVER_V311)
    else:
        out["meets_target"] = None


def _header(opts: BrokerBenchOptions, scenario: str) -> dict[str, Any]:
    return {"bench": "broker", "scenario": scenario, "protocol": 5, "v5_properties": opts.v5_properties,
            "publishers": opts.publishers, "inflight": opts.inflight, "payload_bytes": opts.size,
            "fsync": opts.fsync, **windows(opts)}


def _props_text(opts: BrokerBenchOptions) -> str:
    return ("v5 PUBLISHes carry a content type and a user property" if opts.v5_properties
            else "v5 PUBLISHes without properties")


def scenario_ingest5(opts: BrokerBenchOptions, say: Progress) -> dict[str, Any]:
    """Durable QoS 1 ingest, PUBACKs/s: filemq v5, mosquitto v5 and filemq 3.1.1."""
    messages = opts.messages or 200_000
    out = _header(opts, "ingest")
    say(f"ingest (MQTT 5): {opts.publishers} publishers x {opts.inflight} in flight, QoS 1, {opts.size}-byte "
        f"payloads, {_props_text(opts)}; up to {messages:,} messages or {opts.max_seconds:.0f} s per broker; "
        f"{windows_text(opts)}")
    sink = run_null_sink(opts.publishers, max(messages, 400_000), opts.size, opts.inflight,
                         max_seconds=opts.max_seconds, protocol=PROTOCOL_LEVEL_5,
                         properties=V5_PROPERTIES if opts.v5_properties else None)
    out["generator_ceiling_acks_per_s"] = round(sink.ack_rate)
    say(f"  load generator ceiling (null sink, MQTT 5): {sink.ack_rate:,.0f} PUBACKs/s")

    def run(broker: BrokerProcess, c: Contender) -> LoadResult:
        return ingest_run(broker, opts, messages, "bench/ingest", protocol=c.protocol,
                           properties=_properties(opts, c))

    def text(r: LoadResult) -> str:
        return (f"{r.ack_rate:>10,.0f} PUBACKs/s ({r.acked:,} in {r.ack_seconds:.2f} s, broker CPU "
                f"{r.broker_cpu_pct:.0f}%, {cpu_detail(r, r.acked)})")

    with workdir(opts, "ingest5") as work:
        runs = alternate(opts, work, contenders(opts), run, lambda name, r: say(f"  {LABELS[name]:12}: {_progress(r, text)}"))
    for name, results in runs.items():
        _figures(out, name, results, lambda r: r.ack_rate, lambda r: r.acked, ("acks_per_s", "acked"))
    _ratios(out, "acks_per_s")
    return out


def scenario_fanout5(opts: BrokerBenchOptions, say: Progress) -> dict[str, Any]:
    """Deliveries/s to persistent QoS 1 subscribers: filemq v5, mosquitto v5 and filemq 3.1.1."""
    messages = opts.messages or 20_000
    out = _header(opts, "fanout")
    out["subscribers"] = opts.subscribers
    say(f"fanout (MQTT 5): {opts.subscribers} persistent QoS 1 subscribers, {messages:,} messages from "
        f"{opts.publishers} publishers, {_props_text(opts)}; {windows_text(opts)}")

    def run(broker: BrokerProcess, c: Contender) -> LoadResult:
        return fanout_run(broker, opts, messages, protocol=c.protocol, properties=_properties(opts, c))

    def text(r: LoadResult) -> str:
        return (f"{r.delivery_rate:>10,.0f} deliveries/s ({r.delivered:,} of {r.acked * opts.subscribers:,} in "
                f"{r.delivery_seconds:.2f} s, broker CPU {r.broker_cpu_pct:.0f}%, "
                f"{cpu_detail(r, r.delivered, 'delivery')})")

    with workdir(opts, "fanout5") as work:
        runs = alternate(opts, work, contenders(opts), run, lambda name, r: say(f"  {LABELS[name]:12}: {_progress(r, text)}"))
    for name, results in runs.items():
        _figures(out, name, results, lambda r: r.delivery_rate, lambda r: r.delivered,
                 ("deliveries_per_s", "delivered"))
        if f"{name}_refused" not in out:
            out[f"{name}_published"] = max(results, key=lambda r: r.delivery_rate).acked
    _ratios(out, "deliveries_per_s")
    return out


def _who(result: dict[str, Any], name: str, rate_key: str, unit: str) -> str:
    if f"{name}_refused" in result:
        return f"{LABELS[name]} refused ({result[f'{name}_refused']})"
    if f"{name}_{rate_key}" in result:
        return f"{LABELS[name]} {result[f'{name}_{rate_key}']:,} {unit}"
    return f"{LABELS[name]} -"


def summary_line5(result: dict[str, Any]) -> str:
    """The text line of a ``--protocol 5`` result."""
    ok = {True: "meets target", False: "MISSES target", None: "no reference"}[result.get("meets_target")]
    rate_key, unit = (("acks_per_s", "acks/s") if result["scenario"] == "ingest"
                      else ("deliveries_per_s", "deliveries/s"))
    head = f"{result['scenario']:6} v5 "
    if "filemq_v5_refused" in result:
        first = (f"{head}{_who(result, 'filemq_v5', rate_key, unit)}; "
                 f"{_who(result, 'filemq_v311', rate_key, unit)}; {_who(result, 'mosquitto_v5', rate_key, unit)}")
    else:
        first = (f"{head}{_who(result, 'filemq_v5', rate_key, unit)} = "
                 f"{result.get('ratio_v5_vs_v311', '-')}x {_who(result, 'filemq_v311', rate_key, unit)} "
                 f"(>= {TARGET_V5_VS_V311}); {result.get('ratio_vs_mosquitto_v5', '-')}x "
                 f"{_who(result, 'mosquitto_v5', rate_key, unit)}")
    if "generator_ceiling_acks_per_s" in result:
        first += f"; generator ceiling {result['generator_ceiling_acks_per_s']:,}/s"
    per = "us/msg" if result["scenario"] == "ingest" else "us/delivery"
    cpu = [f"{LABELS[n]} {result[f'{n}_cpu_us_per_msg']}" for n in ("filemq_v5", "filemq_v311", "mosquitto_v5")
           if f"{n}_cpu_us_per_msg" in result]
    second = (f"          broker CPU {per}: {', '.join(cpu) or '-'}; v5/3.1.1 {result.get('cpu_v5_over_v311', '-')} "
              f"(<= {TARGET_CPU_V5_OVER_V311}), mosquitto v5/filemq v5 {result.get('cpu_ratio_vs_mosquitto_v5', '-')}x")
    props = "  (with --v5-properties)" if result.get("v5_properties") else ""
    return f"{first}  [{ok}]{props}\n{second}"
