"""The PUBLISH property decoder (issue 33 item 6): :func:`decode_publish_properties` is the
generic :func:`_decode_properties` of a PUBLISH, specialised for speed, so it must give the
same answer on every block: the same :class:`Properties` and end position for a block the
generic decoder takes, the same :class:`ProtocolError` (reason and reason code) for one it
refuses.  Hypothesis builds both kinds: well-formed blocks of the PUBLISH properties in any
order, and blocks broken the ways a client breaks them (spec 2.2.2.2, 1.5.4, 1.5.5)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import cast

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import filemq.mqtt.properties as properties_module
from filemq.mqtt import codec
from filemq.mqtt.codec import Decoder, encode5
from filemq.mqtt.packets import PROTOCOL_LEVEL_5, Properties, Puback, Publish, PublishRun
from filemq.mqtt.properties import (
    MAX_USER_PROPERTIES,
    RC_QUOTA_EXCEEDED,
    _decode_properties,
    _encode_properties,
    decode_publish_properties,
    encode_message_headers,
)
from filemq.mqtt.wire import ProtocolError

RC_MALFORMED = 0x81
RC_PROTOCOL_ERROR = 0x82


def _vbi(value: int, pad: int = 0) -> bytes:
    """``value`` as a variable byte integer, ``pad`` bytes longer than it needs (non-minimal,
    MQTT-1.5.5-1: a continuation bit on the last byte and ``pad`` zero bytes... the last 00)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            break
    for _ in range(pad):
        out[-1] |= 0x80
        out.append(0)
    return bytes(out)


def _field(data: bytes) -> bytes:
    return struct.pack("!H", len(data)) + data


def _outcome(fn: object, buf: bytes, pos: int, end: int) -> tuple[str, object]:
    try:
        if fn is _decode_properties:
            props, at = _decode_properties(buf, pos, end, "PUBLISH")
        else:
            props, at = decode_publish_properties(buf, pos, end)
    except ProtocolError as exc:
        return "error", (exc.reason, exc.reason_code, exc.packet_type)
    return "ok", (props, at)


def _agree(buf: bytes, pos: int = 0, end: int | None = None) -> tuple[str, object]:
    end = len(buf) if end is None else end
    generic = _outcome(_decode_properties, buf, pos, end)
    fast = _outcome(decode_publish_properties, buf, pos, end)
    assert fast == generic, (buf.hex(), pos, end)
    return generic


# ---- generators ------------------------------------------------------------------------

_texts = st.text(max_size=12)
# UTF-8 string bodies: mostly well-formed, some not (1.5.4: ill-formed bytes, a surrogate,
# U+0000), some over-long for the block.
_utf8 = st.one_of(
    _texts.map(lambda t: t.encode("utf-8")),
    _texts.map(lambda t: t.encode("utf-8") + b"\x00"),
    st.sampled_from([b"\xed\xa0\x80", b"\xff", b"\xc3", b"a\xc0\xafb", b"\xf4\x90\x80\x80"]),
    st.binary(max_size=6),
)
_good_utf8 = _texts.filter(lambda t: "\x00" not in t).map(lambda t: t.encode("utf-8"))

