"""The value checkers of the configuration schema, and the error every config problem raises.

Holds :class:`ConfigError` (with file, line and key), :func:`read_config_text` (a file the
configuration names, read as UTF-8), the size units ``KIB``/``MIB``/``GIB`` and the checkers
the sections in :mod:`filemq.common.config` declare for their keys: a checker takes a raw
value (from TOML, or from a flag, where it may still be a string) and returns the typed value
or raises ``_Bad`` saying what was expected.  Integers and sizes (``_int``), strings, booleans
and enums, ``HOST:PORT``, the broker's ``auto_subscribe`` rules (:class:`AutoSubscribe`), the
``[[export]]`` name, URL, filters and topic template, and the ``[[listener]]`` tables
(:class:`Listener`).

May import: the standard library and :mod:`filemq.common.topics` only (the loader in
:mod:`filemq.common.config` imports this module, never the other way round).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from filemq.common.topics import InvalidTopic, validate_topic_filter

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

COMMAND_LINE = "<command line>"


class ConfigError(ValueError):
    """A configuration problem a person can fix; carries where it is.

    ``file`` is the config file (or ``"<command line>"`` for a flag), ``line``/``column``
    are 1-based when known, ``key`` is the dotted key (``"broker.port"``) when one is at
    fault, and ``message`` is the human text without the file name.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        key: str | None = None,
        column: int | None = None,
    ) -> None:
        self.message = message
        self.file = file
        self.line = line
        self.key = key
        self.column = column
        super().__init__(f"{file}: {message}" if file else message)


def read_config_text(path: str | os.PathLike[str], what: str) -> str:
    """The text of a file the configuration names (password file, ACL file), as UTF-8.

    Raises :class:`ConfigError` naming the file and ``what`` it is when it cannot be read or
    is not UTF-8, so start-up fails with a sentence a person can act on.
    """
    file = os.fspath(path)
    try:
        return Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror}", file=file) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 ({exc.reason})", file=file) from exc


# -- value checkers -----------------------------------------------------------------------
# A checker takes a raw value (from TOML, or from a flag, where it may still be a string)
# and returns the typed value, or raises _Bad with what was expected.


class _Bad(Exception):
    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


Checker = Callable[[Any, bool], Any]

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": KIB, "m": MIB, "g": GIB}


def _int_value(value: Any, from_flag: bool, sizes: bool) -> int | None:
    if isinstance(value, bool):  # bool is an int subclass; `port = true` is a mistake
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and (sizes or from_flag):
        m = _SIZE_RE.match(value) if sizes else re.match(r"^\s*(\d+)\s*$", value)
        if m is None:
            return None
        unit = (m.group(2) or "").lower()[:1] if sizes else ""
        return int(m.group(1)) * _SIZE_UNITS[unit]
    return None


def _int(lo: int, hi: int | None = None, *, sizes: bool = False, note: str = "") -> Checker:
    rng = f"{lo}-{hi}" if hi is not None else f">= {lo}"
    what = f"an integer {rng}" + (" (or a size like '64 MiB')" if sizes else "") + note

    def check(value: Any, from_flag: bool) -> int:
        n = _int_value(value, from_flag, sizes)
        if n is None or n < lo or (hi is not None and n > hi):
            raise _Bad(what)
        return n

    return check


_PORT = _int(0, 65535, note=" (0 = any free port)")


def _str(value: Any, from_flag: bool) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Bad("a non-empty string")
    return value


def _bool(value: Any, from_flag: bool) -> bool:
    if isinstance(value, bool):
        return value
    if from_flag and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise _Bad("true or false")


def _enum(*choices: str) -> Checker:
    def check(value: Any, from_flag: bool) -> str:
        if not isinstance(value, str) or value not in choices:
            raise _Bad("one of " + ", ".join(repr(c) for c in choices))
        return value

    return check


def _host_port(value: Any, from_flag: bool) -> str:
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _Bad("a string 'host:port' with a port 1-65535")
    return str(value)


@dataclass(frozen=True)
class AutoSubscribe:
    """A subscription added to every persistent session on connect.

    ``filter`` may contain ``%c`` (client id) and ``%u`` (username), substituted by the broker.
    """

    filter: str
    qos: int = 1


def _valid_filter(text: str) -> bool:
    try:
        validate_topic_filter(text)
    except InvalidTopic:
        return False
    return True


_AUTO_SUB_RE = re.compile(r"^\s*(\S+)(?:\s+qos\s+([0-2]))?\s*$")


