"""`filemq bench broker --scenario ingest|fanout`: the broker's rates and CPU per message, for
either MQTT protocol version (``--protocol``), each against its references in the same run.

One scenario per load (:mod:`bench.harness.loads`), the protocol version and the MQTT 5
properties taken from :class:`~bench.harness.brokers.BrokerBenchOptions`:

* ``ingest``  durable QoS 1 PUBACKs/s, plus the load generator's own ceiling against a null sink;
* ``fanout``  deliveries/s to persistent QoS 1 subscribers.

The contenders (:func:`bench.harness.alternate.contenders`) alternate ``--repeat`` times on
fresh data directories; each one's best run counts.  With 3.1.1 clients filemq is set against
Debian mosquitto (rate >= 0.5 x) and, for ingest, stock amqtt (>= 4 x).  With MQTT 5 clients
(``--protocol 5``; PUBLISHes with an empty property section unless ``--v5-properties`` adds
:data:`~bench.harness.loads.V5_PROPERTIES`) the contenders are filemq v5, filemq 3.1.1 and
mosquitto v5, and the goal (issue 13) is filemq's MQTT 5 figures within 10 % of its own 3.1.1
ones: ``ratio_v5_vs_v311`` (rate) >= 0.9 and ``cpu_v5_over_v311`` (broker CPU per message)
<= 1.1.  A broker that refuses the load clients' CONNECT is reported as refused
(``{name}_refused`` = "CONNACK 0x01", ``meets_target`` False), not as a crash.

A result is one flat dict (the ``--json`` line); :func:`fill_figures` builds it from the runs,
:func:`throughput_lines` puts it in words.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.harness.alternate import Contender, alternate, contenders
from bench.harness.brokers import BrokerBenchOptions, Progress, windows, windows_text, workdir
from bench.harness.cpu import cpu_detail, cpu_figures
from bench.harness.loads import V5_PROPERTIES, fanout_run, ingest_run
from bench.harness.processes import BrokerProcess
from bench.harness.summary import cpu_text, errors_text, refusal, rnd
from bench.loadgen import run_null_sink
from bench.loadspec import LoadResult
from bench.paho_sub import require_paho
from filemq.mqtt.packets import PROTOCOL_LEVEL, PROTOCOL_LEVEL_5, Properties

SCENARIOS = ("ingest", "fanout")
TARGET_V5_VS_V311 = 0.9  # rate: filemq v5 / filemq 3.1.1
TARGET_CPU_V5_OVER_V311 = 1.1  # broker CPU per message: filemq v5 / filemq 3.1.1
# How a contender is named in progress and summary lines (else by its name).
LABELS = {"filemq_v5": "filemq v5", "mosquitto_v5": "mosquitto v5", "filemq_v311": "filemq 3.1.1"}
SUBSCRIBER_CLIENT_TEXT = {
    "loadgen": "loadgen clients, bulk PUBACKs", "paho": "paho-mqtt clients, one PUBACK per message",
    "single": "raw-socket clients, each PUBACK in a send of its own",
    "nagle": "raw-socket clients, each PUBACK in a send of its own, Nagle's algorithm on"}
PUBLISHER_CLIENT_TEXT = {
    "loadgen": "the PUBLISHes a read of PUBACKs frees in one send",
    "single": "each PUBLISH in a send of its own",
    "nagle": "each PUBLISH in a send of its own, Nagle's algorithm on"}


@dataclass(frozen=True)
class Measure:
    """What a scenario counts: the rate and count of a run, their result keys and units."""

    rate: Callable[[LoadResult], float]
    count: Callable[[LoadResult], int]
    rate_key: str  # "acks_per_s": the result has ``{contender}_acks_per_s``
    count_key: str
    unit: str  # of the rate in summary lines
    per: str  # what the CPU figure is per, in summary lines


MEASURES = {
    "ingest": Measure(lambda r: r.ack_rate, lambda r: r.acked, "acks_per_s", "acked", "acks/s", "us/msg"),
    "fanout": Measure(lambda r: r.delivery_rate, lambda r: r.delivered, "deliveries_per_s", "delivered",
                      "deliveries/s", "us/delivery"),
}


@dataclass(frozen=True)
class Reference:
    """A contender the subject's figures are set against, and the result keys that say how.

    ``ratio_key`` = subject's rate / the reference's (>= ``target`` when there is one);
    ``cpu_key`` = the reference's CPU per message / the subject's (>= 1.0: the subject spends
    no more), or with ``cpu_over`` the subject's / the reference's (<= ``cpu_target``).
    The target keys are written when the reference has a rate."""

    name: str
    ratio_key: str
    cpu_key: str
    target: float | None = None
    target_key: str = ""
    cpu_over: bool = False
    cpu_target: float | None = None
    cpu_target_key: str = ""


def baseline(name: str, target: float | None = None) -> Reference:
    """A baseline broker: ``ratio_vs_{name}``, ``cpu_ratio_vs_{name}``, ``target_vs_{name}``."""
    return Reference(name, f"ratio_vs_{name}", f"cpu_ratio_vs_{name}", target, f"target_vs_{name}")


# The MQTT 5 goal: filemq against its own 3.1.1 figures in the same run.
V311_REFERENCE = Reference("filemq_v311", "ratio_v5_vs_v311", "cpu_v5_over_v311", TARGET_V5_VS_V311,
                           "target_v5_vs_v311", cpu_over=True, cpu_target=TARGET_CPU_V5_OVER_V311,
                           cpu_target_key="target_cpu_v5_over_v311")


def subject(protocol: int) -> str:
    """The contender a result's verdict is about: ``filemq`` (3.1.1) or ``filemq_v5``."""
    return "filemq_v5" if protocol == PROTOCOL_LEVEL_5 else "filemq"


