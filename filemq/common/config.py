"""The one configuration loader: a TOML file plus command-line overrides, checked up front.

``load_config(path, overrides)`` returns a :class:`Config` whose every value has been
type-checked and range-checked, with command-line flags winning over the file.  Anything
wrong (TOML syntax, an unknown or misspelt key, a wrong type, a bad enum value, a
contradictory combination) raises :class:`ConfigError` naming the file, line and key and
saying how to fix it, so a bad config fails start-up instead of half-running.

The keys, their flags and defaults are documented in ``docs/CONFIG.md``.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from filemq.common.checks import (
    _PORT,
    COMMAND_LINE,
    EXPORT_SCHEMES,
    _auto_subscribe,
    _bool,
    _enum,
    _export_flags,
    _export_name,
    _export_url,
    _filters,
    _host_port,
    _int,
    _listeners,
    _str,
    _topic_template,
)

# Re-exported: other modules import these from here (the value checkers live in checks.py).
from filemq.common.checks import GIB as GIB
from filemq.common.checks import KIB as KIB
from filemq.common.checks import MIB as MIB
from filemq.common.checks import AutoSubscribe as AutoSubscribe
from filemq.common.checks import Checker as Checker
from filemq.common.checks import ConfigError as ConfigError
from filemq.common.checks import Listener as Listener
from filemq.common.checks import _Bad as _Bad
from filemq.common.checks import read_config_text as read_config_text

# -- sections -----------------------------------------------------------------------------

# [broker] max_inflight's default (also the broker's Connection default; docs/CONFIG.md).
DEFAULT_MAX_INFLIGHT = 32

_POS = _int(1)
_NONNEG = _int(0)
_SIZE = _int(1, sizes=True)


def _spec(check: Checker) -> dict[str, Any]:
    return {"check": check}


@dataclass(frozen=True)
class LogSection:
    """The segment log: sizes, the fsync policy and retention (``[log]``)."""

    segment_bytes: int = field(
        default=64 * MIB, metadata=_spec(_int(4 * KIB, 2**32 - 1, sizes=True))
    )
    index_interval_bytes: int = field(default=4 * KIB, metadata=_spec(_SIZE))
    fsync: str = field(default="always", metadata=_spec(_enum("always", "interval", "never")))
    fsync_interval_ms: int = field(default=1000, metadata=_spec(_POS))
    retention_bytes: int | None = field(default=None, metadata=_spec(_SIZE))
    retention_ms: int | None = field(default=None, metadata=_spec(_POS))
    min_free_bytes: int = field(default=64 * MIB, metadata=_spec(_int(0, sizes=True)))
    # Group commits run on the event loop while an fdatasync takes at most this long, else on a
    # thread until syncs are quick again (segments.commit); 0 = always on the thread.
    commit_on_loop_max_ms: int = field(default=20, metadata=_spec(_int(0, 10_000)))


@dataclass(frozen=True)
class BrokerSection:
    """The local MQTT listener (``[broker]``)."""

    host: str = field(default="127.0.0.1", metadata=_spec(_str))
    port: int = field(default=1883, metadata=_spec(_PORT))
    password_file: str | None = field(default=None, metadata=_spec(_str))
    acl_file: str | None = field(default=None, metadata=_spec(_str))
    # None = the default rule: anonymous clients only when no password file is set (and the
    # validator refuses a non-loopback host without a password file unless this is true).
    allow_anonymous: bool | None = field(default=None, metadata=_spec(_bool))
    max_connections: int = field(default=1000, metadata=_spec(_POS))
    # Sockets accepted but not yet CONNECTed, counted apart from max_connections.
    max_connecting: int = field(default=128, metadata=_spec(_POS))
    # Failed password checks in a row from one source address (0 = never) after which that
    # address's checks start at most one per login_failure_delay_ms (filemq.broker.auth.LoginThrottle).
    login_failures_before_delay: int = field(default=5, metadata=_spec(_NONNEG))
    login_failure_delay_ms: int = field(default=1000, metadata=_spec(_int(1, 3_600_000)))
    # Connections the kernel holds (handshake done) while max_connecting are half-open
    # (filemq.broker.admission); capped by net.core.somaxconn.
    listen_backlog: int = field(default=4096, metadata=_spec(_int(1, 65535)))
    # Bytes accepted from publishers and not yet durable, at most (filemq.broker.budget);
    # None: 32 MiB for the broker, 256 MiB for the collector.
    max_uncommitted_bytes: int | None = field(default=None, metadata=_spec(_int(64 * KIB, sizes=True)))
    max_packet_size: int = field(default=1 * MIB, metadata=_spec(_int(64, 268_435_455, sizes=True)))
    # QoS 1/2 deliveries in flight per subscriber (EMQX's default, 32; mosquitto's is 20): the
    # window is refilled once at most a quarter of it is in flight (QosAcks._refill), so
    # it also sets how many deliveries share one write.
    max_inflight: int = field(default=DEFAULT_MAX_INFLIGHT, metadata=_spec(_int(1, 65535)))
    # TCP_QUICKACK after a read of a subscriber's acks that wrote nothing back (Linux;
    # filemq.broker.pacing): a client with Nagle's algorithm on is not held up by our delayed ACK.
    ack_pacing: bool = field(default=True, metadata=_spec(_bool))
    # SO_RCVLOWAT while a subscriber that acks one by one owes the acks of its next refill
    # (Linux; filemq.broker.batching): one wake-up per refill, not one per few PUBACKs.
    ack_batching: bool = field(default=True, metadata=_spec(_bool))
    # Memory for recent records (the tail cache), so subscribers read them without the disk.
    cache_bytes: int = field(default=16 * MIB, metadata=_spec(_int(64 * KIB, sizes=True)))
    max_topic_length: int = field(default=1024, metadata=_spec(_int(1, 65535)))
    # Largest PUBLISH / will payload in bytes; None = no limit of its own (max_packet_size bounds it).
    message_size_limit: int | None = field(default=None, metadata=_spec(_int(1, 268_435_455, sizes=True)))
    keepalive_max: int | None = field(default=None, metadata=_spec(_int(1, 65535)))
    # MQTT 5: unacknowledged QoS 1/2 PUBLISHes a client may have out to the broker (CONNACK
    # Receive Maximum; 65535 = the protocol's default, not sent); more: DISCONNECT 0x93.
    receive_maximum: int = field(default=1024, metadata=_spec(_int(1, 65535)))
    # MQTT 5: client-to-broker topic aliases per connection (CONNACK Topic Alias Maximum; 0 = none).
    topic_alias_maximum: int = field(default=10, metadata=_spec(_int(0, 65535)))
    tls_port: int = field(default=8883, metadata=_spec(_PORT))
    tls_cert: str | None = field(default=None, metadata=_spec(_str))
    tls_key: str | None = field(default=None, metadata=_spec(_str))
    sys_interval_s: int = field(default=10, metadata=_spec(_NONNEG))
    acl_denied_publish: str = field(default="ack_drop", metadata=_spec(_enum("ack_drop", "disconnect")))
    metrics_port: int | None = field(default=None, metadata=_spec(_PORT))
    auto_subscribe: tuple[AutoSubscribe, ...] = field(
        default=(), metadata=_spec(_auto_subscribe)
    )
    # The asyncio event loop: uvloop where installed ("auto"), or insist on one (filemq.ops.eventloop).
    event_loop: str = field(default="auto", metadata=_spec(_enum("auto", "uvloop", "asyncio")))

    def anonymous_allowed(self) -> bool:
        """Whether clients without a username may connect: ``allow_anonymous`` when set, else
        only without a password file (a password file means a login is required, on loopback
        too)."""
        if self.allow_anonymous is not None:
            return self.allow_anonymous
        return self.password_file is None

    @property
    def tls_enabled(self) -> bool:
        """True when a TLS listener on ``tls_port`` is configured."""
        return self.tls_cert is not None


@dataclass(frozen=True)
class AgentSection:
    """The device forwarder: where and how to ship the log upstream (``[agent]``)."""

    device_id: str | None = field(default=None, metadata=_spec(_str))
    collector: str | None = field(default=None, metadata=_spec(_host_port))
    username: str | None = field(default=None, metadata=_spec(_str))
    password: str | None = field(default=None, metadata=_spec(_str))
    password_file: str | None = field(default=None, metadata=_spec(_str))
    tls_ca: str | None = field(default=None, metadata=_spec(_str))
    batch_records: int = field(default=10_000, metadata=_spec(_POS))
    batch_bytes: int = field(default=1 * MIB, metadata=_spec(_SIZE))
    linger_ms: int = field(default=200, metadata=_spec(_NONNEG))
    window: int = field(default=4, metadata=_spec(_int(1, 1024)))
    compression: str = field(default="none", metadata=_spec(_enum("none", "zlib")))
    rate_limit_bytes_per_s: int | None = field(default=None, metadata=_spec(_SIZE))
    backoff_initial_ms: int = field(default=500, metadata=_spec(_POS))
    backoff_max_ms: int = field(default=60_000, metadata=_spec(_POS))
    metrics_port: int | None = field(default=None, metadata=_spec(_PORT))
    stream: str = field(default="main", metadata=_spec(_str))
    ack_timeout_ms: int = field(default=30_000, metadata=_spec(_POS))
    # ``--export NAME=URL`` (repeatable): an export, or the URL of the [[export]] table NAME.
    export: tuple[str, ...] = field(default=(), metadata=_spec(_export_flags))
    # The collector's packet limit (at least 64 MiB): a record too large for it is set aside.
    upstream_max_packet_size: int = field(default=64 * MIB, metadata=_spec(_int(1024, 268_435_455, sizes=True)))
    # Seconds between health reports to each collector export (and one at every connect); 0: none.
    health_interval_s: int = field(default=30, metadata=_spec(_int(0, 86_400)))


@dataclass(frozen=True)
class UplinkSection:
    """The device's uplink, shared by every export (``[uplink]``)."""

    rate_limit_bytes_per_s: int | None = field(default=None, metadata=_spec(_SIZE))


