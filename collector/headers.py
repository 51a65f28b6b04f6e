"""A record's MQTT 5.0 message properties (its ``headers``) as landing columns.

The upstream batch carries each record's headers as opaque bytes
(:mod:`filemq.upstream.batch`, version 2): a property section without its length, as
:func:`filemq.mqtt.properties.encode_message_headers` writes it. Here they are checked at the
collector's door (:func:`check_headers`) and turned into the nullable landing columns
:data:`collector.landing.PROPERTY_FIELDS` (:func:`property_columns`).

What a caller may rely on: a record without headers, and every record of a version 1 batch,
gets null in every property column; a property the message did not carry is null; user
properties keep their order and repeats. Only rows with headers cost a Python step.
"""

from __future__ import annotations

import logging
from operator import itemgetter
from typing import Any

import pyarrow as pa

from collector.landing import PROPERTY_FIELDS
from filemq.mqtt.properties import decode_message_headers
from filemq.mqtt.wire import ProtocolError
from filemq.upstream.batch import Batch

log = logging.getLogger(__name__)


FULL_CHECKS_PER_BATCH = 1_000
"""Headers of a new layout a batch may have fully decoded at the door (~5 us each)."""


class HeaderCheck:
    """``decode_batch(check_headers=HeaderCheck())``, one per batch: :func:`check_headers` on
    its distinct headers, with the work bounded.  Headers shaped like ones checked before cost
    ~1 us each; at most :data:`FULL_CHECKS_PER_BATCH` of a new layout get the full decode.
    Past that (a sender whose every record has a layout of its own: free-text property values
    of every length), the rest are left to landing, which decodes every header anyway and
    lands a row whose headers do not decode without its properties, with an ERROR log
    (:func:`property_columns`); :attr:`deferred` counts them for the door's log."""

    __slots__ = ("deferred", "full_left")

    def __init__(self, full_checks: int = FULL_CHECKS_PER_BATCH) -> None:
        self.full_left = full_checks
        self.deferred = 0

    def __call__(self, headers: bytes) -> None:
        if _known_shape(headers):
            return
        if self.full_left <= 0:
            self.deferred += 1
            return
        self.full_left -= 1
        decode_message_headers(headers)
        _learn(headers)


def _known_shape(headers: bytes) -> bool:
    """True when ``headers`` has the shape of headers checked before and its strings are
    valid (raises ``ValueError`` when they are not); False when its shape is new."""
    shapes = _shapes.get(len(headers))
    if shapes is not None:
        for shape in shapes:
            if shape.fixed(headers) == shape.expected:
                shape.check_strings(headers)
                return True
    return False


def check_headers(headers: bytes) -> None:
    """Raise ``ValueError`` (:class:`filemq.mqtt.wire.ProtocolError`) unless ``headers`` is a
    valid message property section (only the six message properties, each type right, none
    repeated but the user property). For ``decode_batch(check_headers=...)``.

    The same verdict as :func:`~filemq.mqtt.properties.decode_message_headers`, for a fraction
    of its work on headers shaped like ones already checked (:class:`_Shape`): the door runs
    on the collector's event loop, and a batch of 10,000 records with distinct headers (a
    correlation id per message) held it ~50-130 ms."""
    if not _known_shape(headers):
        decode_message_headers(headers)
        _learn(headers)