def _auto_subscribe(value: Any, from_flag: bool) -> tuple[AutoSubscribe, ...]:
    what = (
        "a list of {filter = \"cmd/%c/#\", qos = 1} tables "
        "(or strings like 'cmd/%c/# qos 1') with a valid MQTT filter and qos 0-2"
    )
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise _Bad(what)
    rules: list[AutoSubscribe] = []
    for item in value:
        if isinstance(item, AutoSubscribe):
            rules.append(item)
            continue
        if isinstance(item, str):
            m = _AUTO_SUB_RE.match(item)
            if m is None:
                raise _Bad(what)
            filt, qos = m.group(1), int(m.group(2) or 1)
        elif isinstance(item, dict) and set(item) <= {"filter", "qos"} and "filter" in item:
            filt, qos = item["filter"], item.get("qos", 1)
        else:
            raise _Bad(what)
        if (
            not isinstance(filt, str)
            or not _valid_filter(filt)
            or isinstance(qos, bool)
            or qos not in (0, 1, 2)
        ):
            raise _Bad(what)
        rules.append(AutoSubscribe(filt, qos))
    return tuple(rules)


_EXPORT_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EXPORT_SCHEMES = {"filemq": 1884, "filemqs": 8884, "mqtt": 1883, "mqtts": 8883}


def _export_name(value: Any, from_flag: bool) -> str:
    if not isinstance(value, str) or not _EXPORT_NAME_RE.match(value):
        raise _Bad("a name of 1-64 letters, digits, '_' or '-'")
    return value


def _export_url(value: Any, from_flag: bool) -> str:
    what = ("a URL filemq://HOST:PORT, filemqs://HOST:PORT (a filemq collector), mqtt://HOST[:PORT] "
            "or mqtts://HOST[:PORT] (any MQTT 5 or 3.1.1 broker), without user, password or path")
    if not isinstance(value, str):
        raise _Bad(what)
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise _Bad(what) from None
    if (parts.scheme not in EXPORT_SCHEMES or not parts.hostname or parts.username is not None
            or parts.path not in ("", "/") or parts.query or parts.fragment
            or (port is None and parts.scheme.startswith("filemq")) or port == 0):
        raise _Bad(what)
    return value


def _export_flags(value: Any, from_flag: bool) -> tuple[str, ...]:
    what = "NAME=URL (e.g. cloud=mqtts://broker.example.com:8883), one per --export"
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise _Bad(what)
    out: list[str] = []
    for item in items:
        name, sep, url = item.partition("=") if isinstance(item, str) else ("", "", "")
        if not sep:
            raise _Bad(what)
        try:
            _export_name(name, from_flag)
            _export_url(url, from_flag)
        except _Bad as bad:
            raise _Bad(f"{what}; {item!r}: {'the name' if not _EXPORT_NAME_RE.match(name) else 'the URL'} "
                       f"must be {bad.expected}") from None
        out.append(item)
    return tuple(out)


def _filters(value: Any, from_flag: bool) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(
            isinstance(f, str) and _valid_filter(f) for f in items):
        raise _Bad('a non-empty list of valid MQTT topic filters, like ["alarms/#", "sensors/+/temp"]')
    return tuple(dict.fromkeys(items))


_TEMPLATE_FIELDS = ("device_id", "topic", "name")


def _topic_template(value: Any, from_flag: bool) -> str:
    what = "a string using only {device_id}, {topic} and {name}, like \"site/{device_id}/{topic}\""
    if not isinstance(value, str) or not value:
        raise _Bad(what)
    try:
        out = value.format(**{k: "x" for k in _TEMPLATE_FIELDS})
    except (KeyError, IndexError, ValueError):
        raise _Bad(what) from None
    if "#" in out or "+" in out:
        raise _Bad(what + " and no wildcard")
    return value


@dataclass(frozen=True)
class Listener:
    """One listening socket of the broker (a ``[[listener]]`` table).

    ``protocol`` is ``"mqtt"`` (MQTT over TCP) or ``"websockets"`` (MQTT over WebSockets,
    subprotocol ``mqtt``; needs the ``websockets`` extra, i.e. ``wsproto``).  ``tls_cert`` +
    ``tls_key`` make it TLS; ``tls_ca`` verifies client certificates, which
    ``require_certificate`` makes mandatory; ``use_identity_as_username`` (as Mosquitto)
    takes the client certificate's CN as the username and does not consult the password
    file for it.  ``tls_crl`` (Mosquitto's ``crlfile``): a PEM certificate revocation list
    of ``tls_ca``; a client certificate it revokes fails the handshake (checked on every
    handshake, re-read with the other TLS files on SIGHUP).  ``allowed_origins`` (WebSockets only): the browser origins
    (``scheme://host[:port]``, or ``"*"`` for any) whose pages may connect; an upgrade that
    carries another ``Origin`` header gets HTTP 403, so that a web page the device's browser
    opens cannot reach the broker in its user's name (cross-site WebSocket hijacking).
    Clients that send no ``Origin``, or their own (host[:port] as in the ``Host`` header, as
    paho-mqtt does), are not affected.
    """

    host: str = "127.0.0.1"
    port: int = 1883
    protocol: str = "mqtt"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    require_certificate: bool = False
    use_identity_as_username: bool = False
    allowed_origins: tuple[str, ...] = ()
    tls_crl: str | None = None

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def describe(self) -> str:
        scheme = {"mqtt": "mqtt", "websockets": "ws"}[self.protocol] + ("s" if self.tls else "")
        return f"{scheme}://{self.host}:{self.port}"