# One property of a PUBLISH on the wire (any value its type can hold, valid or not).
_property = st.one_of(
    st.integers(0, 3).map(lambda v: b"\x01" + bytes((v,))),
    st.integers(0, 0xFFFF_FFFF).map(lambda v: b"\x02" + struct.pack("!I", v)),
    _utf8.map(lambda b: b"\x03" + _field(b)),
    _utf8.map(lambda b: b"\x08" + _field(b)),
    st.binary(max_size=8).map(lambda b: b"\x09" + _field(b)),
    st.tuples(st.integers(0, 268_435_455), st.integers(0, 1)).map(lambda t: b"\x0b" + _vbi(*t)),
    st.just(b"\x0b\x80\x80\x80\x80\x01"),  # five bytes
    st.integers(0, 0xFFFF).map(lambda v: b"\x23" + struct.pack("!H", v)),
    st.tuples(_utf8, _utf8).map(lambda kv: b"\x26" + _field(kv[0]) + _field(kv[1])),
    # another packet's property, or an identifier no packet has; with a few bytes behind
    st.tuples(st.integers(0, 0xFF).filter(lambda i: i not in (0x01, 0x02, 0x03, 0x08, 0x09, 0x0B, 0x23, 0x26)),
              st.binary(max_size=4)).map(lambda t: bytes((t[0],)) + t[1]),
)
# Well-formed ones, as a client sends them (each single-valued property at most once).
_valid_properties = st.lists(st.one_of(
    st.integers(0, 1).map(lambda v: b"\x01" + bytes((v,))),
    st.integers(0, 0xFFFF_FFFF).map(lambda v: b"\x02" + struct.pack("!I", v)),
    _good_utf8.map(lambda b: b"\x03" + _field(b)),
    _good_utf8.map(lambda b: b"\x08" + _field(b)),
    st.binary(max_size=8).map(lambda b: b"\x09" + _field(b)),
    st.integers(1, 268_435_455).map(lambda v: b"\x0b" + _vbi(v)),
    st.integers(1, 0xFFFF).map(lambda v: b"\x23" + struct.pack("!H", v)),  # (0: refused, 3.3.2.3.4)
    st.tuples(_good_utf8, _good_utf8).map(lambda kv: b"\x26" + _field(kv[0]) + _field(kv[1])),
), max_size=8).filter(lambda ps: all(sum(p[0] == i for p in ps) <= 1 for i in (1, 2, 3, 8, 9, 0x23)))


@st.composite
def _blocks(draw: st.DrawFn) -> tuple[bytes, int, int]:
    """A property section somewhere in a packet: (buffer, its position, the packet's end)."""
    body = b"".join(draw(st.lists(_property, max_size=8)))
    if draw(st.booleans()) and body:  # cut the body short (a truncated property)
        body = body[:draw(st.integers(0, len(body) - 1))]
    length = len(body) + draw(st.sampled_from([0, 0, 0, 1, -1, 3]))  # a lying property length
    head = _vbi(max(length, 0), draw(st.sampled_from([0, 0, 0, 1, 2, 3])))
    before = draw(st.binary(max_size=3))
    after = draw(st.binary(max_size=4))  # the payload behind the section
    buf = before + head + body + after
    end = len(buf) - draw(st.integers(0, len(after) + len(body)))  # the packet may end inside it
    return buf, len(before), max(end, len(before))


# ---- the properties -------------------------------------------------------------------


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(_valid_properties, st.binary(max_size=4))
@example([b"\x03" + _field(b"application/octet-stream"), b"\x26" + _field(b"source") + _field(b"bench")], b"x")
@example([b"\x26" + _field(b"k") + _field(b"v")] * 3, b"")  # a user property repeats (3.3.2.3.7)
def test_fast_decoder_gives_the_generic_result_on_valid_blocks(props: list[bytes], payload: bytes) -> None:
    """A well-formed PUBLISH property section (any order, user properties and subscription
    identifiers repeated): the same Properties and end position as the generic decoder."""
    body = b"".join(props)
    buf = _vbi(len(body)) + body + payload
    kind, result = _agree(buf)
    if len(body) < 0x4000:  # the specialised pass decoded it itself, without the generic decoder
        calls: list[object] = []
        generic = properties_module._decode_properties
        # (append's None is the point of the `or`: the spy records the call, then decodes)
        properties_module._decode_properties = lambda *a: calls.append(a) or generic(*a)  # type: ignore[func-returns-value]
        try:
            decode_publish_properties(buf, 0, len(buf))
        finally:
            properties_module._decode_properties = generic
        assert not calls  # (a compiled build binds the call and ignores the patch: nothing to see)
    assert kind == "ok"
    decoded, at = cast("tuple[Properties | None, int]", result)  # (an "ok" outcome's)
    assert at == len(buf) - len(payload)
    if body:  # and it encodes back to a section the generic decoder reads the same
        again = _encode_properties(decoded, "PUBLISH")
        assert _decode_properties(again, 0, len(again), "PUBLISH")[0] == decoded
    else:
        assert decoded is None


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@given(_blocks())
@example((b"\x80\x00", 0, 2))  # a property length "80 00" (MQTT-1.5.5-1)
@example((b"\x05\x0b\x80\x80\x80\x80", 0, 6))  # a subscription identifier of five bytes
@example((b"\x03\x0b\x80\x00", 0, 4))  # a subscription identifier "80 00" (MQTT-1.5.5-1)
@example((b"\x02\x0b\x00", 0, 3))  # subscription identifier 0 (3.3.2.3.8)
@example((b"\x04\x01\x00\x01\x01", 0, 5))  # the payload format indicator twice (MQTT-3.3.2-... 3.3.2.3.2)
@example((b"\x02\x01\x02", 0, 3))  # payload format indicator 2
@example((b"\x06\x03\x00\x03a\x00b", 0, 7))  # U+0000 in the content type (MQTT-1.5.4-2)
@example((b"\x06\x08\x00\x03\xed\xa0\x80", 0, 7))  # a surrogate in the response topic (MQTT-1.5.4-1)
@example((b"\x03\x11\x00\x00", 0, 4))  # session expiry interval: not a PUBLISH property
@example((b"\x01\x00", 0, 2))  # identifier 0: no property has it
@example((b"\x03\x23\x00\x00", 0, 4))  # topic alias 0: decoded; _decode_publish5 refuses it (0x94)
@example((b"\x81\x01" + b"\x26\x00\x00\x00\x00" * 25 + b"\x26\x00\x00\x00\x00\x26", 0, 131))  # 2-byte length
def test_fast_decoder_refuses_what_the_generic_refuses(block: tuple[bytes, int, int]) -> None:
    """Any section, malformed or not (a lying or non-minimal property length, a truncated
    property, repeats, ill-formed UTF-8, unknown identifiers, a section running past the
    packet): the fast decoder's outcome is the generic one's, the same reason code and reason
    when it is an error."""
    buf, pos, end = block
    _agree(buf, pos, end)