@dataclass(frozen=True)
class CollectorSection:
    """The upstream receiver that lands Parquet files (``[collector]``)."""

    host: str = field(default="127.0.0.1", metadata=_spec(_str))
    port: int = field(default=1884, metadata=_spec(_PORT))
    password_file: str | None = field(default=None, metadata=_spec(_str))
    acl_file: str | None = field(default=None, metadata=_spec(_str))
    allow_anonymous: bool | None = field(default=None, metadata=_spec(_bool))
    collector_id: str | None = field(default=None, metadata=_spec(_str))
    landing: str | None = field(default=None, metadata=_spec(_str))
    roll_bytes: int = field(default=64 * MIB, metadata=_spec(_SIZE))
    roll_seconds: int = field(default=60, metadata=_spec(_POS))
    metrics_port: int | None = field(default=None, metadata=_spec(_PORT))
    # None: sized from the file-descriptor limit (filemq.ops.fdlimit), not broker.max_connections.
    max_connections: int | None = field(default=None, metadata=_spec(_POS))
    # The operations HTTP port (metrics_port) binds here: loopback unless opened on purpose.
    ops_host: str = field(default="127.0.0.1", metadata=_spec(_str))
    # Fleet registry states (collector/fleet.py, docs/DEPLOYMENT.md "The fleet").
    fleet_behind_records: int = field(default=100_000, metadata=_spec(_POS))
    fleet_behind_age_s: int = field(default=3600, metadata=_spec(_POS))
    fleet_disk_low_bytes: int = field(default=256 * MIB, metadata=_spec(_int(0, sizes=True)))
    fleet_stale_intervals: int = field(default=3, metadata=_spec(_int(1, 1000)))
    fleet_device_labels: bool = field(default=False, metadata=_spec(_bool))
    fleet_max_devices: int = field(default=100_000, metadata=_spec(_int(1, 10_000_000)))

    def anonymous_allowed(self) -> bool:
        """Whether devices without a username may connect (same rule as the broker)."""
        if self.allow_anonymous is not None:
            return self.allow_anonymous
        return self.password_file is None


