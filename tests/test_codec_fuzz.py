"""Fuzzing the server-side Decoder: any bytes give packets or ProtocolError, never anything else."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filemq.mqtt.codec import Decoder, ProtocolError, encode
from filemq.mqtt.packets import Packet, Publish
from tests.mqtt_strategies import client_packets, publishes

MAX = 4096


def _same_topic(packets: list[Publish]) -> list[Packet]:
    for p in packets:
        p.topic = "a/b"
    return list(packets)


# Mixed packets, and runs of one topic so mutations also hit the decoder's topic-cache path.
streams = st.lists(client_packets, min_size=1, max_size=5) | st.lists(
    publishes(), min_size=2, max_size=6
).map(_same_topic)


def drive(chunks: list[bytes], max_packet_size: int = MAX) -> list[Packet]:
    """Feed chunks and drain; returns the packets, or the ones before a ProtocolError.

    Any exception other than ProtocolError fails the test.  The buffered byte count is
    checked after every feed: it may never exceed the size limit plus one chunk.
    """
    decoder = Decoder(max_packet_size)
    out: list[Packet] = []
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            assert decoder.buffered <= max_packet_size + len(chunk)
            out.extend(decoder.packets())
            # Whatever stays buffered is an incomplete packet, which is under the limit.
            assert decoder.buffered <= max_packet_size
    except ProtocolError as exc:
        assert str(exc), "a ProtocolError must carry a reason"
    return out


@given(st.lists(st.binary(max_size=200), max_size=10))
@settings(max_examples=400)
def test_random_bytes_never_raise_anything_but_protocol_error(chunks: list[bytes]) -> None:
    drive(chunks)


@given(streams, st.data())
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_valid_streams(packets: list[Packet], data: st.DataObject) -> None:
    stream = bytearray(b"".join(encode(p) for p in packets))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "delete", "insert", "truncate"]))
        if not stream:
            break
        at = data.draw(st.integers(0, len(stream) - 1))
        if kind == "flip":
            stream[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set":
            stream[at] = data.draw(st.integers(0, 255))
        elif kind == "delete":
            del stream[at]
        elif kind == "insert":
            stream[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del stream[at:]
    cut = data.draw(st.integers(0, len(stream)))
    decoded = drive([bytes(stream[:cut]), bytes(stream[cut:])], max_packet_size=1 << 20)
    # Decoded packets must themselves be encodable (the decoder never yields an invalid object).
    for packet in decoded:
        encode(packet)


def test_endless_continuation_bytes_do_not_hang() -> None:
    decoder = Decoder()
    decoder.feed(b"\x30" + b"\xff" * 100_000)
    with pytest.raises(ProtocolError, match="remaining length exceeds 4 bytes"):
        decoder.packets()


def test_huge_declared_length_is_not_buffered() -> None:
    decoder = Decoder(max_packet_size=MAX)
    # Declares a 256 MB packet; feeding a little body must fail at the header, not wait for it.
    with pytest.raises(ProtocolError, match="exceeds max_packet_size 4096"):
        decoder.feed(b"\x30\xff\xff\xff\x7f" + b"\x00" * (MAX + 1))


def test_many_small_packets_in_one_feed() -> None:
    one = encode(Publish("t/1", b"v", 1, packet_id=1))
    got = drive([one * 10_000], max_packet_size=MAX)
    assert len(got) == 10_000