def references(scenario: str, protocol: int) -> tuple[Reference, ...]:
    """Whom the subject is set against, in the order the summary names them."""
    if protocol == PROTOCOL_LEVEL_5:
        return V311_REFERENCE, baseline("mosquitto_v5")
    if scenario == "ingest":
        return baseline("mosquitto", 0.5), baseline("amqtt", 4.0)
    return (baseline("mosquitto", 0.5),)


def label(name: str) -> str:
    return LABELS.get(name, name)


# --------------------------------------------------------------------------- results


def header(opts: BrokerBenchOptions, scenario: str) -> dict[str, Any]:
    """A result's first keys: what was run.  MQTT 5 results name the protocol and the
    properties, 3.1.1 results the kinds of client (the keys each result had before the two
    were one scenario)."""
    out: dict[str, Any] = {"bench": "broker", "scenario": scenario}
    v5 = opts.protocol == PROTOCOL_LEVEL_5
    if v5:
        out.update(protocol=PROTOCOL_LEVEL_5, v5_properties=opts.v5_properties)
    if scenario == "fanout":
        out["subscribers"] = opts.subscribers
    out["publishers"] = opts.publishers
    if v5 or scenario == "ingest":
        out.update(inflight=opts.inflight, payload_bytes=opts.size)
    out["fsync"] = opts.fsync
    if not v5:
        if scenario == "fanout":
            out["subscriber_client"] = opts.subscriber_client
        out["publisher_client"] = opts.publisher_client
    return {**out, **windows(opts)}


def fill_figures(out: dict[str, Any], scenario: str, protocol: int, runs: dict[str, list[LoadResult]]) -> None:
    """Every contender's figures from its runs (by contender name, in run order), then the
    ratios and ``meets_target``.

    Per contender: the best rate and its count (and, for fanout, its PUBACKed messages as
    ``_published``), every run's rate, the best run's CPU share, the CPU per message of every
    run and the lowest (:func:`bench.harness.cpu.cpu_figures`), PUBACKs refused and errors;
    or ``{name}_refused`` when its CONNECT was refused."""
    measure = MEASURES[scenario]
    for name, results in runs.items():
        why = refusal(results[0])
        if why:
            out[f"{name}_refused"] = why
            out[f"{name}_connack_code"] = results[0].connack_code
            continue
        best = max(results, key=measure.rate)
        out[f"{name}_{measure.rate_key}"] = round(measure.rate(best))
        out[f"{name}_{measure.count_key}"] = measure.count(best)
        if scenario == "fanout":
            out[f"{name}_published"] = best.acked
        out[f"{name}_runs_{measure.rate_key}"] = [round(measure.rate(r)) for r in results]
        out[f"{name}_cpu_pct"] = rnd(best.broker_cpu_pct or 0.0)
        cpu_figures(out, name, results, [measure.count(r) for r in results])
        if best.refused:
            out[f"{name}_refused_pubacks"] = best.refused
        if best.errors:
            out[f"{name}_errors"] = best.errors[:4]
    ratios(out, scenario, protocol)