def test_more_than_the_user_property_limit_is_quota_exceeded_as_in_the_generic_decoder() -> None:
    """Issue 30 item 4: the 1,025th user property is refused with 0x97, by both decoders."""
    one = b"\x26" + _field(b"k") + _field(b"v")
    for count, ok in ((MAX_USER_PROPERTIES, True), (MAX_USER_PROPERTIES + 1, False)):
        body = one * count
        kind, result = _agree(_vbi(len(body)) + body)
        assert (kind == "ok") is ok
        if not ok:
            assert result[1] == RC_QUOTA_EXCEEDED  # type: ignore[index]


@pytest.mark.parametrize(("block", "code"), [
    (b"\x04\x01\x00\x01\x00", RC_PROTOCOL_ERROR),  # a repeated property (3.3.2.3.2)
    (b"\x02\x01\x05", RC_PROTOCOL_ERROR),  # payload format indicator 5
    (b"\x03\x11\x00\x00", RC_MALFORMED),  # not a PUBLISH property (2.2.2.2)
    (b"\x06\x03\x00\x03\xff\xfe\xfd", RC_MALFORMED),  # ill-formed UTF-8 (MQTT-1.5.4-1)
    (b"\x80\x00", RC_MALFORMED),  # non-minimal property length (MQTT-1.5.5-1)
    (b"\x09\x03\x00\x10abc", RC_MALFORMED),  # a string longer than the section
])
def test_a_malformed_publish_section_is_refused_by_the_decoder_with_its_reason_code(block: bytes, code: int) -> None:
    """Through the connection's decoder: the first PUBLISH with properties (general path) and
    the same again once its topic is known (the fast path with the section cache) are refused
    the same way."""
    good = encode5(Publish("t/1", b"p", 1, packet_id=1, properties=Properties(content_type="x")))
    for fed in (b"", good):
        dec = Decoder(server=True, protocol_level=PROTOCOL_LEVEL_5, runs=True)
        dec.feed(fed)
        if fed:
            assert len(dec.packets()) == 1
        body = b"\x00\x03t/1\x00\x02" + block + b"payload"
        dec.feed(bytes((0x32, len(body))) + body)
        with pytest.raises(ProtocolError) as info:
            dec.packets()
        assert info.value.reason_code == code


# ---- the decoder's fast path and the broker's run path ---------------------------------