class _Shape:
    """What every valid message property section of one layout shares: the bytes that steer
    the parse (identifiers, length fields, the payload format indicator's value) at their
    positions.  A section of the same length with the same such bytes parses into the same
    properties at the same places, so it is valid exactly when its strings are UTF-8 without
    U+0000 (four-byte integers and binary data take any value)."""

    __slots__ = ("expected", "fixed", "strings")

    def __init__(self, headers: bytes) -> None:
        positions: list[int] = []
        strings: list[slice] = []
        pos, n = 0, len(headers)
        while pos < n:  # (``headers`` passed the full check)
            ident = headers[pos]
            positions.append(pos)
            pos += 1
            if ident == 0x01:  # payload format indicator: its value (0 or 1) is steering too
                positions.append(pos)
                pos += 1
            elif ident == 0x02:  # message expiry interval: any four bytes
                pos += 4
            else:  # a string, binary data, or (0x26) a pair of strings: length-prefixed
                for _ in range(2 if ident == 0x26 else 1):
                    positions += (pos, pos + 1)
                    end = pos + 2 + ((headers[pos] << 8) | headers[pos + 1])
                    if ident != 0x09:  # (correlation data is binary: any bytes)
                        strings.append(slice(pos + 2, end))
                    pos = end
        positions.append(0)  # (the first identifier twice: itemgetter then always gives a tuple)
        self.fixed = itemgetter(*positions)
        self.expected = self.fixed(headers)
        self.strings = itemgetter(*strings, slice(0, 0), slice(0, 0))  # (the same: a tuple, + b"", b"")

    def check_strings(self, headers: bytes) -> None:
        """Raise ``ValueError`` unless every string of ``headers`` (of this shape) is UTF-8
        without U+0000 (MQTT-1.5.4-1, -2): one decode for all, split by NULs."""
        parts = self.strings(headers)
        joined = b"\x00".join(parts)
        if joined.count(0) != len(parts) - 1:
            raise ProtocolError("U+0000 in a string property", "MESSAGE")
        try:
            joined.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"invalid UTF-8 in a string property at byte {exc.start}", "MESSAGE") from None


# Shapes of headers that passed the full check, by length; bounded (cleared when full:
# at most _SHAPES_MAX // _SHAPES_PER_LENGTH lengths of _SHAPES_PER_LENGTH shapes each).
_shapes: dict[int, list[_Shape]] = {}
_SHAPES_MAX = 1024
_SHAPES_PER_LENGTH = 4


def _learn(headers: bytes) -> None:
    if not headers:
        return
    same = _shapes.get(len(headers))
    if same is None:
        if len(_shapes) >= _SHAPES_MAX // _SHAPES_PER_LENGTH:
            _shapes.clear()
        same = _shapes[len(headers)] = []
    if len(same) < _SHAPES_PER_LENGTH:
        same.append(_Shape(headers))


def property_columns(batch: Batch) -> list[pa.Array]:
    """The :data:`~collector.landing.PROPERTY_FIELDS` columns of ``batch``'s records, in order.

    Headers that do not decode (the door checks them, so only a WAL record written some other
    way) give nulls for that row, with an ERROR log: the row still lands.
    """
    n = len(batch)
    if not batch.has_headers:
        return [pa.nulls(n, f.type) for f in PROPERTY_FIELDS]
    rows: list[tuple[Any, ...]] = []
    # Records of one publisher often repeat their properties: decode each distinct one once.
    seen: dict[bytes, tuple[Any, ...]] = {b"": _NO_PROPERTIES}
    first = batch.first_offset
    for delta, headers in zip(batch.offset_deltas, batch.record_headers(), strict=True):
        row = seen.get(headers)
        if row is None:
            row = _row(headers, first + delta, batch)
            seen[headers] = row
        rows.append(row)
    columns = zip(*rows, strict=True)
    return [pa.array(column, f.type) for column, f in zip(columns, PROPERTY_FIELDS, strict=True)]


_NO_PROPERTIES: tuple[Any, ...] = (None,) * len(PROPERTY_FIELDS)


def _row(headers: bytes, offset: int, batch: Batch) -> tuple[Any, ...]:
    """The property column values of one record's (non-empty) headers."""
    try:
        props = decode_message_headers(headers)
    except ValueError as exc:
        log.error("record %d of device %r stream %r: headers do not decode (%s); landed without"
                  " its message properties", offset, batch.device_id, batch.stream, exc)
        return _NO_PROPERTIES
    if props is None:  # pragma: no cover - headers are non-empty here
        return _NO_PROPERTIES
    return (
        props.payload_format_indicator,
        props.message_expiry_interval,
        props.content_type,
        props.response_topic,
        props.correlation_data,
        [{"key": k, "value": v} for k, v in props.user_properties] or None,
    )