@dataclass(frozen=True)
class IngestSection:
    """The PySpark job: landing files in, curated table out (``[ingest]``)."""

    landing: str | None = field(default=None, metadata=_spec(_str))
    table: str | None = field(default=None, metadata=_spec(_str))
    checkpoint: str | None = field(default=None, metadata=_spec(_str))
    spark_master: str = field(default="local[2]", metadata=_spec(_str))
    payload: str = field(default="raw", metadata=_spec(_enum("raw", "json")))
    payload_schema: str | None = field(default=None, metadata=_spec(_str))
    archive: str | None = field(default=None, metadata=_spec(_str))
    every_s: int | None = field(default=None, metadata=_spec(_POS))
    max_files_per_batch: int = field(default=1000, metadata=_spec(_POS))
    # The second curated table (spark_ingest/fleet_events.py); None: fleet_events beside `table`,
    # `<checkpoint>_fleet_events`.
    fleet_events_table: str | None = field(default=None, metadata=_spec(_str))
    fleet_events_checkpoint: str | None = field(default=None, metadata=_spec(_str))


_OPT_POS = _int(1)


@dataclass(frozen=True)
class ExportSection:
    """One export (an ``[[export]]`` table, a ``--export NAME=URL`` flag, or ``agent.collector``):
    a durable consumer group ``export.NAME`` shipping the log to one destination."""

    name: str = field(default="", metadata=_spec(_export_name))
    url: str = field(default="", metadata=_spec(_export_url))
    topics: tuple[str, ...] = field(default=("#",), metadata=_spec(_filters))
    topic_template: str = field(default="{topic}", metadata=_spec(_topic_template))
    qos: int = field(default=1, metadata=_spec(_int(1, 2)))
    retain: bool = field(default=True, metadata=_spec(_bool))
    window: int | None = field(default=None, metadata=_spec(_int(1, 65535)))
    batch_records: int | None = field(default=None, metadata=_spec(_OPT_POS))
    batch_bytes: int | None = field(default=None, metadata=_spec(_SIZE))
    linger_ms: int | None = field(default=None, metadata=_spec(_NONNEG))
    compression: str | None = field(default=None, metadata=_spec(_enum("none", "zlib")))
    priority: int = field(default=0, metadata=_spec(_int(0, 1000)))
    rate_limit_bytes_per_s: int | None = field(default=None, metadata=_spec(_SIZE))
    client_id: str | None = field(default=None, metadata=_spec(_str))
    username: str | None = field(default=None, metadata=_spec(_str))
    password_file: str | None = field(default=None, metadata=_spec(_str))
    tls_ca: str | None = field(default=None, metadata=_spec(_str))
    tls_cert: str | None = field(default=None, metadata=_spec(_str))
    tls_key: str | None = field(default=None, metadata=_spec(_str))
    enabled: bool = field(default=True, metadata=_spec(_bool))
    # The destination's packet limit (AWS IoT Core: 128 KiB); None: agent.upstream_max_packet_size
    # for a collector export, no limit for an MQTT one. A record too large is set aside, counted.
    max_packet_size: int | None = field(default=None, metadata=_spec(_int(1024, 268_435_455, sizes=True)))
    # None: agent.ack_timeout_ms. MQTT exports: the oldest publish in flight unacknowledged this
    # long ends the connection (the window is resent with DUP); collector exports: a batch.
    ack_timeout_ms: int | None = field(default=None, metadata=_spec(_OPT_POS))
    # MQTT exports: "auto" (MQTT 5, 3.1.1 if the destination refuses it), "5" or "3.1.1".
    protocol: str = field(default="auto", metadata=_spec(_enum("auto", "5", "3.1.1")))
    # Only through the agent.collector shorthand (agent.password); tables use password_file.
    password: str | None = field(default=None, repr=False, metadata=_spec(_str))

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme

    @property
    def kind(self) -> str:
        """``"filemq"`` (batches to a collector) or ``"mqtt"`` (any MQTT 5 or 3.1.1 broker)."""
        return "filemq" if self.scheme.startswith("filemq") else "mqtt"

    @property
    def tls(self) -> bool:
        return self.scheme.endswith("s")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or EXPORT_SCHEMES[self.scheme]

    @property
    def group_name(self) -> str:
        """The durable consumer group of this export."""
        return f"export.{self.name}"


