"""The one PUBACK slicer (filemq/mqtt/pubacks.py, issue 31 item 3), shared by the broker's
connection and the export link: it must agree with decoding the same bytes packet by packet.

A read is sliced only if it is whole four-byte PUBACKs (MQTT 3.1.1 3.4; MQTT 5.0 3.4.2.1: a
PUBACK with reason code 0x00 and no properties may omit both) with non-zero packet ids
(MQTT-2.3.1-1); anything else goes to the decoder."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from filemq.mqtt.codec import Decoder, ProtocolError
from filemq.mqtt.packets import Puback
from filemq.mqtt.pubacks import PUBACK_RUN, puback_ids

PUBACK = b"\x40\x02"


def decoded_ids(data: bytes, *, server: bool, level: int) -> list[int] | None:
    """The reference: the ids if decoding ``data`` packet by packet gives only PUBACKs, each
    four bytes (n PUBACKs in 4 n bytes), nothing left over; else None."""
    decoder = Decoder(server=server, protocol_level=level)
    try:
        decoder.feed(data)
        packets = decoder.packets()
    except ProtocolError:
        return None
    if decoder.buffered or not packets or len(data) != 4 * len(packets):
        return None
    if not all(type(p) is Puback for p in packets):
        return None
    return [p.packet_id for p in packets if isinstance(p, Puback)]


def _puback(pid: int) -> bytes:
    return PUBACK + pid.to_bytes(2, "big")


# Pieces a read can hold: short PUBACKs (id 0 now and then), and what is not one: a PUBACK with
# a reason code (MQTT 5), PUBREC, PUBCOMP, PINGRESP, a stray byte.
_PIECE = st.one_of(
    st.integers(1, 0xFFFF).map(_puback),
    st.integers(1, 0xFFFF).map(_puback),
    st.integers(1, 0xFFFF).map(_puback),
    st.just(_puback(0)),
    st.integers(1, 0xFFFF).map(lambda p: b"\x40\x03" + p.to_bytes(2, "big") + b"\x10"),
    st.integers(1, 0xFFFF).map(lambda p: b"\x50\x02" + p.to_bytes(2, "big")),
    st.integers(1, 0xFFFF).map(lambda p: b"\x70\x02" + p.to_bytes(2, "big")),
    st.just(b"\xd0\x00"),
    st.binary(min_size=1, max_size=3),
)


@given(pieces=st.lists(_PIECE, min_size=0, max_size=3 * PUBACK_RUN // 2), cut=st.integers(0, 3),
       server=st.booleans(), level=st.sampled_from([4, 5]))
def test_the_slicer_agrees_with_decoding_packet_by_packet(pieces: list[bytes], cut: int, server: bool,
                                                          level: int) -> None:
    """Reads below and above PUBACK_RUN packets (the two slicing paths), cut anywhere."""
    data = b"".join(pieces)
    data = data[: len(data) - cut] if cut else data
    got = puback_ids(data)
    want = decoded_ids(data, server=server, level=level)
    assert (None if got is None else list(got)) == want


@given(pids=st.lists(st.integers(1, 0xFFFF), min_size=1, max_size=3 * PUBACK_RUN))
def test_whole_pubacks_are_sliced_in_order(pids: list[int]) -> None:
    data = b"".join(map(_puback, pids))
    got = puback_ids(data)
    assert got is not None and list(got) == pids == decoded_ids(data, server=True, level=4)


@pytest.mark.parametrize("n", [1, PUBACK_RUN, PUBACK_RUN + 1, 300])
def test_a_packet_id_0_goes_to_the_decoder(n: int) -> None:
    """MQTT-2.3.1-1: a PUBACK's packet id is non-zero; the slicer leaves the read to the decoder,
    which refuses it, wherever the id-0 PUBACK sits."""
    for at in {0, n // 2, n - 1}:
        data = b"".join(_puback(0 if i == at else i + 1) for i in range(n))
        assert puback_ids(data) is None
        with pytest.raises(ProtocolError):
            d = Decoder(server=True)
            d.feed(data)
            d.packets()


def test_nothing_and_a_cut_puback_are_not_sliced() -> None:
    assert puback_ids(b"") is None
    assert puback_ids(_puback(7)[:3]) is None
    assert puback_ids(_puback(7) + b"\x40\x02\x00") is None