_message_props = st.builds(
    Properties,
    payload_format_indicator=st.none() | st.integers(0, 1),
    message_expiry_interval=st.none() | st.integers(0, 0xFFFF_FFFF),
    content_type=st.none() | _texts.filter(lambda t: "\x00" not in t),
    correlation_data=st.none() | st.binary(max_size=6),
    topic_alias=st.none() | st.integers(1, 0xFFFF),
    user_properties=st.lists(st.tuples(st.sampled_from(["a", "é", ""]), st.sampled_from(["1", "x"])), max_size=3),
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["a/1", "b"]), st.none() | _message_props, st.integers(0, 2)),
                min_size=1, max_size=12), st.integers(1, 64))
def test_the_decoders_fast_path_gives_the_general_paths_packets(msgs: list[tuple[str, Properties | None, int]],
                                                                  read: int) -> None:
    """A stream of MQTT 5 PUBLISHes (properties repeated or not, fed in reads of any size) comes
    out of a connection's decoder -- its fast path once a topic and a property section have been
    seen, sections shared -- as each packet decodes alone on the general path; a decoded
    packet's ``headers``, when set, are the record headers of its properties."""
    packets = [Publish(topic, bytes((k,)) * k, qos, packet_id=k + 1 if qos else None,
                       properties=None if props == Properties() else props)  # (no section: None)
               for k, (topic, props, qos) in enumerate(msgs)]
    wires = [encode5(p) for p in packets]
    alone = []
    for wire in wires:
        fresh = Decoder(server=True, protocol_level=PROTOCOL_LEVEL_5, runs=True)
        fresh.feed(wire)
        alone += fresh.packets()
    dec = Decoder(server=True, protocol_level=PROTOCOL_LEVEL_5, runs=True)
    stream = b"".join(wires)
    got: list[Publish] = []
    for at in range(0, len(stream), read):
        dec.feed(stream[at:at + read])
        got += dec.packets()  # type: ignore[arg-type]
    assert got == alone == packets
    for p in got:
        assert p.headers is None or p.headers == encode_message_headers(p.properties)