_COLLECTOR_ONLY = ("batch_records", "batch_bytes", "linger_ms", "compression")
_TABLE_KEYS = tuple(f.name for f in dataclasses.fields(ExportSection) if f.name != "password")


def _resolve_exports(config: Config, tables: Any, src: _Source, header_lines: list[int]) -> tuple[ExportSection, ...]:
    """[[export]] tables, then --export flags (a new export, or the URL of the table of that
    name), then the agent.collector shorthand (an export named ``collector``); all checked."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise src.error("export", "'export' must be an array of tables ([[export]] with name and url)")
    exports: dict[str, ExportSection] = {}
    for i, table in enumerate(tables):
        line = header_lines[i] if i < len(header_lines) else None
        label = f"[[export]] #{i + 1}" + (f" at line {line}" if line else "")

        def bad(key: str, message: str, label: str = label, line: int | None = line) -> ConfigError:
            return ConfigError(f"{label}: {message}", file=src.file, line=line, key=f"export.{key}")

        kw: dict[str, Any] = {}
        for key, value in table.items():
            if key not in _TABLE_KEYS:
                hint = difflib.get_close_matches(key, _TABLE_KEYS, n=1, cutoff=0.6)
                extra = f"; did you mean '{hint[0]}'?" if hint else "; see docs/FORWARDING.md for the keys"
                raise bad(key, f"unknown key '{key}'{extra}")
            try:
                kw[key] = _checker(ExportSection, key)(value, False)
            except _Bad as exc:
                got = value if isinstance(value, (str, int, float, bool)) else type(value).__name__
                raise bad(key, f"{key} must be {exc.expected}, got {got!r}") from None
        for required in ("name", "url"):
            if required not in kw:
                raise bad(required, f"'{required}' is required (name = \"cloud\", url = \"mqtts://host:8883\")")
        if kw["name"] in exports:
            raise bad("name", f"export name {kw['name']!r} is used twice; names must be unique")
        exports[kw["name"]] = ExportSection(**kw)
    flag_src = _Source(COMMAND_LINE, None)
    for item in config.agent.export:
        name, _, url = item.partition("=")
        exports[name] = dataclasses.replace(exports[name], url=url) if name in exports else ExportSection(name, url)
    a = config.agent
    if a.collector is not None:
        if "collector" in exports:
            raise flag_src.error("agent.collector", "agent.collector (flag --collector) is the shorthand for an "
                                 "export named 'collector', but one is already defined; keep one")
        scheme = "filemqs" if a.tls_ca is not None else "filemq"
        exports["collector"] = ExportSection(
            "collector", f"{scheme}://{a.collector}", username=a.username, password=a.password,
            password_file=a.password_file, tls_ca=a.tls_ca)
    for e in exports.values():
        where = f"export {e.name!r}"
        if e.kind == "mqtt":
            given = [k for k in _COLLECTOR_ONLY if getattr(e, k) is not None]
            if given:
                raise ConfigError(f"{where}: {', '.join(given)} only apply to filemq:// collector exports, "
                                  f"not to {e.url}", file=src.file, key=f"export.{given[0]}")
        if (e.tls_cert is None) != (e.tls_key is None):
            raise ConfigError(f"{where}: tls_cert and tls_key go together (mutual TLS needs both)",
                              file=src.file, key="export.tls_cert")
        if (e.tls_cert is not None or e.tls_ca is not None) and not e.tls:
            raise ConfigError(f"{where}: tls_ca/tls_cert are set but the URL {e.url} is not TLS; "
                              f"use {e.scheme}s://", file=src.file, key="export.url")
    return tuple(exports.values())


@dataclass(frozen=True)
class Config:
    """Every setting, typed and validated; build it with :func:`load_config`."""

    data_dir: str | None = field(default=None, metadata=_spec(_str))
    # The broker's listeners; empty = the shorthand broker.host/port (+ tls_port with tls_cert).
    listener: tuple[Listener, ...] = field(default=(), metadata=_spec(_listeners))
    log: LogSection = field(default_factory=LogSection)
    broker: BrokerSection = field(default_factory=BrokerSection)
    agent: AgentSection = field(default_factory=AgentSection)
    collector: CollectorSection = field(default_factory=CollectorSection)
    ingest: IngestSection = field(default_factory=IngestSection)
    uplink: UplinkSection = field(default_factory=UplinkSection)
    # Every export of the agent, resolved: [[export]] tables, --export flags and the
    # agent.collector shorthand (an export named "collector"); see ExportSection.
    exports: tuple[ExportSection, ...] = ()


_SECTIONS: dict[str, type[Any]] = {
    "log": LogSection,
    "broker": BrokerSection,
    "agent": AgentSection,
    "collector": CollectorSection,
    "ingest": IngestSection,
    "uplink": UplinkSection,
}
_TOP_LEVEL = ("data_dir", "listener")


def _checker(section_cls: type[Any], name: str) -> Checker:
    for f in dataclasses.fields(section_cls):
        if f.name == name:
            check: Checker = f.metadata["check"]
            return check
    raise KeyError(name)


def known_keys() -> list[str]:
    """Every dotted key the loader accepts (``"data_dir"``, ``"broker.port"``, ...)."""
    keys = list(_TOP_LEVEL)
    for section, cls in _SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


# Keys whose flag is not derived from the key name (the names the issue texts fixed).
_FLAG_ALIASES = {"ingest.spark_master": "--master", "ingest.every_s": "--every",
                 "uplink.rate_limit_bytes_per_s": "--uplink-rate-limit"}


def flag_for(key: str) -> str:
    """The command-line flag of a dotted key: ``broker.tls_cert`` -> ``--tls-cert``."""
    return _FLAG_ALIASES.get(key) or "--" + key.rsplit(".", 1)[-1].replace("_", "-")


def section_keys(section: str) -> list[tuple[str, bool]]:
    """The dotted keys of one ``[section]`` with whether each takes a list of values."""
    return [
        (f"{section}.{f.name}", str(f.type).startswith(("tuple", "list")))
        for f in dataclasses.fields(_SECTIONS[section])
    ]


def flag_overrides(section: str, flags: Mapping[str, Any]) -> dict[str, Any]:
    """Turn a command's click parameters into ``load_config`` overrides.

    ``flags`` maps parameter names (``port``, ``data_dir``, ``fsync``) to values; ``None``
    values (flag not given) are dropped.  ``data_dir`` is top level, names of ``[log]`` keys
    go to ``log.``, ``<other>__<key>`` to ``<other>.<key>`` (the agent's ``broker__port``),
    everything else to ``<section>.``; names that are no config key (such as ``config`` or
    ``json``) are ignored, so a command can pass all its parameters.
    """
    log_keys = {f.name for f in dataclasses.fields(LogSection)}
    own_keys = {f.name for f in dataclasses.fields(_SECTIONS[section])}
    out: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None or value == ():
            continue
        if isinstance(value, tuple):  # a repeated flag (click's multiple=True)
            value = list(value)
        other, sep, key = name.partition("__")
        if sep and other in _SECTIONS:  # ``broker__max_connections``: a key of another section
            out[f"{other}.{key}"] = value
        elif name in _TOP_LEVEL:
            out[name] = value
        elif name in own_keys:
            out[f"{section}.{name}"] = value
        elif name in log_keys:
            out[f"log.{name}"] = value
    return out


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything


# -- locating keys in the raw text --------------------------------------------------------

_EXPORT_HEADER_RE = re.compile(r"^\s*\[\[\s*export\s*\]\]")
_HEADER_RE = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_RE = re.compile(r"^\s*([A-Za-z0-9_\-\"'. ]+?)\s*=")


def _unquote_key(key: str) -> str:
    return ".".join(p.strip().strip("\"'") for p in key.split("."))


def _key_lines(text: str) -> dict[str, int]:
    """Best-effort map dotted key -> first line where it is set (or table header line).

    Scans line by line; keys inside multi-line arrays or strings are not found, in which
    case errors fall back to the section's header line.
    """
    lines: dict[str, int] = {}
    table = ""
    for lineno, raw in enumerate(text.splitlines(), start=1):
        m = _HEADER_RE.match(raw)
        if m:
            table = _unquote_key(m.group(1))
            lines.setdefault(table, lineno)
            continue
        m = _KEY_RE.match(raw)
        if m:
            key = _unquote_key(m.group(1))
            lines.setdefault(f"{table}.{key}" if table else key, lineno)
    return lines


class _Source:
    """Where values come from, for error messages."""

    def __init__(self, file: str, text: str | None) -> None:
        self.file = file
        self.lines = _key_lines(text) if text is not None else {}

    def line_of(self, key: str) -> int | None:
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key.rpartition(".")[0]
        return None

    def where(self, key: str) -> str:
        if self.file == COMMAND_LINE:
            return f" (flag {flag_for(key)})"
        line = self.line_of(key)
        return f" at line {line}" if line is not None else ""

    def error(self, key: str, message: str) -> ConfigError:
        line = None if self.file == COMMAND_LINE else self.line_of(key)
        return ConfigError(message, file=self.file, line=line, key=key)


def _unknown(src: _Source, key: str) -> ConfigError:
    candidates = known_keys() + list(_SECTIONS)
    hint = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    extra = f"; did you mean '{hint[0]}'?" if hint else "; see docs/CONFIG.md for the keys"
    return src.error(key, f"unknown key '{key}'{src.where(key)}{extra}")


def _checked(src: _Source, key: str, check: Checker, value: Any) -> Any:
    try:
        return check(value, src.file == COMMAND_LINE)
    except _Bad as bad:
        got = value if isinstance(value, (str, int, float, bool)) else type(value).__name__
        message = f"{key}{src.where(key)} must be {bad.expected}, got {got!r}"
        raise src.error(key, message) from None


def _flatten(doc: Mapping[str, Any], src: _Source) -> dict[str, Any]:
    """TOML document -> {dotted key: raw value}; unknown keys raise."""
    flat: dict[str, Any] = {}
    for name, value in doc.items():
        if name in _TOP_LEVEL:
            flat[name] = value
        elif name in _SECTIONS:
            if not isinstance(value, dict):
                raise src.error(name, f"'{name}'{src.where(name)} must be a table ([{name}])")
            section_keys = {f.name for f in dataclasses.fields(_SECTIONS[name])}
            for key, sub in value.items():
                dotted = f"{name}.{key}"
                if key not in section_keys:
                    raise _unknown(src, dotted)
                flat[dotted] = sub
        elif isinstance(value, dict) and value:
            raise _unknown(src, f"{name}.{next(iter(value))}")
        else:
            raise _unknown(src, name)
    return flat


def load_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Config:
    """Load ``path`` (TOML; ``None`` = no file, defaults only) and apply ``overrides``.

    ``overrides`` maps dotted keys (``"broker.port"``, ``"data_dir"``) to values from
    command-line flags; they win over the file, and ``None`` values are ignored (the flag was
    not given).  Every value is checked; the first problem raises :class:`ConfigError`.
    """
    values: dict[str, tuple[_Source, Any]] = {}
    file_src: _Source | None = None
    export_tables: Any = []
    export_lines: list[int] = []
    if path is not None:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config file: {exc.strerror}", file=str(path)) from exc
        try:
            text = raw.decode("utf-8")
            doc = tomllib.loads(text)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"not UTF-8 text ({exc.reason})", file=str(path)) from exc
        except tomllib.TOMLDecodeError as exc:
            line, col = _toml_position(str(exc))
            raise ConfigError(
                f"TOML syntax error: {exc}", file=str(path), line=line, column=col
            ) from exc
        file_src = _Source(str(path), text)
        export_tables = doc.pop("export", [])
        export_lines = [n for n, raw in enumerate(text.splitlines(), start=1) if _EXPORT_HEADER_RE.match(raw)]
        for key, value in _flatten(doc, file_src).items():
            values[key] = (file_src, value)
    flag_src = _Source(COMMAND_LINE, None)
    known = set(known_keys())
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in known:
            raise _unknown(flag_src, key)
        values[key] = (flag_src, value)

    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for key, (src, value) in values.items():
        section, _, name = key.rpartition(".")
        if not section:
            top[name] = _checked(src, key, _checker(Config, name), value)
        else:
            parts[section][name] = _checked(src, key, _checker(_SECTIONS[section], name), value)
    config = Config(**top, **{name: _SECTIONS[name](**kw) for name, kw in parts.items()})
    exports = _resolve_exports(config, export_tables, file_src or flag_src, export_lines)
    if exports:
        config = dataclasses.replace(config, exports=exports)
    _check_combinations(config, values, file_src or flag_src)
    return config


def _toml_position(message: str) -> tuple[int | None, int | None]:
    m = re.search(r"line (\d+), column (\d+)", message)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def _check_combinations(
    config: Config, values: Mapping[str, tuple[_Source, Any]], default_src: _Source
) -> None:
    def src_of(key: str) -> _Source:
        return values[key][0] if key in values else default_src

    def err(key: str, message: str) -> ConfigError:
        return src_of(key).error(key, message)

    def where(key: str) -> str:
        return src_of(key).where(key) if key in values else ""

    b = config.broker
    if (b.tls_cert is None) != (b.tls_key is None):
        have, missing = ("tls_cert", "tls_key") if b.tls_key is None else ("tls_key", "tls_cert")
        raise err(
            f"broker.{have}",
            f"broker.{have}{where('broker.' + have)} is set but broker.{missing} is not; "
            f"TLS needs both (set broker.{missing}, or flag {flag_for(missing)})",
        )
    for name, sec in (("broker", b), ("collector", config.collector)):
        _check_anonymous(name, sec.host, sec.password_file, sec.allow_anonymous, err, where)
    _check_listeners(config, values, err, where)

    a = config.agent
    if a.password is not None and a.password_file is not None:
        raise err(
            "agent.password",
            f"agent.password{where('agent.password')} and agent.password_file are both set; "
            "keep one (agent.password_file keeps the secret out of the config file)",
        )
    if a.backoff_initial_ms > a.backoff_max_ms:
        raise err(
            "agent.backoff_initial_ms",
            f"agent.backoff_initial_ms{where('agent.backoff_initial_ms')} "
            f"({a.backoff_initial_ms}) is larger than agent.backoff_max_ms ({a.backoff_max_ms})",
        )


def broker_listeners(config: Config) -> tuple[Listener, ...]:
    """The broker's listeners: the ``[[listener]]`` tables, or else the shorthand
    ``broker.host``:``broker.port`` plus a TLS one on ``broker.tls_port`` when ``tls_cert``
    is set."""
    if config.listener:
        return config.listener
    b = config.broker
    out = [Listener(host=b.host, port=b.port)]
    if b.tls_cert is not None:
        out.append(Listener(host=b.host, port=b.tls_port, tls_cert=b.tls_cert, tls_key=b.tls_key))
    return tuple(out)


_SHORTHAND = ("broker.host", "broker.port", "broker.tls_port", "broker.tls_cert", "broker.tls_key")


def _check_listeners(
    config: Config,
    values: Mapping[str, tuple[_Source, Any]],
    err: Callable[[str, str], ConfigError],
    where: Callable[[str], str],
) -> None:
    if not config.listener:
        return
    both = [k for k in _SHORTHAND if k in values]
    if both:
        raise err(
            both[0],
            f"{both[0]}{where(both[0])} and [[listener]] tables are both set; the listener list "
            f"replaces the shorthand broker.host/port/tls_* (flags --host/--port/--tls-*): "
            f"keep one",
        )
    b = config.broker
    seen: dict[tuple[str, int], int] = {}
    for n, lst in enumerate(config.listener, start=1):
        first = seen.setdefault((lst.host, lst.port), n)
        if lst.port != 0 and first != n:
            raise err("listener", f"listeners {first} and {n}{where('listener')} are both on "
                                  f"{lst.host}:{lst.port}; give each its own port")
    for n, lst in enumerate(config.listener, start=1):
        cert_login = lst.require_certificate and lst.use_identity_as_username
        if is_loopback(lst.host) or cert_login or b.password_file is not None or b.allow_anonymous:
            continue
        raise err(
            "listener",
            f"listener {n} ({lst.host}:{lst.port}){where('listener')} accepts connections from "
            f"other machines, but no password file is set. Set broker.password_file, use client "
            f"certificates (require_certificate and use_identity_as_username), or set "
            f"broker.allow_anonymous = true",
        )


def _check_anonymous(
    section: str,
    host: str,
    password_file: str | None,
    allow_anonymous: bool | None,
    err: Callable[[str, str], ConfigError],
    where: Callable[[str], str],
) -> None:
    if password_file is None and allow_anonymous is None and not is_loopback(host):
        key = f"{section}.host"
        raise err(
            key,
            f"{key} = {host!r}{where(key)} accepts connections from other machines, but no "
            f"password file is set. Either create one with `filemq passwd FILE USER` and set "
            f"{section}.password_file = \"FILE\" (flag --password-file FILE), or, to let anyone "
            f"on the network connect without a password, set {section}.allow_anonymous = true",
        )
    if password_file is None and allow_anonymous is False:
        key = f"{section}.allow_anonymous"
        raise err(
            key,
            f"{key} = false{where(key)} but {section}.password_file is not set, so no client "
            f"could log in; set {section}.password_file or remove {key}",
        )


def key_of_param(section: str, param: str) -> str | None:
    """The dotted key a command's click parameter sets (see :func:`flag_overrides`), or None."""
    return next(iter(flag_overrides(section, {param: "x"})), None)
