"""The ``filemq bench`` commands (the click group ``cli.py`` adds to ``filemq``): each runs a
workload of this package and, in the same run, its baseline, and prints the ratio.  Each
command imports its workload when it runs, so ``filemq --help`` stays quick."""

from __future__ import annotations

import logging
import sys

import click


@click.group()
def bench() -> None:
    """Benchmarks; each runs its baseline in the same run and prints the ratio."""


@bench.command("append")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where to put the log (a temporary directory if omitted).")
@click.option("--records", type=click.IntRange(min=1), default=200_000, show_default=True)
@click.option("--size", type=click.IntRange(min=0), default=100, show_default=True, help="Payload bytes.")
@click.option("--producers", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--inflight", type=click.IntRange(min=1), default=100, show_default=True,
              help="Appends each producer keeps in flight.")
@click.option("--fsync", type=click.Choice(["always", "interval", "never"]), default="always", show_default=True)
@click.option("--baseline-seconds", type=click.FloatRange(min=0.1), default=2.0, show_default=True)
@click.option("--commit-on-loop-max-ms", type=click.FloatRange(min=0), default=None,
              help="[log] commit_on_loop_max_ms for the filemq run (default: the key's default; 0 = commit thread).")
@click.option("--keep", is_flag=True, help="Keep the data directory.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line on stdout.")
def bench_append(data_dir: str | None, records: int, size: int, producers: int, inflight: int,
                 fsync: str, baseline_seconds: float, commit_on_loop_max_ms: float | None, keep: bool,
                 as_json: bool) -> None:
    """Group-commit append rate vs fdatasync-per-record and persist-queue's SQLiteAckQueue."""
    import json

    from bench.append import run_append_bench

    results, ratios = run_append_bench(data_dir, records, size, producers, inflight, fsync, keep,
                                       lambda msg: click.echo(msg, err=True), baseline_seconds,
                                       commit_on_loop_max_ms)
    for result in results:
        if as_json:
            click.echo(json.dumps(result.as_dict()))
        else:
            batch = f", {result.fsyncs:,} fsyncs, {result.records / result.fsyncs:,.1f}/fsync" if result.fsyncs else ""
            click.echo(f"{result.impl:28} {result.rate:>11,.0f} records/s {result.mb_per_s:8.2f} MB/s{batch}")
    if as_json:
        click.echo(json.dumps({"bench": "append", **{k: round(v, 1) for k, v in ratios.items()}}))
    else:
        click.echo(f"filemq vs fdatasync-per-record = {ratios['vs_fdatasync_per_record']:,.1f}x, "
                   f"vs SQLiteAckQueue = {ratios['vs_sqlite_ack_queue']:,.1f}x")


