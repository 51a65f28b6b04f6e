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
from typing import Any

import pyarrow as pa

from collector.landing import PROPERTY_FIELDS
from filemq.mqtt.properties import decode_message_headers
from filemq.upstream.batch import Batch

log = logging.getLogger(__name__)


def check_headers(headers: bytes) -> None:
    """Raise ``ValueError`` (:class:`filemq.mqtt.wire.ProtocolError`) unless ``headers`` is a
    valid message property section (only the six message properties, each type right, none
    repeated but the user property). For ``decode_batch(check_headers=...)``."""
    decode_message_headers(headers)


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