def ratios(out: dict[str, Any], scenario: str, protocol: int) -> None:
    """The subject's ratios to each of its :func:`references` that has figures, and
    ``meets_target``: False when the subject has no rate (refused, or nothing acknowledged),
    None when no reference with a target has figures, else whether every target is met (by
    the unrounded ratio; the result reports it rounded to 2 digits)."""
    rate_key = MEASURES[scenario].rate_key
    me = subject(protocol)
    rate, cpu = out.get(f"{me}_{rate_key}"), out.get(f"{me}_cpu_us_per_msg")
    checks: list[bool] = []
    for ref in references(scenario, protocol):
        ref_rate, ref_cpu = out.get(f"{ref.name}_{rate_key}"), out.get(f"{ref.name}_cpu_us_per_msg")
        if ref_rate and ref.target is not None:
            out[ref.target_key] = ref.target
        if ref_rate and ref.cpu_target is not None:
            out[ref.cpu_target_key] = ref.cpu_target
        if rate and ref_rate:
            out[ref.ratio_key] = rnd(rate / ref_rate, 2)
            if ref.target is not None:
                checks.append(rate / ref_rate >= ref.target)
        if cpu and ref_cpu:
            out[ref.cpu_key] = rnd(cpu / ref_cpu if ref.cpu_over else ref_cpu / cpu, 2)
            if ref.cpu_target is not None:
                checks.append(cpu / ref_cpu <= ref.cpu_target)
    out["meets_target"] = False if not rate else (all(checks) if checks else None)


# --------------------------------------------------------------------------- scenarios


def _props_text(opts: BrokerBenchOptions) -> str:
    return ("v5 PUBLISHes carry a content type and a user property" if opts.v5_properties
            else "v5 PUBLISHes without properties")


def _properties(opts: BrokerBenchOptions, contender: Contender) -> Properties | None:
    return V5_PROPERTIES if opts.v5_properties and contender.protocol == PROTOCOL_LEVEL_5 else None


def _progress(opts: BrokerBenchOptions, say: Progress,
              text: Callable[[LoadResult], str]) -> Callable[[str, LoadResult], None]:
    """The line each run says: its figures, or why its clients were refused."""
    width = 12 if opts.protocol == PROTOCOL_LEVEL_5 else 9
    version = "5" if opts.protocol == PROTOCOL_LEVEL_5 else "3.1.1"

    def line(name: str, result: LoadResult) -> None:
        why = refusal(result)
        figures = (f"refused ({why}): the broker does not accept MQTT {version} CONNECT" if why
                   else text(result) + errors_text(result))
        say(f"  {label(name):{width}}: {figures}")
    return line


def scenario_ingest(opts: BrokerBenchOptions, say: Progress) -> dict[str, Any]:
    """Durable QoS 1 ingest, PUBACKs/s: filemq (fsync as given) against its references."""
    messages = opts.messages or 200_000
    v5 = opts.protocol == PROTOCOL_LEVEL_5
    out = header(opts, "ingest")
    clients = "" if v5 else f" ({PUBLISHER_CLIENT_TEXT[opts.publisher_client]})"
    props = f", {_props_text(opts)};" if v5 else ","
    say(f"ingest{' (MQTT 5)' if v5 else ''}: {opts.publishers} publishers x {opts.inflight} in flight{clients}, "
        f"QoS 1, {opts.size}-byte payloads{props} up to {messages:,} messages or {opts.max_seconds:.0f} s per "
        f"broker; {windows_text(opts)}")
    sink = run_null_sink(opts.publishers, max(messages, 400_000), opts.size, opts.inflight,
                         max_seconds=opts.max_seconds, protocol=opts.protocol,
                         properties=V5_PROPERTIES if v5 and opts.v5_properties else None)
    out["generator_ceiling_acks_per_s"] = round(sink.ack_rate)
    say(f"  load generator ceiling (null sink{', MQTT 5' if v5 else ''}): {sink.ack_rate:,.0f} PUBACKs/s")

    def run(broker: BrokerProcess, c: Contender) -> LoadResult:
        return ingest_run(broker, opts, messages, "bench/ingest", protocol=c.protocol, properties=_properties(opts, c))

    def text(r: LoadResult) -> str:
        return (f"{r.ack_rate:>10,.0f} PUBACKs/s ({r.acked:,} in {r.ack_seconds:.2f} s, broker CPU "
                f"{r.broker_cpu_pct:.0f}%, {cpu_detail(r, r.acked)})")

    with workdir(opts, f"ingest{'5' if v5 else ''}") as work:
        runs = alternate(opts, work, contenders(opts, amqtt=True), run, _progress(opts, say, text))
    fill_figures(out, "ingest", opts.protocol, runs)
    if not v5:
        reference = out.get("mosquitto_acks_per_s") or out.get("filemq_acks_per_s") or 0
        out["generator_headroom"] = rnd(sink.ack_rate / max(reference, 1), 1)
    return out


