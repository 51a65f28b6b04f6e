"""Mosquitto users move in: a ``mosquitto.conf`` read as filemq configuration.

:func:`convert` reads a Mosquitto 2 configuration file (following ``include_dir`` as
Mosquitto does: the directory's ``*.conf`` files in sorted order) and returns a
:class:`Conversion`: the filemq keys it maps to (``data_dir``, ``broker.*`` and
``[[listener]]`` tables), every option it does not take with the reason, and every option it
refuses because taking it would weaken a guarantee of docs/ARCHITECTURE.md (``persistence
false``: filemq never keeps acknowledged messages in memory only).  ``filemq broker`` and
``filemq agent`` take such a file with ``--mosquitto-conf FILE``; ``filemq mosquitto-conf
FILE`` prints the TOML equivalent.  What a caller may rely on:

* Every line is accounted for: mapped, not taken (``ignored``, with a reason a person can act
  on), or refused (``refused``); an option filemq does not know is named as such.
* A refused option makes the caller exit 2 (nothing is started on weaker terms).
* The mapped values go through the ordinary config loader (:func:`filemq.common.config.load_config`),
  so a bad value fails as any bad config value does; flags given with ``--mosquitto-conf``
  override what the file says.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filemq.common.checks import ConfigError

# Mosquitto option -> filemq key of the whole broker, and how to read the value.
_GLOBAL: dict[str, tuple[str, str]] = {
    "persistence_location": ("data_dir", "path"),
    "password_file": ("broker.password_file", "path"),
    "acl_file": ("broker.acl_file", "path"),
    "allow_anonymous": ("broker.allow_anonymous", "bool"),
    "max_packet_size": ("broker.max_packet_size", "int0"),
    "message_size_limit": ("broker.message_size_limit", "int0"),
    "max_keepalive": ("broker.keepalive_max", "int0"),
    "max_inflight_messages": ("broker.max_inflight", "inflight"),
    "sys_interval": ("broker.sys_interval_s", "int"),
    "max_connections": ("broker.max_connections", "connections"),
}
# Options of the listener they follow (or of the default listener, before any ``listener``).
_LISTENER: dict[str, tuple[str, str]] = {
    "certfile": ("tls_cert", "path"),
    "keyfile": ("tls_key", "path"),
    "cafile": ("tls_ca", "path"),
    "crlfile": ("tls_crl", "path"),
    "require_certificate": ("require_certificate", "bool"),
    "use_identity_as_username": ("use_identity_as_username", "bool"),
    "protocol": ("protocol", "protocol"),
}
_LOGGING = "filemq logs to stderr (the journal under systemd); more detail with filemq -v (info) or -vv (debug)"
_BRIDGE = "bridges are exports in filemq: an [[export]] table per destination (docs/FORWARDING.md)"
_PLUGIN = "filemq has no plugins: logins come from password_file (Mosquitto hashes work as they are), rights from acl_file"
_PSK = "filemq's TLS listeners use certificates (certfile, keyfile, cafile), not pre-shared keys"
# Options not taken, and why (what a person can do instead).
_IGNORED: dict[str, str] = {
    "persistence_file": "filemq's store is the directory persistence_location (the log, sessions, offsets), not one file",
    "autosave_interval": "filemq writes every message to its log and fsyncs it before the acknowledgement; there is nothing to save later",
    "autosave_on_changes": "filemq writes every message to its log and fsyncs it before the acknowledgement; there is nothing to save later",
    "pid_file": "systemd tracks the process (docs/DEPLOYMENT.md); filemq writes no pid file",
    "user": "run filemq under the systemd unit's User= (docs/DEPLOYMENT.md); it does not switch users itself",
    "log_dest": _LOGGING, "log_type": _LOGGING, "log_facility": _LOGGING, "log_timestamp": _LOGGING,
    "log_timestamp_format": _LOGGING, "connection_messages": _LOGGING, "websockets_log_level": _LOGGING,
    "max_queued_messages": "a client's backlog is the log on disk, not a queue in memory; log.retention_bytes bounds it",
    "max_queued_bytes": "a client's backlog is the log on disk, not a queue in memory; log.retention_bytes bounds it",
    "queue_qos0_messages": "a persistent session's backlog is the log; what it receives follows its subscriptions",
    "max_inflight_bytes": "filemq bounds the in-flight window in messages (max_inflight_messages -> broker.max_inflight)",
    "memory_limit": "filemq keeps the backlog on disk; its memory stays flat (docs/ARCHITECTURE.md, guarantee 5)",
    "persistent_client_expiration": "MQTT 3.1.1 persistent sessions do not expire in filemq; MQTT 5 clients set their Session Expiry Interval",
    "retain_available": "filemq always keeps retained messages",
    "upgrade_outgoing_qos": "filemq delivers at the lower of the message's and the subscription's QoS, as MQTT says",
    "allow_duplicate_messages": "filemq always delivers each message once per matching subscriber session",
    "check_retain_source": "filemq checks the publisher's rights when a retained message is stored",
    "allow_zero_length_clientid": "filemq assigns a client id to an MQTT 5 client that sends none (MQTT-3.1.3-6)",
    "auto_id_prefix": "filemq assigns client ids of its own form",
    "clientid_prefixes": "use acl_file rules to restrict what clients may do",
    "set_tcp_nodelay": "filemq sets TCP_NODELAY where it helps, by itself",
    "max_topic_alias": "filemq's topic alias maximum is broker.topic_alias_maximum",
    "websockets_headers_size": "filemq bounds a WebSocket upgrade at 16 KiB",
    "http_dir": "filemq's WebSocket listeners serve MQTT only, no files",
    "socket_domain": "filemq listens on the address given to listener (an IPv6 address for IPv6)",
    "bind_interface": "give the interface's address to listener instead",
    "mount_point": "filemq has no mount points; topic_template of an export prefixes topics upstream",
    "use_username_as_clientid": "not supported: the client id is the client's",
    "use_subject_as_username": "use_identity_as_username takes the certificate's CN",
    "tls_version": "filemq's TLS listeners speak TLS 1.2 and later, always",
    "ciphers": "filemq uses Python's default TLS cipher list",
    "ciphers_tls1.3": "filemq uses Python's default TLS cipher list",
    "capath": "filemq takes one CA bundle file: concatenate the certificates and give it to cafile",
    "dhparamfile": "filemq's TLS uses ECDHE key exchange",
    "ocsp_data": "not supported; revoke certificates with crlfile",
    "require_certificate_ocsp": "not supported; revoke certificates with crlfile",
    "psk_file": _PSK, "psk_hint": _PSK, "psk": _PSK,
    "auth_plugin": _PLUGIN, "plugin": _PLUGIN, "global_plugin": _PLUGIN,
    "password_file_hashed": _PLUGIN,
    "accept_protocol_versions": "filemq accepts MQTT 3.1, 3.1.1 and 5.0",
    "enable_control_api": "not supported",
}
_IGNORED_PREFIXES: tuple[tuple[str, str], ...] = (
    ("auth_opt_", _PLUGIN), ("plugin_opt_", _PLUGIN), ("global_plugin_opt_", _PLUGIN),
    ("bridge_", _BRIDGE), ("remote_", _BRIDGE), ("local_", _BRIDGE),
)
_BRIDGE_OPTIONS = frozenset({
    "connection", "address", "addresses", "topic", "cleansession", "keepalive_interval", "notifications",
    "notification_topic", "notifications_local_only", "start_type", "restart_timeout", "round_robin",
    "try_private", "idle_timeout", "threshold", "clientid", "username", "password",
})


@dataclass(frozen=True)
class Note:
    """One option not taken (or refused): where it is, what it is, and why."""

    file: str
    line: int
    option: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.option}: {self.reason}"


@dataclass
class Conversion:
    """What a ``mosquitto.conf`` says in filemq's terms (see the module doc)."""

    values: dict[str, Any] = field(default_factory=dict)  # dotted filemq keys
    listeners: list[dict[str, Any]] = field(default_factory=list)  # [[listener]] tables
    ignored: list[Note] = field(default_factory=list)
    refused: list[Note] = field(default_factory=list)

    def overrides(self) -> dict[str, Any]:
        """The values as :func:`filemq.common.config.load_config` overrides (``listener``
        included when the file has listeners)."""
        out = dict(self.values)
        if self.listeners:
            out["listener"] = tuple(dict(lst) for lst in self.listeners)
        return out

    def toml(self) -> str:
        """The TOML equivalent, for ``filemq mosquitto-conf``."""
        lines = ["# Converted from a mosquitto.conf by `filemq mosquitto-conf` (docs/CONFIG.md)."]
        top = {k: v for k, v in self.values.items() if "." not in k}
        for k, v in top.items():
            lines.append(f"{k} = {_toml_value(v)}")
        broker = {k.split(".", 1)[1]: v for k, v in self.values.items() if k.startswith("broker.")}
        if broker:
            lines += ["", "[broker]"] + [f"{k} = {_toml_value(v)}" for k, v in broker.items()]
        for lst in self.listeners:
            lines += ["", "[[listener]]"] + [f"{k} = {_toml_value(v)}" for k, v in lst.items()]
        for note in self.ignored:
            lines.append(f"# not taken: {note}")
        return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return json.dumps(str(v))  # a TOML basic string (JSON's escapes are TOML's)


