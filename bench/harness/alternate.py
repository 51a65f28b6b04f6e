"""The alternating runner: the same load against every contender (filemq and its baselines, or
filemq with either protocol version), ``opts.repeat`` times in alternation, each run on a
fresh data directory and with the broker's CPU measured over the whole run.

The machine may be shared: alternating and keeping every run lets a scenario take the best
of each contender, so a burst of foreign load does not decide a ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness.brokers import BrokerBenchOptions, start_filemq, start_mosquitto_for
from bench.harness.processes import BrokerProcess, mosquitto_available, start_amqtt
from bench.loadspec import LoadResult
from filemq.mqtt.packets import PROTOCOL_LEVEL, PROTOCOL_LEVEL_5


@dataclass(frozen=True)
class Contender:
    """One side of a comparison: ``name`` is its results' key prefix (``filemq``,
    ``mosquitto_v5``, ...); ``broker`` what runs (``filemq``, ``mosquitto`` or ``amqtt``);
    ``protocol`` the load clients' MQTT version; ``runs`` at most that many runs (None: one per
    repetition)."""

    name: str
    broker: str
    protocol: int = PROTOCOL_LEVEL
    runs: int | None = None


def contenders(opts: BrokerBenchOptions, *, amqtt: bool) -> list[Contender]:
    """Who runs, in the order they alternate, for the run's protocol version.

    3.1.1 (``opts.protocol`` 4): filemq and, with baselines, mosquitto (each ``opts.repeat``
    times) and with ``amqtt`` amqtt once (a fixed-time run far from its target).
    MQTT 5: filemq with 3.1.1 clients (``filemq_v311``, the reference), filemq with MQTT 5
    clients (``filemq_v5``) and, with baselines, mosquitto with MQTT 5 clients (``mosquitto_v5``)."""
    with_mosquitto = opts.baselines and mosquitto_available()
    if opts.protocol == PROTOCOL_LEVEL_5:
        out = [Contender("filemq_v311", "filemq", PROTOCOL_LEVEL), Contender("filemq_v5", "filemq", PROTOCOL_LEVEL_5)]
        return out + ([Contender("mosquitto_v5", "mosquitto", PROTOCOL_LEVEL_5)] if with_mosquitto else [])
    out = [Contender("filemq", "filemq")]
    if with_mosquitto:
        out.append(Contender("mosquitto", "mosquitto"))
    if opts.baselines and amqtt:
        out.append(Contender("amqtt", "amqtt", runs=1))
    return out


def start_contender(contender: Contender, opts: BrokerBenchOptions, work: Path) -> BrokerProcess:
    """The contender's broker on a fresh directory ``work``, with the run's settings."""
    if contender.broker == "mosquitto":
        return start_mosquitto_for(opts, work)
    if contender.broker == "amqtt":
        return start_amqtt(work)
    if contender.broker == "filemq":
        return start_filemq(work / "data", fsync=opts.fsync, max_inflight=opts.max_inflight)
    raise ValueError(f"unknown broker {contender.broker!r}")


def measured(broker: BrokerProcess, run: Callable[[BrokerProcess], LoadResult]) -> LoadResult:
    """``run(broker)`` with the broker's CPU over the whole run (connects included) in its
    result: user + system seconds, the user part, and the share of one core (is the broker
    CPU-bound, ~100 %?)."""
    (user0, sys0), t0 = broker.cpu_split(), time.monotonic()
    result = run(broker)
    user1, sys1 = broker.cpu_split()
    result.broker_user_seconds = user1 - user0
    result.broker_cpu_seconds = result.broker_user_seconds + sys1 - sys0
    result.broker_cpu_pct = 100 * result.broker_cpu_seconds / max(time.monotonic() - t0, 1e-9)
    return result


def _bound(run: Callable[[BrokerProcess, Contender], LoadResult],
           contender: Contender) -> Callable[[BrokerProcess], LoadResult]:
    return lambda broker: run(broker, contender)


def alternate(opts: BrokerBenchOptions, work: Path, contenders: Sequence[Contender],
              run: Callable[[BrokerProcess, Contender], LoadResult],
              say: Callable[[str, LoadResult], None]) -> dict[str, list[LoadResult]]:
    """``run`` against every contender in turn, ``opts.repeat`` times, each on a fresh directory
    under ``work``; every result by contender name, in run order (``say`` hears each).  A
    contender whose CONNECT the broker refused (``connack_code``) is not started again."""
    runs: dict[str, list[LoadResult]] = {}
    refused: set[str] = set()
    for rep in range(opts.repeat):
        for contender in contenders:
            if contender.name in refused or (contender.runs is not None and rep >= contender.runs):
                continue
            with start_contender(contender, opts, work / f"{contender.name}-{rep}") as broker:
                result = measured(broker, _bound(run, contender))
            if result.connack_code is not None:
                refused.add(contender.name)
            runs.setdefault(contender.name, []).append(result)
            say(contender.name, result)
    return runs
