"""The `filemq` command: parses flags and config, calls the packages. No business logic here."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from bench.commands import bench

F = TypeVar("F", bound=Callable[..., Any])


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from filemq.ops.build import build_description

    click.echo(build_description())
    ctx.exit()


@click.group()
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the version and which build runs (pure Python, or compiled with mypyc "
                   "and how many modules), then exit.")
def main(verbose: int) -> None:
    """filemq: an embedded store-and-forward MQTT broker on a CRC-checked segment log."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def config_flags(own: str, *others: str, skip: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Give a command a flag for every key of its config sections that it does not declare by
    hand (ARCHITECTURE.md: every key has a flag; flags override the file).

    ``own`` is the command's section; ``[log]`` and ``data_dir`` always belong to it. Keys of
    the ``others`` sections get the parameter name ``<section>__<key>`` (``flag_overrides``
    routes them) and the flag ``--<key>``, or ``--<section>-<key>`` where that is taken.
    ``skip`` lists keys the command sets from its own section instead. Generated flags pass
    their value as text; ``load_config`` checks and converts it, naming the flag on error.
    The help of every key's flag, hand-written ones included, is the key's meaning, range and
    default from ``filemq.common.keyhelp.key_help`` (so hand-written key flags carry no ``help=``).
    Apply it directly under ``@main.command()``, above the hand-written options.
    """
    from filemq.common.config import flag_for, key_of_param, known_keys, section_keys
    from filemq.common.keyhelp import key_help

    def decorate(fn: F) -> F:
        params = getattr(fn, "__click_params__", [])
        names = {p.name for p in params}
        flags = {opt for p in params for opt in getattr(p, "opts", [])}
        for section in (own, "log", *others):
            for key, many in section_keys(section):
                name = key.split(".", 1)[1]
                pname = name if section in (own, "log") else f"{section}__{name}"
                if key in skip or pname in names:
                    continue
                flag = flag_for(key)
                if flag in flags:
                    if section in (own, "log"):
                        continue  # declared by hand under another parameter name
                    flag = f"--{section}-{name.replace('_', '-')}"
                fn = click.option(flag, pname, default=None, multiple=many, metavar="VALUE")(fn)
                names.add(pname)
                flags.add(flag)
        # Every flag of a key, generated or hand-written, says what the validator knows:
        # meaning, accepted range, default (as a flag value) and its --help section, in
        # the order the keys are declared. (click's show_default would print "(1 MiB)":
        # the default is written into the help instead; the flag's own default stays None
        # so that the config file is not overridden.)
        # The command's own section first (the collector's --host before broker keys).
        keys = known_keys()
        order = {key: i for i, key in enumerate(sorted(keys, key=lambda k: (k.split(".")[0] != own, keys.index(k))))}
        for param in getattr(fn, "__click_params__", []):
            pkey = key_of_param(own, param.name or "")
            if pkey is None or not isinstance(param, click.Option):
                continue
            info = key_help(pkey)
            param.help = f"{info.text}  [default: {info.default}]"
            param.help_section = info.section  # type: ignore[attr-defined]
            param.help_order = order[pkey]  # type: ignore[attr-defined]
        return fn

    return decorate


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options in sections, like a man page: the
    section of a config key's flag comes from ``filemq.common.keyhelp.HELP_SECTIONS``; other options
    (``--config``, ``--help``) are general."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from filemq.common.keyhelp import HELP_SECTIONS

        rows: dict[str, list[tuple[int, str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                rank = getattr(param, "help_order", 1 << 30)
                rows.setdefault(getattr(param, "help_section", "general"), []).append((rank, *record))
        for section, title in HELP_SECTIONS.items():
            if rows.get(section):
                with formatter.section(title):
                    formatter.write_dl([(term, text) for _, term, text in sorted(rows[section], key=lambda r: r[0])])


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("user")
@click.option("--password-stdin", is_flag=True, help="Read the password from the first line of stdin.")
@click.option("--iterations", type=click.IntRange(min=1), default=None, hidden=True)
def passwd(file: str, user: str, password_stdin: bool, iterations: int | None) -> None:
    """Add USER to the password FILE or change their password (creates FILE, mode 0600)."""
    from filemq.broker.auth import DEFAULT_ITERATIONS, add_or_update, valid_username
    from filemq.common.config import ConfigError

    if not valid_username(user):
        raise click.BadParameter("must be non-empty, without ':' or spaces", param_hint="USER")
    if password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    if not password:
        raise click.ClickException("the password is empty; nothing written")
    try:
        new = add_or_update(file, user, password, iterations=iterations or DEFAULT_ITERATIONS)
    except (ConfigError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{'added' if new else 'updated'} user {user!r} in {file}", err=True)


@main.command(cls=SectionedCommand)
@config_flags("broker")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None)
@click.option("--host", default=None)
@click.option("--port", type=int, default=None)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, help="TOML config file.")
@click.option("--password-file", default=None)
@click.option("--acl-file", default=None)
@click.option("--fsync", type=click.Choice(["always", "interval", "never"]), default=None)
@click.option("--tls-cert", default=None)
@click.option("--tls-key", default=None)
@click.option("--tls-port", type=int, default=None)
@click.option("--listener", multiple=True, default=None, metavar="HOST:PORT[,key=value...]",
              help="A listener (repeatable; replaces --host/--port/--tls-*), e.g. "
                   "0.0.0.0:8883,tls_cert=c.pem,tls_key=k.pem,tls_ca=ca.pem,require_certificate=true "
                   "or 0.0.0.0:8080,protocol=websockets. Config: [[listener]] (docs/CONFIG.md).")
@click.option("--mosquitto-conf", "mosquitto_conf", type=click.Path(dir_okay=False), default=None,
              help="A Mosquitto configuration file instead of --config: listeners, TLS, password and ACL files, "
                   "limits, persistence_location; options not taken are named with the reason, one that would "
                   "weaken a guarantee (persistence false) exits 2. See `filemq mosquitto-conf`.")
def broker(config_file: str | None, **flags: object) -> None:
    """Run the MQTT broker on the log until SIGTERM/SIGINT (exit 0 clean, 2 config, 1 failure)."""
    from filemq.ops.broker_app import run_broker

    _serve("broker", config_file, flags, lambda c: [("--data-dir", c.data_dir)], run_broker)


def _serve(name: str, config_file: str | None, flags: dict[str, object],
           required: Callable[[Any], list[tuple[str, object]]], run: Callable[..., int]) -> None:
    """The shared body of broker/agent/collector: config (file, then flags), exit 2 with the
    reason on a bad or incomplete one, then run the service and exit with its code."""
    from filemq.common.config import ConfigError, flag_overrides, load_config

    mosquitto_conf = flags.pop("mosquitto_conf", None)
    try:
        overrides = flag_overrides(name, flags)
        if mosquitto_conf is not None:
            if config_file is not None:
                raise ConfigError("give --config or --mosquitto-conf, not both", key="mosquitto_conf")
            overrides = _from_mosquitto(name, str(mosquitto_conf), overrides)
        config = load_config(config_file, overrides)
    except ConfigError as exc:
        click.echo(f"filemq {name}: {exc}", err=True)
        sys.exit(2)
    missing = [flag for flag, value in required(config) if value is None]
    if missing:
        click.echo(f"filemq {name}: missing {', '.join(missing)} (or the same keys in the config file)", err=True)
        sys.exit(2)
    logging.getLogger("filemq").setLevel(min(logging.getLogger().level, logging.WARNING))
    sys.exit(run(config, ready=lambda line: click.echo(line)))


def _from_mosquitto(name: str, path: str, flags: dict[str, Any]) -> dict[str, Any]:
    """``load_config`` overrides from a mosquitto.conf, the command's flags winning; the
    options not taken are printed with their reasons; a refused one exits 2."""
    from filemq.ops.mosquitto_conf import convert

    conversion = convert(path)
    for note in conversion.ignored:
        click.echo(f"filemq {name}: mosquitto.conf option not taken: {note}", err=True)
    for note in conversion.refused:
        click.echo(f"filemq {name}: mosquitto.conf option refused: {note}", err=True)
    if conversion.refused:
        sys.exit(2)
    merged = conversion.overrides()
    merged.update(flags)
    return merged


@main.command("mosquitto-conf")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object: values, listeners, ignored, refused.")
def mosquitto_conf(file: str, as_json: bool) -> None:
    """Convert a Mosquitto configuration FILE to filemq's TOML (stdout); the options not taken
    go to stderr with their reasons. Exit 2 when an option would weaken a guarantee
    (persistence false) or the file cannot be read."""
    import json

    from filemq.common.config import ConfigError
    from filemq.ops.mosquitto_conf import convert

    try:
        conversion = convert(file)
    except ConfigError as exc:
        click.echo(f"filemq mosquitto-conf: {exc}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps({"values": conversion.values, "listeners": conversion.listeners,
                               "ignored": [vars(n) for n in conversion.ignored],
                               "refused": [vars(n) for n in conversion.refused]}))
    else:
        for note in conversion.ignored:
            click.echo(f"not taken: {note}", err=True)
        for note in conversion.refused:
            click.echo(f"refused: {note}", err=True)
        if not conversion.refused:
            click.echo(conversion.toml(), nl=False)
    if conversion.refused:
        sys.exit(2)


@main.command(cls=SectionedCommand)
@config_flags("agent", "broker", "uplink", skip=("broker.metrics_port",))
@click.option("--data-dir", type=click.Path(file_okay=False), default=None)
@click.option("--device-id", default=None)
@click.option("--collector", default=None)
@click.option("--username", default=None)
@click.option("--password", default=None)
@click.option("--password-file", default=None)
@click.option("--tls-ca", default=None)
@click.option("--stream", default=None)
@click.option("--batch-records", type=click.IntRange(min=1), default=None)
@click.option("--batch-bytes", default=None)
@click.option("--linger-ms", type=click.IntRange(min=0), default=None)
@click.option("--window", type=click.IntRange(min=1), default=None)
@click.option("--compression", type=click.Choice(["none", "zlib"]), default=None)
@click.option("--rate-limit-bytes-per-s", default=None)
@click.option("--metrics-port", type=int, default=None)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, help="TOML config file.")
@click.option("--host", "broker__host", default=None)
@click.option("--port", "broker__port", type=int, default=None)
@click.option("--broker-password-file", "broker__password_file", default=None)
@click.option("--acl-file", "broker__acl_file", default=None)
@click.option("--fsync", type=click.Choice(["always", "interval", "never"]), default=None)
@click.option("--listener", multiple=True, default=None, metavar="HOST:PORT[,key=value...]",
              help="A local broker listener (repeatable; replaces --host/--port/--tls-*). "
                   "Config: [[listener]] (docs/CONFIG.md).")
@click.option("--mosquitto-conf", "mosquitto_conf", type=click.Path(dir_okay=False), default=None,
              help="The local broker's settings from a Mosquitto configuration file instead of --config "
                   "(see `filemq broker --help`); the agent's own keys come from flags.")
def agent(config_file: str | None, **flags: object) -> None:
    """Run the device broker plus the forwarder to the collector until SIGTERM/SIGINT."""
    from worker_agent.app import run_agent

    _serve("agent", config_file, flags, lambda c: [("--data-dir", c.data_dir), ("--device-id", c.agent.device_id),
                                                   ("--collector or --export", c.exports or None)], run_agent)


@main.command(cls=SectionedCommand)
@config_flags("collector", "broker", skip=("broker.host", "broker.port", "broker.password_file",
                                          "broker.acl_file", "broker.allow_anonymous",
                                          "broker.max_connections", "broker.metrics_port"))
@click.option("--data-dir", type=click.Path(file_okay=False), default=None)
@click.option("--landing", default=None)
@click.option("--host", default=None)
@click.option("--port", type=int, default=None)
@click.option("--password-file", default=None)
@click.option("--acl-file", default=None)
@click.option("--collector-id", default=None)
@click.option("--roll-bytes", default=None)
@click.option("--roll-seconds", type=click.IntRange(min=1), default=None)
@click.option("--metrics-port", type=int, default=None)
@click.option("--fsync", type=click.Choice(["always", "interval", "never"]), default=None)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, help="TOML config file.")
def collector(config_file: str | None, **flags: object) -> None:
    """Receive device batches and land them as Parquet until SIGTERM/SIGINT."""
    from collector.app import run_collector

    _serve("collector", config_file, flags,
           lambda c: [("--data-dir", c.data_dir), ("--landing", c.collector.landing)], run_collector)


def _quiet_recovery_logs() -> None:
    """inspect/verify/status report what recovery finds themselves; without -v, do not also
    print the log's own recovery warnings (which, in a read-only dry run, describe cuts
    that are not actually made)."""
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("segments").setLevel(logging.CRITICAL)


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--from", "from_offset", type=click.IntRange(min=0), default=0, show_default=True,
              help="First offset to print.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Print at most N lines.")
@click.option("--payload", is_flag=True, help="Include payloads (base64 with --json).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line on stdout.")
def inspect(directory: str, from_offset: int, limit: int | None, payload: bool, as_json: bool) -> None:
    """Print the records of a log, one per line (DIRECTORY: data dir or its log/). Read-only."""
    import json

    from filemq.ops.status import NotADataDir, inspect_log, record_json, record_text

    _quiet_recovery_logs()

    try:
        for scanned in inspect_log(directory, from_offset, limit):
            click.echo(json.dumps(record_json(scanned, payload)) if as_json else record_text(scanned, payload))
    except NotADataDir as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.argument("directory", type=click.Path())
@click.option("--repair", is_flag=True,
              help="Cut torn tails and rewrite broken offset files (to re-deliver, never skip).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def verify(directory: str, repair: bool, as_json: bool) -> None:
    """Check every segment and offset file. Changes nothing without --repair.

    Exit status: 0 clean, 1 problems found (also when --repair fixed them), 2 not usable
    (e.g. not a filemq directory).
    """
    import json

    from filemq.ops.status import verify_data_dir

    _quiet_recovery_logs()

    report = verify_data_dir(directory, repair=repair)
    if as_json:
        click.echo(json.dumps(report.as_dict()))
    else:
        for line in report.text():
            click.echo(line)
    sys.exit(report.exit_code)


@main.command()
@click.option("--url", default=None, metavar="URL",
              help="The collector's operations port, e.g. http://127.0.0.1:9100 (https:// when it has TLS).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="A collector config file: the URL from its ops_host and metrics_port (and TLS).")
@click.option("--username", default=None, help="Login, when the collector has a password file.")
@click.option("--password-file", type=click.Path(dir_okay=False), default=None,
              help="File whose first line is the password (or FILEMQ_OPS_PASSWORD).")
@click.option("--tls-ca", type=click.Path(dir_okay=False), default=None, help="CA bundle for https://.")
@click.option("--state", "states", multiple=True,
              type=click.Choice(["online", "behind", "disk_low", "stale", "offline"]),
              help="Only devices in this state (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="The /api/fleet object as one JSON line.")
def fleet(url: str | None, config_file: str | None, username: str | None, password_file: str | None,
          tls_ca: str | None, states: tuple[str, ...], as_json: bool) -> None:
    """Every device a collector serves: state, connected, last seen, lag (its /api/fleet)."""
    import json
    import os

    from collector.fleet_view import FleetUnavailable, fetch_fleet, fleet_table

    if url is None:
        if config_file is None:
            click.echo("filemq fleet: give --url or --config (a collector config with metrics_port)", err=True)
            sys.exit(2)
        from filemq.common.config import ConfigError, load_config

        try:
            c = load_config(config_file, {})
        except ConfigError as exc:
            click.echo(f"filemq fleet: {exc}", err=True)
            sys.exit(2)
        if c.collector.metrics_port is None:
            click.echo(f"filemq fleet: {config_file} sets no collector.metrics_port", err=True)
            sys.exit(2)
        scheme = "https" if c.broker.tls_cert else "http"
        url = f"{scheme}://{c.collector.ops_host}:{c.collector.metrics_port}"
    password = os.environ.get("FILEMQ_OPS_PASSWORD")
    if password_file is not None:
        with open(password_file, encoding="utf-8") as f:
            password = (f.readline() or "").rstrip("\r\n")
    try:
        body = fetch_fleet(url, username=username, password=password, cafile=tls_ca)
    except FleetUnavailable as exc:
        click.echo(f"filemq fleet: {exc}", err=True)
        sys.exit(1)
    if states:
        body["devices"] = [d for d in body["devices"] if d.get("state") in states]
    if as_json:
        click.echo(json.dumps(body))
        return
    for line in fleet_table(body):
        click.echo(line)


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def status(directory: str, as_json: bool) -> None:
    """Log size, segments, offsets and per-group doing/pending/lag of a data dir. Read-only."""
    import json

    from filemq.ops.status import NotADataDir, data_dir_status, status_text

    _quiet_recovery_logs()

    try:
        result = data_dir_status(directory)
    except NotADataDir as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(result))
    else:
        for line in status_text(result):
            click.echo(line)


@main.command()
@click.option("--quick", is_flag=True, help="A shortened run (~10 s of publishing) with the same faults.")
@click.option("--keep", is_flag=True, help="Keep the work directory (kept anyway when the demo fails).")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="Where to run (a temporary directory if omitted).")
@click.option("--sensors", type=click.IntRange(min=1, max=100), default=None, help="Simulated sensors (default 5).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object on stdout.")
def demo(quick: bool, keep: bool, work_dir: str | None, sensors: int | None, as_json: bool) -> None:
    """The whole pipeline on loopback: sensors -> agent -> collector -> Spark, with the uplink
    cut and two kill -9 of the agent; checks that no acknowledged message is lost.

    Exit status: 0 lost 0, 1 a phase failed or a message is lost, 3 a command is not yet available.
    """
    import json
    from pathlib import Path

    from demo.pipeline import DemoOptions, DemoProgress, format_summary, run_demo

    options = DemoOptions.quick() if quick else DemoOptions()
    options.keep = keep
    options.work_dir = Path(work_dir) if work_dir else None
    if sensors is not None:
        options.sensors = sensors
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        # The sensors' connections are reset on purpose (kill -9); without -v, do not log each.
        logging.getLogger("filemq.mqtt.client").setLevel(logging.ERROR)
    tty = sys.stderr.isatty()
    last_plain = [0.0]

    def show(event: DemoProgress) -> None:
        import shutil
        import time

        if tty:
            width = shutil.get_terminal_size().columns - 1
            if event.kind == "status":
                click.echo("\r\x1b[K" + event.message[:width], nl=False, err=True)
            else:
                click.echo("\r\x1b[K" + event.message, err=True)
        elif event.kind == "phase" or time.monotonic() - last_plain[0] >= 5.0:
            # Not a terminal (CI, a pipe): plain lines, live status at most every 5 s.
            last_plain[0] = time.monotonic()
            click.echo(event.message, err=True)

    result = run_demo(options, show)
    if tty:
        click.echo("\r\x1b[K", nl=False, err=True)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    for line in format_summary(result):
        click.echo(line, err=as_json)
    if result.ok:
        sys.exit(0)
    sys.exit(3 if result.missing and result.failed_phase is None and not result.lost else 1)


@main.command("ingest")
@config_flags("ingest")
@click.option("--landing", type=click.Path(file_okay=False), default=None,
              help="Landing directory (the collector writes <landing>/incoming/dt=.../*.parquet).")
@click.option("--table", type=click.Path(file_okay=False), default=None,
              help="Curated table directory (Parquet, partitioned by dt).")
@click.option("--checkpoint", type=click.Path(file_okay=False), default=None,
              help="Streaming checkpoint directory (one per table).")
@click.option("--master", "spark_master", default=None, help="Spark master URL (default local[2]).")
@click.option("--once", is_flag=True, help="Ingest what has landed so far, then exit (cron); the default.")
@click.option("--every", "every_s", type=click.IntRange(min=1), default=None,
              help="Keep running: a micro-batch every SECONDS.")
@click.option("--payload", type=click.Choice(["raw", "json"]), default=None,
              help="json: parse payloads into the --payload-schema columns (default raw).")
@click.option("--payload-schema", default=None,
              help='Spark DDL of the JSON payload, e.g. "temperature double, humidity double".')
@click.option("--archive", type=click.Path(file_okay=False), default=None,
              help="Move ingested landing files here after their batch commits.")
@click.option("--max-files-per-batch", type=click.IntRange(min=1), default=None,
              help="Landing files per micro-batch at most (default 1000).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, help="TOML config file.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per batch and a summary on stdout.")
def ingest(config_file: str | None, once: bool, as_json: bool, **flags: object) -> None:
    """Ingest landed Parquet files into the curated table (one row per device, stream, offset)."""
    import json
    from pathlib import Path

    from filemq.common.config import ConfigError, flag_overrides, load_config

    try:
        settings = load_config(config_file, flag_overrides("ingest", flags)).ingest
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    landing, table, checkpoint = settings.landing, settings.table, settings.checkpoint
    missing = [f for f, v in (("--landing", landing), ("--table", table), ("--checkpoint", checkpoint)) if v is None]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or the same keys in [ingest] of the config file)")
    assert landing is not None and table is not None and checkpoint is not None
    every = settings.every_s
    payload, payload_schema, archive = settings.payload, settings.payload_schema, settings.archive
    if once and every is not None:
        raise click.UsageError("give --once or --every, not both")
    if payload == "json" and not payload_schema:
        raise click.UsageError("--payload json needs --payload-schema")
    if payload == "raw" and payload_schema:
        raise click.UsageError("--payload-schema needs --payload json")
    from spark_ingest.fleet_events import (
        fleet_events_config,
        has_fleet_events,
        run_with_fleet_events,
    )
    from spark_ingest.job import IngestConfig, IngestError, build_session
    from spark_ingest.schema import PayloadSchemaError

    if not as_json and logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("spark_ingest").setLevel(logging.INFO)  # per-batch progress
    config = IngestConfig(landing=Path(landing), table=Path(table), checkpoint=Path(checkpoint),
                          payload_schema=payload_schema, archive=Path(archive) if archive else None,
                          max_files_per_batch=settings.max_files_per_batch)
    events = None
    if has_fleet_events(config):  # the second table, fleet_events (docs/INGEST.md)
        events = fleet_events_config(
            config, table=Path(settings.fleet_events_table) if settings.fleet_events_table else None,
            checkpoint=Path(settings.fleet_events_checkpoint) if settings.fleet_events_checkpoint else None)
    spark = build_session(master=settings.spark_master)
    try:
        summary, events_summary = run_with_fleet_events(
            spark, config, events, once=every is None, every=float(every) if every else None,
            on_batch=(lambda table, r: click.echo(json.dumps({**r.as_dict(), "table": table}))) if as_json else None)
    except (IngestError, PayloadSchemaError) as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        spark.stop()
    if as_json:
        click.echo(json.dumps(summary.as_dict()))
        if events_summary is not None:
            click.echo(json.dumps({**events_summary.as_dict(), "table": "fleet_events"}))
    else:
        click.echo(f"{summary.batches} batches, {summary.files} files, {summary.rows_in:,} rows in, "
                   f"{summary.rows_written:,} written, {summary.duplicates_removed:,} duplicates removed, "
                   f"{len(summary.quarantined)} quarantined, {summary.seconds:.1f}s", err=True)
        if events_summary is not None:
            click.echo(f"fleet_events: {events_summary.rows_in:,} events in, {events_summary.rows_written:,} "
                       f"written, {events_summary.duplicates_removed:,} duplicates removed", err=True)


main.add_command(bench)  # filemq bench ... (bench/commands.py)

if __name__ == "__main__":
    main()
