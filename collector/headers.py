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
    values: list[list[Any]] = [[] for _ in PROPERTY_FIELDS]
    pfi, expiry, content_type, response_topic, correlation, user = values
    first = batch.first_offset
    for delta, headers in zip(batch.offset_deltas, batch.record_headers(), strict=True):
        props = None
        if headers:
            try:
                props = decode_message_headers(headers)
            except ValueError as exc:
                log.error("record %d of device %r stream %r: headers do not decode (%s); landed"
                          " without its message properties", first + delta, batch.device_id,
                          batch.stream, exc)
        if props is None:
            for column in values:
                column.append(None)
            continue
        pfi.append(props.payload_format_indicator)
        expiry.append(props.message_expiry_interval)
        content_type.append(props.content_type)
        response_topic.append(props.response_topic)
        correlation.append(props.correlation_data)
        user.append([{"key": k, "value": v} for k, v in props.user_properties] or None)
    return [pa.array(column, f.type) for column, f in zip(values, PROPERTY_FIELDS, strict=True)]