def test_publishes_with_properties_are_stored_as_one_run_with_their_headers(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of QoS 1 PUBLISHes with message properties (and some without) is stored with
    one call, each record with its own headers (3.3.2.3: the message properties go with the
    message), acknowledged in order; a response topic, a payload format indicator of 1 or a
    topic alias still take the single path, with its checks (MQTT-3.3.2-14, 3.3.2.3.2,
    3.3.2.3.4)."""
    from tests.broker_harness import run
    from tests.broker_harness5 import Harness5, client5

    async def main() -> None:
        h = Harness5(tmp_path, topic_alias_maximum=10)
        p = client5(h)
        p.connect("p")
        single: list[Publish] = []
        real = h.core.ingest.on_publish

        def spy(conn: object, pk: Publish) -> None:  # (returns None: a compiled core checks it)
            single.append(pk)
            real(conn, pk)  # type: ignore[arg-type]

        monkeypatch.setattr(h.core.ingest, "on_publish", spy)  # (the ingest part's own calls)
        monkeypatch.setattr(h.core, "on_publish", spy)  # (the connection's)
        plain = Properties(content_type="application/octet-stream", user_properties=[("source", "bench")])
        other = Properties(user_properties=[("k", "v"), ("k", "w")], message_expiry_interval=60)
        props = [plain, plain, None, other, plain, Properties(response_topic="r/1"),
                 Properties(payload_format_indicator=1), Properties(topic_alias=3), plain, other]
        p.send(*[Publish("t/1", b"m%d" % k, 1, packet_id=k + 1, properties=pr) for k, pr in enumerate(props)])
        await h.commit()
        assert p.received() == [Puback(k + 1) for k in range(len(props))]
        records = h.queue.log.records
        assert [r.payload for r in records] == [b"m%d" % k for k in range(len(props))]
        assert [r.headers for r in records] == [encode_message_headers(pr) for pr in props]
        assert [pk.payload for pk in single] == [b"m5", b"m6", b"m7"]
    run(main())


# Property sections a device repeats (a content type and a user property, as
# `filemq bench broker --v5-properties` sends; a topic alias; a correlation id).
_SECTIONS = [
    None,
    Properties(content_type="application/octet-stream", user_properties=[("source", "bench")]),
    Properties(topic_alias=2),
    Properties(correlation_data=b"id", message_expiry_interval=30, user_properties=[("a", "1"), ("a", "2")]),
]


def _decode5_in_cuts(stream: bytes, cuts: list[int], runs: bool = False) -> list[Publish] | str:
    """The PUBLISHes of ``stream`` fed in pieces at ``cuts`` to a level-5 server decoder, a
    PublishRun expanded; the packets before an error and the error."""
    dec = Decoder(server=True, protocol_level=PROTOCOL_LEVEL_5, runs=runs)
    got: list[Publish] = []
    prev = 0
    try:
        for cut in [*cuts, len(stream)]:
            dec.feed(stream[prev:cut])
            prev = cut
            for p in dec.packets():
                if isinstance(p, PublishRun):
                    assert runs and p.qos == 1 and (p.properties is None or p.properties.topic_alias is None)
                    got.extend(p.publishes())
                else:
                    assert isinstance(p, Publish)
                    got.append(p)
    except ProtocolError as exc:
        return f"{len(got)} then {exc.reason} (0x{exc.reason_code:02x})"
    return got


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["t/1", "u"]), st.integers(0, len(_SECTIONS) - 1), st.integers(1, 20),
                          st.sampled_from([0, 1, 7]), st.integers(0, 2)), min_size=1, max_size=6),
       st.data())
def test_runs_of_one_property_section_decode_as_packet_by_packet(items: list[tuple[str, int, int, int, int]],
                                                                  data: st.DataObject) -> None:
    """Runs of PUBLISHes that repeat one property section (QoS 1 ones come as one PublishRun,
    the section validated once; one with a topic alias never does), split anywhere, maybe one
    section broken (U+0000 in it, MQTT-1.5.4-2; ill-formed UTF-8, MQTT-1.5.4-1): the same
    packets, or the same packets then the same error, as decoding with runs off."""
    packets = [Publish(topic, bytes((j,)) * size, qos, packet_id=(i * 32 + j) % 65535 + 1 if qos else None,
                       properties=_SECTIONS[which])
               for i, (topic, which, count, size, qos) in enumerate(items) for j in range(count)]
    wires = [encode5(p) for p in packets]
    broken = data.draw(st.sampled_from([None, "nul", "ill-formed"]))
    if broken is not None:
        k = data.draw(st.integers(0, len(packets) - 1))
        p = packets[k]
        if p.properties is not None and p.properties.user_properties:
            wire = bytearray(wires[k])
            # the last byte of the last user property value: U+0000 or a lone UTF-8 lead byte
            wire[len(wire) - len(p.payload) - 1] = 0 if broken == "nul" else 0xC3
            wires[k] = bytes(wire)
    stream = b"".join(wires)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    with_runs = _decode5_in_cuts(stream, cuts, runs=True)
    no_runs = pytest.MonkeyPatch()
    no_runs.setattr(codec, "_RUN_MIN", 1 << 30)
    try:
        assert _decode5_in_cuts(stream, cuts, runs=True) == with_runs
        assert _decode5_in_cuts(stream, cuts) == with_runs
    finally:
        no_runs.undo()
    if broken is None:
        assert with_runs == packets


def test_a_run_of_one_property_section_is_one_publish_run_validated_once() -> None:
    """20 QoS 1 PUBLISHes with the bench's property section: the first alone (its topic not
    known yet), the other 19 as one PublishRun carrying the properties and their record
    headers; the next read, all known, one PublishRun from its first packet."""
    props = _SECTIONS[1]
    dec = Decoder(server=True, protocol_level=PROTOCOL_LEVEL_5, runs=True)
    packets = [Publish("t/run", bytes((k,)) * 10, 1, packet_id=k + 1, properties=props) for k in range(20)]
    dec.feed(b"".join(map(encode5, packets)))
    got = dec.packets()
    assert [type(p) for p in got] == [Publish, PublishRun]
    run = got[1]
    assert isinstance(run, PublishRun) and run.properties == props
    assert run.headers == encode_message_headers(props)
    assert run.publishes() == packets[1:]
    dec.feed(b"".join(map(encode5, packets[:8])))
    again = dec.packets()
    assert len(again) == 1 and isinstance(again[0], PublishRun) and again[0].publishes() == packets[:8]