def _lines(path: Path, seen: set[Path]) -> Iterator[tuple[str, int, str, list[str]]]:
    """(file, line number, option, arguments) of every option line, include_dir followed."""
    real = path.resolve()
    if real in seen:
        raise ConfigError(f"{path} is included twice (an include_dir loop)", file=str(path))
    seen.add(real)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the mosquitto configuration {path}: {exc}", file=str(path)) from exc
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        option, *args = line.split()
        if option == "include_dir":
            if len(args) != 1:
                raise ConfigError(f"{path}:{n}: include_dir takes one directory", file=str(path), line=n)
            directory = Path(args[0])
            if not directory.is_dir():
                raise ConfigError(f"{path}:{n}: include_dir {directory} is not a directory", file=str(path), line=n)
            for inc in sorted(directory.iterdir()):  # Mosquitto: *.conf, in sorted order
                if inc.suffix == ".conf" and inc.is_file():
                    yield from _lines(inc, seen)
            continue
        yield str(path), n, option, args


def _value(kind: str, args: list[str], where: str, option: str) -> Any:
    """A Mosquitto argument read as ``kind``; None: the Mosquitto default (filemq's stays)."""
    if len(args) != 1 and kind != "path":
        raise ConfigError(f"{where}: {option} takes one value, got {' '.join(args) or 'none'}")
    arg = " ".join(args)
    if not arg:
        raise ConfigError(f"{where}: {option} needs a value")
    if kind == "path":
        return arg
    if kind == "bool":
        if arg not in ("true", "false"):
            raise ConfigError(f"{where}: {option} must be true or false, got {arg!r}")
        return arg == "true"
    if kind == "protocol":
        if arg not in ("mqtt", "websockets"):
            raise ConfigError(f"{where}: protocol must be mqtt or websockets, got {arg!r}")
        return arg
    try:
        number = int(arg)
    except ValueError:
        raise ConfigError(f"{where}: {option} must be an integer, got {arg!r}") from None
    if kind == "int0":  # 0 (Mosquitto: no limit) keeps filemq's default
        return number or None
    if kind == "inflight":  # 0 = unlimited in Mosquitto; filemq's most is 65535
        return min(number, 65535) if number > 0 else 65535
    if kind == "connections":  # -1 = unlimited in Mosquitto: filemq's default stays
        return number if number > 0 else None
    return number


