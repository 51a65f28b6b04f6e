"""The health report: what an agent tells its collector about itself, between data batches.

One report is the payload of one MQTT PUBLISH (QoS 0) on ``filemq/v1/<device_id>/$fleet/health``
over the agent's existing connection to the collector. The exact bytes are specified in
docs/FORMAT.md ("Health report"); in short::

    magic "FMQH", CRC-32C of every byte but the CRC field, version, reserved (3 bytes),
    sent_at_us (device clock), sequence, device_id, body_length, body (a UTF-8 JSON object)

The CRC is placed and computed as in the upstream batch (:mod:`filemq.upstream.batch`): it
covers the magic and every byte after the CRC field. The body is JSON so that fields can be
added without a new version; :data:`INT_FIELDS`, :data:`FLOAT_FIELDS`, :data:`STR_FIELDS` and
the ``exports`` list are the fields this version defines and checks.

The topic has three levels after ``filemq/v1/``, so it can never be taken for a batch topic
(``filemq/v1/<device_id>/<stream>``, where a stream may not contain ``/``), and it stays under
the ACL pattern a collector gives its devices (``pattern write filemq/v1/%u/#``).

What a caller may rely on:

* :func:`decode_health` returns a fully checked :class:`HealthReport` or raises exactly one of
  :class:`HealthCrcError` (the bytes were damaged on the way) or :class:`MalformedHealth`
  (the CRC matches but the content is not a valid report).
* ``decode_health(encode_health(...))`` gives back the same device, time, sequence and body.
* A report is at most :data:`MAX_REPORT_BYTES` bytes; :func:`encode_health` refuses more.

Only the standard library and ``crc32c`` are used (this module runs on devices).
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c

from filemq.upstream.batch import TOPIC_PREFIX, check_name

MAGIC = b"FMQH"
VERSION = 1
HEALTH_LEVELS = "$fleet/health"  # the topic levels after the device id
MAX_REPORT_BYTES = 64 * 1024
MAX_EXPORTS = 256

# magic, crc, version, reserved (3 bytes)
_PREFIX = struct.Struct("<4sIB3s")
# sent_at_us, sequence
_FIXED = struct.Struct("<qQ")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
CRC_START = 8
MIN_SIZE = _PREFIX.size + _FIXED.size + _U16.size + 1 + _U32.size + 2  # "{}" at least

# Body fields this version defines (all optional; a report carries what the agent knows).
INT_FIELDS = frozenset({
    "log_bytes", "disk_free_bytes", "clients_connected", "messages_received", "messages_dropped",
    "oversized_skipped", "recovery_corrupt_records", "recovery_truncated_bytes", "interval_s",
})
FLOAT_FIELDS = frozenset({"uptime_s"})
STR_FIELDS = frozenset({"agent_version", "build", "stream"})
EXPORT_INT_FIELDS = frozenset({"lag_records", "lag_bytes", "records_acked", "lost_records",
                               "oversized_skipped"})
EXPORT_FLOAT_FIELDS = frozenset({"oldest_unacked_age_s"})
EXPORT_STR_FIELDS = frozenset({"name", "kind", "state"})
# Top-level names the collector adds when it lands a report (collector/fleet_events.py): a body
# may not use them.
RESERVED_FIELDS = frozenset({"event", "sequence", "sent_at_us", "lag_records", "oldest_unacked_age_s"})


class HealthError(ValueError):
    """Base class: a byte string is not an acceptable health report."""


class HealthCrcError(HealthError):
    """The CRC-32C does not match: the bytes were damaged in transit."""


class MalformedHealth(HealthError):
    """The CRC matches but the content is not a valid health report (the sender's bug)."""


@dataclass(frozen=True, slots=True)
class HealthReport:
    """A decoded report: the device's id, its clock when sent, its sequence number (1 for the
    first report of an agent process, then counting up) and the checked JSON body, parsed and
    as its bytes (``body_json``: a JSON object's text, for passing on without encoding it again)."""

    device_id: str
    sent_at_us: int
    sequence: int
    body: dict[str, Any]
    body_json: bytes = b"{}"

    @property
    def exports(self) -> list[dict[str, Any]]:
        exports = self.body.get("exports")
        return exports if isinstance(exports, list) else []


def health_topic(device_id: str) -> str:
    """The topic ``device_id``'s health reports are published on."""
    return f"{TOPIC_PREFIX}{device_id}/{HEALTH_LEVELS}"


def parse_health_topic(topic: str) -> str | None:
    """The device id of a health topic, or None if ``topic`` is not one."""
    if not topic.startswith(TOPIC_PREFIX) or not topic.endswith("/" + HEALTH_LEVELS):
        return None
    device = topic[len(TOPIC_PREFIX) : -len(HEALTH_LEVELS) - 1]
    if not device or "/" in device:
        return None
    return device


def encode_health(device_id: str, sent_at_us: int, sequence: int, body: Mapping[str, Any]) -> bytes:
    """The report bytes. Raises ValueError for a bad device id, a body that does not pass
    :func:`check_body` or a report over :data:`MAX_REPORT_BYTES`."""
    device_raw = check_name("device id", device_id)
    checked = check_body(dict(body))
    raw = json.dumps(checked, separators=(",", ":"), allow_nan=False).encode("utf-8")
    rest = b"".join((
        bytes((VERSION, 0, 0, 0)),
        _FIXED.pack(sent_at_us, sequence),
        _U16.pack(len(device_raw)),
        device_raw,
        _U32.pack(len(raw)),
        raw,
    ))
    size = CRC_START + len(rest)
    if size > MAX_REPORT_BYTES:
        raise ValueError(f"health report of {size} bytes exceeds {MAX_REPORT_BYTES}")
    return MAGIC + _U32.pack(crc32c(rest, crc32c(MAGIC))) + rest


def decode_health(data: bytes | bytearray | memoryview) -> HealthReport:
    """Check and parse a report; see the module docstring for the two errors."""
    view = memoryview(data)
    size = len(view)
    if size < CRC_START:
        raise MalformedHealth(f"{size} bytes is shorter than the {CRC_START}-byte prefix")
    (crc,) = _U32.unpack_from(view, 4)
    actual = crc32c(view[CRC_START:], crc32c(view[:4]))
    if actual != crc:
        raise HealthCrcError(
            f"health report CRC-32C mismatch: header says {crc:#010x}, the {size} bytes give {actual:#010x}"
        )
    if size > MAX_REPORT_BYTES:
        raise MalformedHealth(f"{size} bytes exceeds the {MAX_REPORT_BYTES}-byte limit")
    if size < MIN_SIZE:
        raise MalformedHealth(f"{size} bytes is shorter than the smallest report ({MIN_SIZE})")
    magic, _, version, reserved = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise MalformedHealth(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a health report")
    if version != VERSION:
        raise MalformedHealth(f"unknown health report version {version} (this collector reads {VERSION})")
    if reserved != b"\0\0\0":
        raise MalformedHealth("reserved bytes are set")
    sent_at_us, sequence = _FIXED.unpack_from(view, _PREFIX.size)
    pos = _PREFIX.size + _FIXED.size
    (n,) = _U16.unpack_from(view, pos)
    pos += 2
    if pos + n + 4 > size:
        raise MalformedHealth(f"device id length {n} runs past the end")
    try:
        device_id = str(view[pos : pos + n], "utf-8")
        check_name("device id", device_id)
    except ValueError as exc:
        raise MalformedHealth(f"bad device id: {exc}") from None
    pos += n
    (body_length,) = _U32.unpack_from(view, pos)
    pos += 4
    if pos + body_length != size:
        raise MalformedHealth(f"body length {body_length} disagrees with the {size - pos} bytes left")
    try:
        body = json.loads(str(view[pos:], "utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedHealth(f"body is not UTF-8 JSON: {exc}") from None
    if not isinstance(body, dict):
        raise MalformedHealth("body is not a JSON object")
    try:
        check_body(body)
    except ValueError as exc:
        raise MalformedHealth(str(exc)) from None
    return HealthReport(device_id, sent_at_us, sequence, body, bytes(view[pos:]))


_INT, _FLOAT, _STR = 1, 2, 3
_INT64_MAX = (1 << 63) - 1  # (the fleet_events table's integers are 64-bit)
_DOUBLE_MAX = sys.float_info.max
# Field name -> kind, for one pass over what a body holds (a report is checked at every arrival).
_KINDS: dict[str, int] = {**dict.fromkeys(INT_FIELDS, _INT), **dict.fromkeys(FLOAT_FIELDS, _FLOAT),
                          **dict.fromkeys(STR_FIELDS, _STR)}
_EXPORT_KINDS: dict[str, int] = {**dict.fromkeys(EXPORT_INT_FIELDS, _INT),
                                 **dict.fromkeys(EXPORT_FLOAT_FIELDS, _FLOAT),
                                 **dict.fromkeys(EXPORT_STR_FIELDS, _STR)}


def _wrong_field(obj: dict[str, Any], kinds: dict[str, int]) -> str | None:
    """What is wrong with the first field of ``obj`` that has the wrong type, or None."""
    for key, value in obj.items():
        kind = kinds.get(key)
        if kind is None or value is None:
            continue
        vtype = type(value)
        if kind == _INT:
            if vtype is not int or not 0 <= value <= _INT64_MAX:
                return f"{key} must be a non-negative 64-bit integer or null, not {value!r}"
        elif kind == _FLOAT:
            # (NaN fails both comparisons, infinity and an int too large for a double the second.)
            if (vtype is not int and vtype is not float) or not 0 <= value <= _DOUBLE_MAX:
                return f"{key} must be a finite non-negative number or null, not {value!r}"
        elif not isinstance(value, str):
            return f"{key} must be a string or null, not {value!r}"
    return None


def check_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` if its known fields have the right types (unknown fields pass, reserved ones do
    not); else ValueError."""
    if not RESERVED_FIELDS.isdisjoint(body):
        reserved = RESERVED_FIELDS.intersection(body)
        raise ValueError(f"field(s) {', '.join(sorted(reserved))} are reserved (the collector adds them)")
    wrong = _wrong_field(body, _KINDS)
    if wrong is not None:
        raise ValueError(wrong)
    exports = body.get("exports")
    if exports is None:
        return body
    if not isinstance(exports, list) or len(exports) > MAX_EXPORTS:
        raise ValueError(f"exports must be a list of at most {MAX_EXPORTS} objects")
    for i, export in enumerate(exports):
        if not isinstance(export, dict) or not isinstance(export.get("name"), str):
            raise ValueError(f"exports[{i}] must be an object with a string name")
        wrong = _wrong_field(export, _EXPORT_KINDS)
        if wrong is not None:
            raise ValueError(f"exports[{i}].{wrong}")
    return body
