"""MQTT 5.0 decoder runs (issue 16 item 5): a read's run of equal-shaped QoS 1 PUBLISHes
without properties (property length 0, spec 3.3.2.3.1) comes from ``Decoder(runs=True)`` as one
:class:`PublishRun`, exactly as 3.1.1's do; whatever the split and mix of packets, the decoder
gives what decoding packet by packet gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.mqtt import codec
from filemq.mqtt.codec import Decoder, ProtocolError, encode5, publish_bytes5
from filemq.mqtt.packets import Connect, Packet, Properties, Publish, PublishRun
from filemq.mqtt.runcodec import (
    publish_prefixes,
    publish_prefixes5,
    publish_run,
    publish_run_prefixed5,
)
from tests.mqtt_strategies import client_packets5, normalized

_others = client_packets5.filter(lambda p: not isinstance(p, Connect))


def _decode5_in_cuts(stream: bytes, cuts: list[int], runs: bool = False) -> list[Packet] | str:
    """The packets of ``stream`` fed in pieces at ``cuts`` to a level-5 server decoder, a
    :class:`PublishRun` expanded into its PUBLISHes; the packets before an error and the error."""
    decoder = Decoder(protocol_level=5, runs=runs)
    got: list[Packet] = []
    prev = 0
    try:
        for cut in [*cuts, len(stream)]:
            decoder.feed(stream[prev:cut])
            prev = cut
            for p in decoder.packets():
                if isinstance(p, PublishRun):
                    # Only QoS 1 runs come whole at level 5 (what the broker takes as one).
                    assert runs and p.qos == 1 and len(p.payloads) >= codec._RUN_MIN
                    got.extend(p.publishes())
                else:
                    got.append(p)
    except ProtocolError as exc:
        return f"{len(got)} then {exc.reason} (0x{exc.reason_code:02x})"
    return got


# A PUBLISH with a property section of 2 bytes (payload format indicator 0) and a payload 2
# bytes shorter than its neighbours' has their remaining length, fixed header and topic: only
# its property length byte tells it from them.
_SAME_SIZE_PROPS = Properties(payload_format_indicator=0)


@given(st.lists(st.one_of(
    st.tuples(st.sampled_from(["a/b", "a/c", "sensors/dev-1/temp", "é"]), st.sampled_from([0, 1, 2, 5, 100, 200]),
              st.integers(0, 2), st.booleans(), st.booleans(),
              st.one_of(st.integers(0, 3), st.sampled_from([25, 50])),  # (long runs: several struct pieces)
              st.lists(st.integers(0, 12), max_size=2)),
    _others), min_size=1, max_size=30),
    st.data())
@settings(max_examples=300, deadline=None)  # (a loaded machine's first call may take > 200 ms)
def test_v5_runs_decode_as_packet_by_packet_for_any_split_and_mix(
        items: list[tuple[str, int, int, bool, bool, int, list[int]] | Packet], data: st.DataObject) -> None:
    """Runs of equal-shaped PUBLISHes (any QoS, RETAIN, DUP; some members of the same size but
    with properties), mixed with any other client packets (PUBLISHes with arbitrary properties,
    acks, SUBSCRIBE, ...), split anywhere: ``Decoder(runs=True)`` (runs expanded), the default
    decoder and one with runs switched off give the same packets, the ones encoded; a corrupt
    run member (packet id 0, MQTT-2.2.1-3; a non-zero property length) is reported after the
    same packets, with the same reason code, whichever way it is decoded."""
    packets: list[Packet] = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple):
            packets.append(item)
            continue
        topic, size, qos, retain, dup, repeat, with_props = item
        for j in range(1 + repeat * 3):
            pid = None if not qos else (i * 16 + j) % 65536 or 1
            if j in with_props and size >= 2:
                packets.append(Publish(topic, bytes([j]) * (size - 2), qos, retain, dup and qos > 0, pid,
                                       _SAME_SIZE_PROPS))
            else:
                packets.append(Publish(topic, bytes([j]) * size, qos, retain, dup and qos > 0, pid))
    wires = [encode5(p) for p in packets]
    corrupt = data.draw(st.sampled_from(["none", "packet id 0", "property length"]))
    if corrupt != "none":
        k = data.draw(st.integers(0, len(packets) - 1))
        p = packets[k]
        if isinstance(p, Publish) and p.properties is None and (p.qos or corrupt == "property length"):
            wire = bytearray(wires[k])
            at = len(wire) - len(p.payload) - 1  # the property length byte
            if corrupt == "packet id 0":
                wire[at - 2:at] = b"\x00\x00"
            else:
                wire[at] = data.draw(st.integers(1, 0x7F))
            wires[k] = bytes(wire)
        else:
            corrupt = "none"
    stream = b"".join(wires)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    plain = _decode5_in_cuts(stream, cuts)
    assert _decode5_in_cuts(stream, cuts, runs=True) == plain  # PublishRun: the same messages
    no_runs = pytest.MonkeyPatch()
    no_runs.setattr(codec, "_RUN_MIN", 1 << 30)
    try:
        assert _decode5_in_cuts(stream, cuts, runs=True) == plain
        assert _decode5_in_cuts(stream, cuts) == plain
    finally:
        no_runs.undo()
    if corrupt == "none":
        assert plain == [normalized(p) for p in packets]


def _qos1(n: int, first_pid: int = 1, topic: str = "t/run", size: int = 10) -> list[Publish]:
    return [Publish(topic, bytes([pid % 256]) * size, 1, packet_id=pid) for pid in range(first_pid, first_pid + n)]


def test_a_read_of_equal_shaped_v5_qos1_publishes_is_one_publish_run() -> None:
    """The run path takes a level-5 read: the first PUBLISH (its topic not cached yet) alone,
    the other 19 as one PublishRun with their packet ids and payloads; the next read, its topic
    known, is one PublishRun from its first packet."""
    decoder = Decoder(protocol_level=5, runs=True)
    packets = _qos1(20)
    decoder.feed(b"".join(map(encode5, packets)))
    got = decoder.packets()
    assert [type(p) for p in got] == [Publish, PublishRun]
    run = got[1]
    assert isinstance(run, PublishRun)
    assert (run.topic, run.qos, run.retain, run.dup) == ("t/run", 1, False, False)
    assert run.packet_ids == list(range(2, 21))
    assert run.publishes() == packets[1:]
    decoder.feed(b"".join(map(encode5, _qos1(8, 21))))
    again = decoder.packets()
    assert len(again) == 1 and isinstance(again[0], PublishRun) and again[0].publishes() == _qos1(8, 21)


def test_a_same_sized_publish_with_properties_ends_a_v5_run_3_3_2_3() -> None:
    """A PUBLISH with properties never joins a run (its properties -- a topic alias, user
    properties -- are the broker's to handle one by one): one of the same size, fixed header
    and topic as the run's packets ends the run and comes with its properties."""
    decoder = Decoder(protocol_level=5, runs=True)
    packets: list[Publish] = _qos1(12)
    packets[6] = Publish("t/run", b"\x07" * 8, 1, packet_id=7, properties=_SAME_SIZE_PROPS)
    wires = [encode5(p) for p in packets]
    assert len({len(w) for w in wires}) == 1
    decoder.feed(b"".join(wires))
    got = decoder.packets()
    assert [type(p) for p in got][:3] == [Publish, PublishRun, Publish]
    expanded: list[Packet] = []
    for p in got:
        expanded.extend(p.publishes() if isinstance(p, PublishRun) else [p])
    assert expanded == packets
    assert got[2] == packets[6]


def test_v5_runs_of_other_qos_come_as_publishes() -> None:
    """At level 5 only a QoS 1 run comes as a PublishRun (the broker's Receive Maximum path
    takes those); a QoS 0 or 2 run is decoded the same way and handed over one Publish each."""
    for qos in (0, 2):
        decoder = Decoder(protocol_level=5, runs=True)
        packets = [Publish("t", b"x" * 5, qos, packet_id=(i + 1) if qos else None) for i in range(10)]
        decoder.feed(b"".join(map(encode5, packets)))
        assert decoder.packets() == packets


@given(st.lists(st.tuples(st.sampled_from(["a/b", "é", "x" * 120, "y" * 200]),
                          st.sampled_from([0, 1, 100, 121, 122, 123, 16250, 16259, 16260, 16400])),
                min_size=1, max_size=12),
       st.integers(1, 0xFFFF))
@settings(max_examples=100, deadline=None)
def test_a_v5_run_from_the_tail_caches_prefixes_is_publish_run(messages: list[tuple[str, int]], first_pid: int) -> None:
    """The MQTT 5 delivery run built from the 3.1.1 prefixes the tail cache keeps
    (publish_prefixes5 of publish_prefixes; remaining lengths on both sides of the 1/2 and
    2/3-byte boundaries): byte for byte runcodec.publish_run with v5, i.e. publish_bytes5 of
    each message with an empty property section."""
    first_pid = min(first_pid, 0xFFFF - len(messages) + 1)
    topics = [t for t, _ in messages]
    payloads = [bytes([k % 256]) * size for k, (_, size) in enumerate(messages)]
    prefixes5 = publish_prefixes5(publish_prefixes(topics, payloads))
    assert publish_run_prefixed5(prefixes5, payloads, first_pid) == publish_run(topics, payloads, first_pid, v5=True)
    assert publish_run(topics, payloads, first_pid, v5=True) == b"".join(
        publish_bytes5(t, p, 1, False, first_pid + k) for k, (t, p) in enumerate(zip(topics, payloads, strict=True)))