def convert(path: str | os.PathLike[str]) -> Conversion:
    """Read the Mosquitto configuration ``path``; raises :class:`ConfigError` for a file that
    cannot be read or a value Mosquitto itself would refuse."""
    out = Conversion()
    default: dict[str, Any] = {}  # the default listener: port / bind_address and options before any listener
    current: dict[str, Any] | None = None
    per_listener_mc = 0
    for file, n, option, args in _lines(Path(path), set()):
        where = f"{file}:{n}"
        note = Note(file, n, option + (" " + " ".join(args) if args else ""), "")
        if option == "persistence":
            if _value("bool", args, where, option) is False:
                out.refused.append(Note(file, n, note.option, "filemq never keeps acknowledged messages in memory only: "
                                        "every message is in the log, fsync'ed, before its acknowledgement (guarantee 1); "
                                        "remove the line or set persistence true"))
            continue
        if option == "per_listener_settings":
            if _value("bool", args, where, option):
                out.refused.append(Note(file, n, note.option, "filemq applies one password_file and acl_file to every "
                                        "listener; merging per-listener ones could let a client in where Mosquitto "
                                        "refused it; give the listeners one set of settings"))
            continue
        if option == "listener":
            if not 1 <= len(args) <= 2:
                raise ConfigError(f"{where}: listener takes a port and an optional address")
            try:
                port = int(args[0])
            except ValueError:
                raise ConfigError(f"{where}: listener port must be an integer, got {args[0]!r}") from None
            host = args[1] if len(args) == 2 else "0.0.0.0"
            if host.startswith("/") or port == 0 and len(args) == 2 and "/" in host:
                out.ignored.append(Note(file, n, note.option, "unix socket listeners are not supported; listen on 127.0.0.1"))
                current = {}
                continue
            current = {"host": host, "port": port}
            out.listeners.append(current)
            continue
        if option == "port":
            default["port"] = _value("int", args, where, option)
            continue
        if option == "bind_address":
            default["host"] = _value("path", args, where, option)
            continue
        if option in _LISTENER:
            key, kind = _LISTENER[option]
            target = current if current is not None else default
            target[key] = _value(kind, args, where, option)
            continue
        if option in _GLOBAL:
            key, kind = _GLOBAL[option]
            if option == "max_connections":
                per_listener_mc += 1
                if per_listener_mc == 2:
                    out.ignored.append(Note(file, n, note.option, "filemq's broker.max_connections counts every listener "
                                            "together; the largest value given is taken"))
                value = _value(kind, args, where, option)
                if value is not None:
                    out.values[key] = max(value, out.values.get(key, 0))
                continue
            value = _value(kind, args, where, option)
            if value is not None:
                out.values[key] = value
            continue
        reason = _IGNORED.get(option)
        if reason is None:
            reason = next((r for prefix, r in _IGNORED_PREFIXES if option.startswith(prefix)), None)
        if reason is None and option in _BRIDGE_OPTIONS:
            reason = _BRIDGE
        out.ignored.append(Note(file, n, note.option, reason or "not a Mosquitto option filemq knows; not taken"))
    if default:
        if out.listeners or "port" in default or set(default) - {"host"}:
            lst: dict[str, Any] = {"host": default.get("host", "0.0.0.0" if "port" in default else "127.0.0.1"),
                                   "port": default.get("port", 1883)}
            lst.update((k, v) for k, v in default.items() if k not in ("host", "port"))
            out.listeners.insert(0, lst)
        else:  # only bind_address: the default listener's address
            out.values["broker.host"] = default["host"]
    return out