_LISTENER_WHAT = (
    "a list of [[listener]] tables with host, port, protocol = \"mqtt\" | \"websockets\", "
    "tls_cert, tls_key, tls_ca, tls_crl, require_certificate, use_identity_as_username, allowed_origins "
    "(or strings 'HOST:PORT[,key=value...]')"
)


def _listener(item: Any, from_flag: bool, n: int) -> Listener:
    if isinstance(item, Listener):
        return item
    if isinstance(item, str):  # --listener 0.0.0.0:8883,tls_cert=c.pem,tls_key=k.pem
        first, *rest = item.split(",")
        host, sep, port = first.strip().rpartition(":")
        if not sep or not host:
            raise _Bad(_LISTENER_WHAT)
        raw: dict[str, Any] = {"host": host.strip("[]"), "port": port}
        for part in rest:
            k, eq, v = part.partition("=")
            if not eq:
                raise _Bad(_LISTENER_WHAT)
            raw[k.strip()] = v.strip()
        from_flag = True
    elif isinstance(item, dict):
        raw = dict(item)
    else:
        raise _Bad(_LISTENER_WHAT)
    names = {f.name for f in dataclasses.fields(Listener)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise _Bad(f"{_LISTENER_WHAT}; listener {n} has unknown key {unknown[0]!r}")
    checks: dict[str, Checker] = {
        "host": _str, "port": _PORT, "protocol": _enum("mqtt", "websockets"), "tls_cert": _str,
        "tls_key": _str, "tls_ca": _str, "require_certificate": _bool,
        "use_identity_as_username": _bool, "allowed_origins": _origins, "tls_crl": _str,
    }
    values: dict[str, Any] = {}
    for k, v in raw.items():
        try:
            values[k] = checks[k](v, from_flag)
        except _Bad as bad:
            raise _Bad(f"{_LISTENER_WHAT}; listener {n}: {k} must be {bad.expected}") from None
    lst = Listener(**values)
    problem = None
    if (lst.tls_cert is None) != (lst.tls_key is None):
        problem = "TLS needs both tls_cert and tls_key"
    elif lst.tls_ca is not None and not lst.tls:
        problem = "tls_ca verifies client certificates of a TLS listener; set tls_cert and tls_key"
    elif lst.tls_crl is not None and lst.tls_ca is None:
        problem = "tls_crl revokes client certificates of tls_ca; set tls_ca"
    elif lst.require_certificate and lst.tls_ca is None:
        problem = "require_certificate needs tls_ca (the CA that signs client certificates)"
    elif lst.use_identity_as_username and not lst.require_certificate:
        problem = "use_identity_as_username needs require_certificate = true"
    elif lst.allowed_origins and lst.protocol != "websockets":
        problem = "allowed_origins is for protocol = \"websockets\" (only browsers send an Origin)"
    if problem is not None:
        raise _Bad(f"{_LISTENER_WHAT}; listener {n} ({lst.host}:{lst.port}): {problem}")
    return lst


_ORIGIN = re.compile(r"(https?)://([a-z0-9.-]+|\[[0-9a-f:.]+\])(:[0-9]{1,5})?")


def _origins(value: Any, from_flag: bool) -> tuple[str, ...]:
    """A list of browser origins (``scheme://host[:port]``, lower case as browsers send them,
    or ``"*"``); from a flag, separated by ``|``."""
    expected = 'a list of origins such as "https://dashboard.local:8443" (or "*" for any)'
    if from_flag and isinstance(value, str):
        value = [v for v in value.split("|") if v]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _Bad(expected)
    out = []
    for v in value:
        origin = v.strip().lower().rstrip("/")
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise _Bad(f"{expected}, not {v!r}")
        out.append(origin)
    return tuple(out)


def _listeners(value: Any, from_flag: bool) -> tuple[Listener, ...]:
    if isinstance(value, (str, dict, Listener)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise _Bad(_LISTENER_WHAT)
    return tuple(_listener(item, from_flag, n) for n, item in enumerate(value, start=1))