def scenario_fanout(opts: BrokerBenchOptions, say: Progress) -> dict[str, Any]:
    """Deliveries/s to persistent QoS 1 subscribers (subscribed before the load): filemq
    against its references."""
    messages = opts.messages or 20_000
    v5 = opts.protocol == PROTOCOL_LEVEL_5
    if opts.subscriber_client == "paho":
        require_paho()  # before any broker starts
    out = header(opts, "fanout")
    subscribers = "" if v5 else f" ({SUBSCRIBER_CLIENT_TEXT[opts.subscriber_client]})"
    say(f"fanout{' (MQTT 5)' if v5 else ''}: {opts.subscribers} persistent QoS 1 subscribers{subscribers}, "
        f"{messages:,} messages from {opts.publishers} publishers{f', {_props_text(opts)}' if v5 else ''}; "
        f"{windows_text(opts)}")

    def run(broker: BrokerProcess, c: Contender) -> LoadResult:
        return fanout_run(broker, opts, messages, protocol=c.protocol, properties=_properties(opts, c))

    def text(r: LoadResult) -> str:
        return (f"{r.delivery_rate:>10,.0f} deliveries/s ({r.delivered:,} of {r.acked * opts.subscribers:,} in "
                f"{r.delivery_seconds:.2f} s, broker CPU {r.broker_cpu_pct:.0f}%, "
                f"{cpu_detail(r, r.delivered, 'delivery')})")

    with workdir(opts, f"fanout{'5' if v5 else ''}") as work:
        runs = alternate(opts, work, contenders(opts, amqtt=False), run, _progress(opts, say, text))
    fill_figures(out, "fanout", opts.protocol, runs)
    return out


# --------------------------------------------------------------------------- summary


def _who(result: dict[str, Any], name: str, measure: Measure) -> str:
    if f"{name}_refused" in result:
        return f"{label(name)} refused ({result[f'{name}_refused']})"
    if f"{name}_{measure.rate_key}" in result:
        return f"{label(name)} {result[f'{name}_{measure.rate_key}']:,} {measure.unit}"
    return f"{label(name)} -"


def _fanout_setup(result: dict[str, Any]) -> str:
    """'; paho subscribers, in-flight window filemq 20 / mosquitto 20' (when the result says)."""
    if "subscriber_client" not in result:
        return ""
    return (f"; {result['subscriber_client']} subscribers, in-flight window filemq "
            f"{result.get('filemq_max_inflight', '-')} / mosquitto {result.get('mosquitto_max_inflight', '-')}")


def throughput_lines(result: dict[str, Any]) -> str:
    """The two text lines of an ingest or fanout result (what ``filemq bench broker`` prints
    without ``--json``): the subject's rate against each reference, then CPU per message."""
    scenario, measure = result["scenario"], MEASURES[result["scenario"]]
    protocol = result.get("protocol", PROTOCOL_LEVEL)
    me, refs = subject(protocol), references(scenario, protocol)
    ceiling = (f"; generator ceiling {result['generator_ceiling_acks_per_s']:,}/s"
               if "generator_ceiling_acks_per_s" in result else "")
    if protocol != PROTOCOL_LEVEL_5:
        ok = {True: "meets target", False: "MISSES target", None: "no baseline"}[result.get("meets_target")]
        versus = ", ".join(f"vs {ref.name} {result.get(ref.ratio_key, '-')}x (>= {ref.target:g})" for ref in refs)
        cpu = cpu_text(result, tuple(ref.name for ref in refs))
        setup = f" per delivery{_fanout_setup(result)}" if scenario == "fanout" else ""
        return (f"{scenario:8} {me} {result[f'{me}_{measure.rate_key}']:,} {measure.unit}; {versus}{ceiling}  [{ok}]\n"
                f"         {cpu}{setup}")
    ok = {True: "meets target", False: "MISSES target", None: "no reference"}[result.get("meets_target")]
    goal, mosquitto = refs
    if f"{me}_refused" in result:
        first = "; ".join(_who(result, name, measure) for name in (me, goal.name, mosquitto.name))
    else:
        first = (f"{_who(result, me, measure)} = {result.get(goal.ratio_key, '-')}x "
                 f"{_who(result, goal.name, measure)} (>= {goal.target}); {result.get(mosquitto.ratio_key, '-')}x "
                 f"{_who(result, mosquitto.name, measure)}")
    cpu_parts = [f"{label(n)} {result[f'{n}_cpu_us_per_msg']}" for n in (me, goal.name, mosquitto.name)
                 if f"{n}_cpu_us_per_msg" in result]
    second = (f"          broker CPU {measure.per}: {', '.join(cpu_parts) or '-'}; v5/3.1.1 "
              f"{result.get(goal.cpu_key, '-')} (<= {goal.cpu_target}), mosquitto v5/filemq v5 "
              f"{result.get(mosquitto.cpu_key, '-')}x")
    props = "  (with --v5-properties)" if result.get("v5_properties") else ""
    return f"{scenario:6} v5 {first}{ceiling}  [{ok}]{props}\n{second}"
