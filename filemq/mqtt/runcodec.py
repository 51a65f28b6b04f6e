"""Encoders of runs of QoS 1 PUBLISH packets (the broker's fanout run path, issue 16): the
packets of many messages to one client with consecutive packet ids, built with C-level
``map``/``zip`` passes and one join instead of one :func:`~filemq.mqtt.codec.publish_bytes`
call each; byte for byte what those calls would give (tests/test_broker_session.py::
test_publish_run_matches_publish_bytes).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from operator import add

from filemq.mqtt.codec import _cache_topic, _topic_bytes
from filemq.mqtt.properties import read_vbi
from filemq.mqtt.wire import _fixed_header, _pack_H
from segments.record import Record, record_headers, record_qos, record_retain

__all__ = ["all_plain", "publish_prefixes", "publish_run", "publish_run_prefixed"]


def all_plain(records: Sequence[Record]) -> bool:
    """Whether every record can go out in a run as a plain PUBLISH: no MQTT 5 headers, not
    retained, QoS 1 or 2 (C-level passes; the run path's and the tail cache's one test)."""
    return not (any(map(record_headers, records)) or any(map(record_retain, records))
                or min(map(record_qos, records)) < 1)


# Fixed headers of MQTT 5 QoS 1 PUBLISHes without DUP and RETAIN, with an empty property
# section, by topic field + payload size; bounded: cleared when it grows past
# _HEADS_CACHE_SIZE entries.
_heads1_5: dict[int, bytes] = {}
_HEADS_CACHE_SIZE = 1024


def publish_run(topics: Sequence[str], payloads: Sequence[bytes], first_pid: int, v5: bool = False) -> bytes:
    """The QoS 1 PUBLISH packets (DUP 0, RETAIN 0, no properties) of a run of messages with
    the packet ids ``first_pid``, ``first_pid + 1``, ... (at most 0xFFFF), concatenated:
    byte for byte ``b"".join(publish_bytes(t, p, 1, False, first_pid + i) ...)`` (``v5``:
    :func:`publish_bytes5`, with an empty property section), with the per-message work done
    by C loops (``map``/``zip``) and one join for the run (the broker's fanout delivery path).
    MQTT 3.1.1 is :func:`publish_run_prefixed` of :func:`publish_prefixes`."""
    if not v5:
        return publish_run_prefixed(publish_prefixes(topics, payloads), payloads, first_pid)
    cached = _topic_bytes.get
    tmap = {t: cached(t) or _cache_topic(t) for t in set(topics)}
    tbs = list(map(tmap.__getitem__, topics))
    sizes = list(map(add, map(len, tbs), map(len, payloads)))
    heads = _heads1_5
    missing = set(sizes).difference(heads)
    if missing:
        if len(heads) + len(missing) > _HEADS_CACHE_SIZE:
            heads.clear()
            missing = set(sizes)
        for size in missing:
            heads[size] = _fixed_header(0x32, size + 3)
    n = len(tbs)
    parts: list[bytes] = [b"\x00"] * (5 * n)  # (every fifth piece stays: the empty property section)
    parts[0::5] = map(heads.__getitem__, sizes)
    parts[1::5] = tbs
    parts[2::5] = map(_pack_H, range(first_pid, first_pid + n))
    parts[4::5] = payloads
    return b"".join(parts)


# MQTT 3.1.1 QoS 1 PUBLISH prefixes by (topic, payload size); bounded as _topic_bytes.
_prefixes: dict[tuple[str, int], bytes] = {}


def publish_prefixes(topics: Sequence[str], payloads: Sequence[bytes]) -> list[bytes]:
    """Per message, the bytes of its MQTT 3.1.1 QoS 1 PUBLISH (DUP 0, RETAIN 0) before the
    packet id: fixed header and topic field.  ``prefix + id + payload`` is the packet, so a
    run of them is :func:`publish_run_prefixed`.  Equal (topic, size) pairs share one bytes
    object (the broker's tail cache keeps one per record)."""
    out = list(map(_prefixes.get, zip(topics, map(len, payloads), strict=True)))
    if not all(out):  # (a prefix is never empty: only a miss, None, is false)
        if len(_prefixes) >= 4096:
            _prefixes.clear()
        cached = _topic_bytes.get
        for k, (topic, payload) in enumerate(zip(topics, payloads, strict=True)):
            if out[k] is None:
                tb = cached(topic) or _cache_topic(topic)
                prefix = _prefixes[(topic, len(payload))] = _fixed_header(0x32, len(tb) + len(payload) + 2) + tb
                out[k] = prefix
    return out  # type: ignore[return-value]  # (no None left)


# MQTT 5 QoS 1 PUBLISH prefixes (no properties) by the MQTT 3.1.1 prefix of the same message;
# bounded as _prefixes.
_prefixes5: dict[bytes, bytes] = {}


def publish_prefixes5(prefixes: Sequence[bytes]) -> list[bytes]:
    """Per message, the bytes of its MQTT 5.0 QoS 1 PUBLISH without properties before the
    packet id, from its MQTT 3.1.1 prefix (:func:`publish_prefixes`): the same topic field
    behind a remaining length one larger (the empty property section after the id).
    ``prefix5 + id + 00 + payload`` is the packet: :func:`publish_run_prefixed5`."""
    out = list(map(_prefixes5.get, prefixes))
    if not all(out):  # (a prefix is never empty: only a miss, None, is false)
        if len(_prefixes5) >= 4096:
            _prefixes5.clear()
        for k, prefix in enumerate(prefixes):
            if out[k] is None:
                out[k] = _prefixes5[prefix] = _prefix5_of(prefix)
    return out  # type: ignore[return-value]  # (no None left)


def _prefix5_of(prefix: bytes) -> bytes:
    remaining, at = read_vbi(prefix, 1, len(prefix), "remaining length", "PUBLISH")
    return _fixed_header(prefix[0], remaining + 1) + prefix[at:]


def publish_run_prefixed5(prefixes5: Sequence[bytes], payloads: Sequence[bytes], first_pid: int) -> bytes:
    """:func:`publish_run` with ``v5`` from :func:`publish_prefixes5` of the same messages:
    the same bytes, with only the ids and one join left to do per run."""
    n = len(prefixes5)
    if len(payloads) != n:
        raise ValueError(f"{n} prefixes for {len(payloads)} payloads")
    parts: list[bytes] = [b"\x00"] * (4 * n)  # (every third of four stays: the empty property section)
    parts[0::4] = prefixes5
    parts[1::4] = map(_pack_H, range(first_pid, first_pid + n))
    parts[3::4] = payloads
    return b"".join(parts)


def publish_run_prefixed(prefixes: Sequence[bytes], payloads: Sequence[bytes], first_pid: int) -> bytes:
    """:func:`publish_run` (MQTT 3.1.1) from :func:`publish_prefixes` of the same messages:
    the same bytes, with only the ids and one join left to do per run."""
    n = len(prefixes)
    if len(payloads) != n:
        raise ValueError(f"{n} prefixes for {len(payloads)} payloads")
    # The 3n pieces laid out by three extended-slice assignments (C copies, no tuple per
    # message as zip/chain make): ~30 % less than joining chain(zip(...)) for 20 messages.
    parts: list[bytes] = [b""] * (3 * n)
    parts[0::3] = prefixes
    parts[1::3] = map(_pack_H, range(first_pid, first_pid + n))
    parts[2::3] = payloads
    return b"".join(parts)


def puback_run(packet_ids: Sequence[int]) -> bytes:
    """The MQTT 3.1.1 PUBACKs (``40 02 id``) of ``packet_ids``, back to back: the ids packed in
    one call and laid into a template by two extended-slice copies (no bytecode per id)."""
    n = len(packet_ids)
    ids = struct.pack(f">{n}H", *packet_ids)
    out = bytearray(b"\x40\x02\x00\x00" * n)
    out[2::4] = ids[0::2]
    out[3::4] = ids[1::2]
    return bytes(out)