@bench.command("recover")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where to build the log (a temporary directory if omitted).")
@click.option("--size-mb", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--payload", type=click.IntRange(min=0), default=100, show_default=True, help="Payload bytes per record.")
@click.option("--segment-mb", type=click.IntRange(min=1, max=4095), default=64, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed for the cut position.")
@click.option("--keep", is_flag=True, help="Keep the data directory.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line on stdout.")
def bench_recover(data_dir: str | None, size_mb: int, payload: int, segment_mb: int, seed: int | None,
                  keep: bool, as_json: bool) -> None:
    """Time Log.open after a torn tail vs a full CRC scan of the whole log."""
    import json

    from bench.recover import run_recover_bench

    result = run_recover_bench(data_dir, size_mb, payload, segment_mb << 20, keep,
                               lambda msg: click.echo(msg, err=True), seed)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        click.echo(f"log {result.log_bytes / 2**20:,.0f} MiB in {result.segments} segments, {result.records:,} records")
        click.echo(f"open (torn tail, {result.tail_scanned_bytes / 2**20:,.1f} MiB scanned): {result.open_seconds:.3f} s")
        click.echo(f"full CRC scan: {result.full_scan_seconds:.2f} s  ({result.ratio:,.0f}x the open)")


@bench.command("codec")
@click.option("--packets", type=click.IntRange(min=1), default=200_000, show_default=True,
              help="PUBLISH packets in the decoded stream (and PUBACKs encoded).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs per measurement; the best is reported.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line on stdout.")
def bench_codec(packets: int, rounds: int, as_json: bool) -> None:
    """MQTT codec: PUBLISH decode and PUBACK encode rates, filemq vs amqtt on the same bytes."""
    import json

    from bench.codec import ratios, run_codec_bench

    results = run_codec_bench(packets, rounds, progress=lambda msg: click.echo(msg, err=True))
    for result in results:
        if as_json:
            click.echo(json.dumps(result.as_dict()))
        else:
            click.echo(f"{result.operation:15} {result.impl:7} {result.rate:>12,.0f} packets/s")
    for operation, ratio in ratios(results).items():
        if as_json:
            click.echo(json.dumps({"bench": "codec", "operation": operation, "ratio_vs_amqtt": round(ratio, 2)}))
        else:
            click.echo(f"{operation:15} filemq/amqtt = {ratio:.1f}x")


_BROKER_SCENARIOS = ("ingest", "fanout", "everyday", "latency", "idle", "startup", "trie", "kill9", "all")


def _split_scenarios(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """--scenario is repeatable and takes comma-separated lists (``ingest,fanout``)."""
    names = tuple(n.strip() for v in value for n in v.split(",") if n.strip())
    unknown = [n for n in names if n not in _BROKER_SCENARIOS]
    if unknown or not names:
        raise click.BadParameter(f"{', '.join(unknown) or 'nothing'}: choose from {', '.join(_BROKER_SCENARIOS)}",
                                 ctx, param)
    return names


def _everyday_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: comma-separated msg/s, e.g. 1000,100,10,0",
                                 param_hint="--everyday-rates") from None
    if not rates or any(r < 0 for r in rates):
        raise click.BadParameter(f"{text!r}: one or more rates >= 0", param_hint="--everyday-rates")
    return rates


@bench.command("broker")
@click.option("--scenario", "scenarios", multiple=True, default=["all"], show_default=True,
              callback=_split_scenarios, metavar="[" + "|".join(_BROKER_SCENARIOS) + "]",
              help="Scenario to run (repeatable, or comma-separated).")
@click.option("--protocol", type=click.Choice(["3.1.1", "5"]), default="3.1.1", show_default=True,
              help="MQTT version of the load clients. 5: ingest and fanout only, each against filemq v5, "
                   "mosquitto v5 and filemq 3.1.1 in the same run (docs/BENCHMARKS.md).")
@click.option("--v5-properties", is_flag=True,
              help="With --protocol 5: every PUBLISH carries a content type and one user property.")
@click.option("--messages", type=click.IntRange(min=1), default=None,
              help="Messages per load run (default per scenario: ingest 200k, fanout 20k, latency 5 s at --rate).")
@click.option("--publishers", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--inflight", type=click.IntRange(min=1, max=65535), default=100, show_default=True)
@click.option("--size", type=click.IntRange(min=16), default=100, show_default=True, help="Payload bytes.")
@click.option("--subscribers", type=click.IntRange(min=1), default=10, show_default=True, help="fanout subscribers.")
@click.option("--subscriber-client", type=click.Choice(["loadgen", "single", "nagle", "paho"]), default="loadgen",
              show_default=True,
              help="fanout subscribers: our bulk-acking clients; the same raw-socket clients sending each "
                   "PUBACK in a send of its own; those again with Nagle's algorithm on (no TCP_NODELAY, "
                   "a socket's default); or paho-mqtt 2.x clients (one PUBACK per message, like ordinary "
                   "clients; needs pip install paho-mqtt).")
@click.option("--publisher-client", type=click.Choice(["loadgen", "single", "nagle"]), default="loadgen",
              show_default=True,
              help="ingest and fanout publishers: our raw-socket clients sending the PUBLISHes a read of "
                   "PUBACKs frees in one send; the same sending each PUBLISH in a send of its own; or those "
                   "with Nagle's algorithm on (no TCP_NODELAY).")
@click.option("--max-inflight", type=click.IntRange(min=1, max=65535), default=None,
              help="In-flight window of BOTH brokers (filemq --max-inflight, mosquitto max_inflight_messages); "
                   "default: each its own (filemq 32, mosquitto 100).")
@click.option("--rate", type=click.FloatRange(min=1), default=5000.0, show_default=True, help="latency msg/s.")
@click.option("--sensors", type=click.IntRange(min=1), default=50, show_default=True,
              help="everyday: sensor loops (one QoS 1 PUBLISH in a send of its own, waiting for its PUBACK).")
@click.option("--everyday-rates", default="1000,100,10,0", show_default=True,
              help="everyday: msg/s over all sensors, comma-separated; 0 = connected and silent (idle).")
@click.option("--everyday-seconds", type=click.FloatRange(min=1), default=15.0, show_default=True,
              help="everyday: seconds per run.")
@click.option("--sensor-size", type=click.IntRange(min=1, max=90), default=40, show_default=True,
              help="everyday: payload bytes of a reading.")
@click.option("--kill-rounds", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--backlog-mb", type=click.IntRange(min=1), default=1024, show_default=True,
              help="idle/startup log size.")
@click.option("--idle-clients", type=click.IntRange(min=0), default=1000, show_default=True)
@click.option("--idle-seconds", type=click.FloatRange(min=0.5), default=10.0, show_default=True)
@click.option("--max-seconds", type=click.FloatRange(min=0.5), default=15.0, show_default=True,
              help="Cap per broker per load run (a slow baseline's rate is still measured).")
@click.option("--repeat", type=click.IntRange(min=1), default=2, show_default=True,
              help="ingest/fanout runs per broker, alternating; the best of each counts.")
@click.option("--fsync", type=click.Choice(["always", "interval", "never"]), default="always", show_default=True)
@click.option("--no-baselines", is_flag=True, help="Run filemq only (no mosquitto / amqtt).")
@click.option("--seed", type=int, default=None, help="Seed for kill moments and the torn-tail cut.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where to put data dirs (a temporary directory if omitted).")
@click.option("--keep", is_flag=True, help="Keep the data directories.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per scenario per line on stdout.")
def bench_broker(scenarios: tuple[str, ...], messages: int | None, publishers: int, inflight: int, size: int,
                 subscribers: int, rate: float, kill_rounds: int, backlog_mb: int, idle_clients: int,
                 idle_seconds: float, max_seconds: float, repeat: int, fsync: str, no_baselines: bool,
                 seed: int | None,
                 workdir: str | None, keep: bool, as_json: bool, protocol: str = "3.1.1",
                 v5_properties: bool = False, subscriber_client: str = "loadgen",
                 publisher_client: str = "loadgen", max_inflight: int | None = None, sensors: int = 50,
                 everyday_rates: str = "1000,100,10,0", everyday_seconds: float = 15.0,
                 sensor_size: int = 40) -> None:
    """The broker's acceptance figures vs Debian mosquitto and amqtt, in the same run."""
    import json
    from pathlib import Path

    from bench.broker import run_broker_bench, summary_line
    from bench.harness.brokers import BrokerBenchOptions

    if protocol == "5":
        other = sorted(set(scenarios) - {"ingest", "fanout", "all"})
        if other:
            raise click.UsageError(f"--protocol 5 runs the ingest and fanout scenarios only, not {', '.join(other)}")
    elif v5_properties:
        raise click.UsageError("--v5-properties needs --protocol 5")
    if subscriber_client == "paho":
        from bench.paho_sub import PahoMissing, require_paho

        if protocol == "5":
            raise click.UsageError("--subscriber-client paho runs with --protocol 3.1.1 only")
        try:
            require_paho()
        except PahoMissing as exc:
            raise click.ClickException(str(exc)) from exc
    opts = BrokerBenchOptions(
        messages=messages, publishers=publishers, inflight=inflight, size=size, subscribers=subscribers,
        rate=rate, kill_rounds=kill_rounds, backlog_mb=backlog_mb, idle_clients=idle_clients,
        idle_seconds=idle_seconds, max_seconds=max_seconds, repeat=repeat, fsync=fsync, seed=seed,
        workdir=Path(workdir) if workdir else None, keep=keep, baselines=not no_baselines,
        protocol=5 if protocol == "5" else 4, v5_properties=v5_properties,
        subscriber_client=subscriber_client, publisher_client=publisher_client, max_inflight=max_inflight,
        sensors=sensors, everyday_rates=_everyday_rates(everyday_rates), everyday_seconds=everyday_seconds,
        sensor_size=sensor_size,
    )
    for result in run_broker_bench(list(scenarios), opts, lambda msg: click.echo(msg, err=True)):
        click.echo(json.dumps(result) if as_json else summary_line(result))


@bench.command("forward")
@click.option("--records", type=click.IntRange(min=1000), default=1_000_000, show_default=True,
              help="Backlog size for the drain (and records sent by the simulated devices).")
@click.option("--size", type=click.IntRange(min=16), default=100, show_default=True, help="Payload bytes.")
@click.option("--devices", type=click.IntRange(min=2), default=None, multiple=True,
              help="Simulated devices (MQTT connections) feeding one collector [default: 100; with --only "
                   "storm 5000]. With --only storm, repeatable: one storm per fleet size.")
@click.option("--ingest-records", type=click.IntRange(min=1000), default=200_000, show_default=True,
              help="Messages for the broker's durable ingest rate.")
@click.option("--skip-bridge", is_flag=True, help="Do not run the Mosquitto bridge baseline.")
@click.option("--only", type=click.Choice(["all", "mqtt-export", "storm", "devices"]), default="all",
              show_default=True,
              help="mqtt-export: only the MQTT export drain vs the bridge, at 50,000 and --records. storm: "
                   "--devices connect together to a collector, which is killed (SIGKILL) and restarted; "
                   "seconds until the last is back, attempts per device, records lost. devices: only the "
                   "many-devices run (with and without health reports).")
@click.option("--mosquitto-max-inflight", type=click.IntRange(min=0), default=None,
              help="With --only mqtt-export: max_inflight_messages for every mosquitto (default: its own, 20).")
@click.option("--oracle", type=click.Choice(["puback", "subscriber"]), default="puback", show_default=True,
              help="With --only mqtt-export: count the destination's PUBACKs (through a counting proxy) or the"
                   " messages a mosquitto_sub there receives; the same for the export and the bridge.")
@click.option("--oracle-qos", type=click.IntRange(0, 2), default=1, show_default=True,
              help="With --oracle subscriber: the subscriber's QoS.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --only mqtt-export: runs of each per size, alternating; the summary gives medians. "
                   "The many-devices run: pairs of runs without and with health reports, alternating.")
@click.option("--health-interval-s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="The many-devices run: seconds between a device's health reports in the runs with reports "
                   "(an agent's default); 0: one run without reports only.")
@click.option("--api-interval-s", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="The many-devices run: GET the collector's /api/fleet this often while the devices send "
                   "(0: never).")
@click.option("--health-start", type=click.Choice(["steady", "reconnect"]), default="steady", show_default=True,
              help="The many-devices run: steady: each device's first report follows its connect (before the "
                   "clock) and the next come at phases spread over the interval (a running fleet's rate); "
                   "reconnect: every device's first report at the start of the measured window (a fleet that "
                   "has just reconnected).")
@click.option("--batch-records", type=click.IntRange(min=1), default=1000, show_default=True,
              help="The many-devices run: records per batch.")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None, help="Where to put the data (default: a temp dir).")
@click.option("--keep", is_flag=True, help="Keep the work directory.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line on stdout.")
def bench_forward(records: int, size: int, devices: tuple[int, ...], ingest_records: int, skip_bridge: bool,
                  only: str, mosquitto_max_inflight: int | None, oracle: str, oracle_qos: int, repeat: int,
                  health_interval_s: float, api_interval_s: float, health_start: str, batch_records: int,
                  work_dir: str | None, keep: bool, as_json: bool) -> None:
    """Backlog drain agent -> collector -> Parquet vs a Mosquitto bridge; 100 devices -> one
    collector; drain rate vs the broker's durable ingest rate; --only storm: a fleet that
    reconnects at once."""
    if only == "storm":
        from bench.storm import run_storm_bench

        results = run_storm_bench(devices=devices or (5000,), size=size, work_dir=work_dir, keep=keep,
                                  as_json=as_json)
        if any(r.records_lost > 0 for r in results):
            raise SystemExit(1)
        return
    from bench.forward_bench import run_forward_bench

    run_forward_bench(records=records, size=size, devices=devices[-1] if devices else 100, work_dir=work_dir,
                      keep=keep,
                      as_json=as_json, skip_bridge=skip_bridge, ingest_records=ingest_records, only=only,
                      mosquitto_max_inflight=mosquitto_max_inflight, oracle=oracle, oracle_qos=oracle_qos,
                      repeat=repeat, health_interval_s=health_interval_s, api_interval_s=api_interval_s or None,
                      batch_records=batch_records, health_start=health_start)


@bench.command("fleet")
@click.option("--devices", type=click.IntRange(min=2), default=5000, show_default=True,
              help="Simulated devices (MQTT connections) feeding one collector.")
@click.option("--records", type=click.IntRange(min=1000), default=1_000_000, show_default=True,
              help="Records sent in each run (at least one batch per device).")
@click.option("--batch-records", type=click.IntRange(min=1), default=200, show_default=True,
              help="Records per batch.")
@click.option("--size", type=click.IntRange(min=16), default=100, show_default=True, help="Payload bytes.")
@click.option("--health-interval-s", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Seconds between a device's health reports in the runs with reports.")
@click.option("--repeat", type=click.IntRange(min=1), default=2, show_default=True,
              help="Pairs of runs without and with reports, alternating; the summary gives medians.")
@click.option("--api-interval-s", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="GET /api/fleet this often while the devices send (0: never).")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None, help="Where to put the data.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line on stdout.")
def bench_fleet(devices: int, records: int, batch_records: int, size: int, health_interval_s: float, repeat: int,
                api_interval_s: float, work_dir: str | None, as_json: bool) -> None:
    """`bench forward --only devices` with shorter report intervals and batches by default:
    collector CPU per landed row with and without health reports; /api/fleet time at N devices."""
    from bench.forward_bench import run_forward_bench

    run_forward_bench(records=records, size=size, devices=devices, work_dir=work_dir, keep=False, as_json=as_json,
                      only="devices", repeat=repeat, health_interval_s=health_interval_s,
                      api_interval_s=api_interval_s or None, batch_records=batch_records)


@bench.command("consume")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where to put the log (a temporary directory if omitted).")
@click.option("--records", type=click.IntRange(min=1), default=500_000, show_default=True)
@click.option("--size", type=click.IntRange(min=0), default=100, show_default=True, help="Payload bytes.")
@click.option("--groups", type=click.IntRange(min=1), default=1, show_default=True,
              help="Consumer groups, each reading every record.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Alternating runs of each; the best is reported.")
@click.option("--keep", is_flag=True, help="Keep the data directory.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line on stdout.")
def bench_consume(data_dir: str | None, records: int, size: int, groups: int, rounds: int, keep: bool,
                  as_json: bool) -> None:
    """Consumer-group fetch+ack rate (offsets persisted, batched) vs raw Log.read."""
    import json

    from bench.consume import run_consume_bench

    results, ratio = run_consume_bench(data_dir, records, size, groups, keep,
                                       lambda msg: click.echo(msg, err=True), rounds)
    for result in results:
        if as_json:
            click.echo(json.dumps(result.as_dict()))
        else:
            writes = f", {result.offset_writes} offset-file writes" if result.offset_writes else ""
            click.echo(f"{result.impl:32} {result.rate:>11,.0f} records/s{writes}")
    if as_json:
        click.echo(json.dumps({"bench": "consume", "ratio_vs_log_read": round(ratio, 3)}))
    else:
        click.echo(f"groups / raw Log.read = {ratio:.2f}x")


@bench.command("ingest")
@click.option("--rows", type=click.IntRange(min=1), default=5_000_000, show_default=True)
@click.option("--files", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--dup-frac", type=click.FloatRange(min=0, max=0.99), default=0.01, show_default=True)
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="Where to put landing, table and copy (a temporary directory if omitted).")
@click.option("--master", default="local[2]", show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed rounds of each side (after one untimed warm-up run of each).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line on stdout.")
def bench_ingest(rows: int, files: int, dup_frac: float, work_dir: str | None, master: str,
                 rounds: int, as_json: bool) -> None:
    """Our Spark ingest vs a plain spark.read.parquet().write.parquet() of the same files."""
    import json
    import tempfile
    from pathlib import Path

    from bench.ingest import ACCEPTANCE_RATIO, run_ingest_bench

    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("bench.ingest").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="filemq-bench-ingest-") as tmp:
        result = run_ingest_bench(Path(work_dir or tmp), rows, files, dup_frac, master, rounds)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        click.echo(f"{result.rows:,} rows in {result.files} files ({result.duplicates:,} duplicates): "
                   f"copy {result.copy_seconds:.1f}s, ingest {result.ingest_seconds:.1f}s, "
                   f"ratio {result.ratio:.2f}x (acceptance <= {ACCEPTANCE_RATIO}x) "
                   f"{'PASS' if result.passed else 'FAIL'}")
        if result.cpu_ratio is not None:
            click.echo(f"CPU time (Spark JVM + Python driver): copy {result.copy_cpu_seconds:.1f}s, ingest "
                       f"{result.ingest_cpu_seconds:.1f}s, ratio {result.cpu_ratio:.2f}x")
    if not result.passed:
        sys.exit(1)
