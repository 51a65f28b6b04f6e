"""The PUBACK-counting proxy behind `filemq bench forward --only mqtt-export --oracle puback`:
it must count exactly the PUBACKs in the destination -> client stream however the bytes are
split into reads, and pass every byte through unchanged."""

from __future__ import annotations

import socket
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.ackcount import PUBACK, AckCounter, Pipe


def _packet(first: int, body: bytes) -> bytes:
    n, length = len(body), bytearray()
    while True:  # the MQTT remaining length (MQTT 3.1.1 section 2.2.3), written here independently
        byte, n = n & 0x7F, n >> 7
        length.append(byte | (0x80 if n else 0))
        if not n:
            return bytes([first]) + bytes(length) + body


packets = st.one_of(
    st.binary(min_size=2, max_size=2).map(lambda pid: (True, _packet(PUBACK, pid))),
    st.just((False, _packet(0x20, b"\x00\x00"))),  # CONNACK
    st.just((False, _packet(0xD0, b""))),  # PINGRESP
    # a PUBLISH whose body holds PUBACK-looking bytes, some past 127 bytes (2-byte length)
    st.binary(max_size=300).map(lambda b: (False, _packet(0x30, b"\x00\x01t" + b"\x40\x02" * 3 + b))),
)


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data


@settings(max_examples=300, deadline=None)
@given(st.lists(packets, max_size=40), st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=20))
def test_counts_exactly_the_pubacks_however_the_stream_is_split(items: list[tuple[bool, bytes]],
                                                                 cuts: list[int]) -> None:
    counter = AckCounter(1)
    pipe = Pipe(counter)
    sink = _Sink()
    pipe.peer = sink  # type: ignore[assignment]
    stream = b"".join(p for _, p in items)
    pos, i = 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        pipe.data_received(stream[pos:pos + step])
        pos += step
        i += 1
    assert counter.acks == sum(1 for is_ack, _ in items if is_ack)
    assert bytes(sink.data) == stream
    assert pipe.pending == b""


def test_proxies_both_ways_and_wait_returns_at_the_count() -> None:
    """A fake destination that answers 3 PUBACKs: the client gets them, the counter sees them."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received: list[bytes] = []

    def destination() -> None:
        conn, _ = server.accept()
        with conn:
            received.append(conn.recv(100))
            conn.sendall(b"\x40\x02\x00\x01\x40\x02\x00\x02" + b"\x40\x02")
            conn.sendall(b"\x00\x03")
            conn.recv(1)  # until the client closes

    thread = threading.Thread(target=destination, daemon=True)
    thread.start()
    counter = AckCounter(port).start()
    try:
        with socket.create_connection(("127.0.0.1", counter.port), timeout=5) as client:
            client.sendall(b"hello")
            assert counter.wait(3, 5)
            got = b""
            while len(got) < 12:
                got += client.recv(100)
        assert got == b"\x40\x02\x00\x01\x40\x02\x00\x02\x40\x02\x00\x03"
        assert received == [b"hello"]
        assert counter.acks == 3 and counter.first is not None and counter.last is not None
        assert not counter.wait(4, 0.05)
    finally:
        counter.stop()
        server.close()
        thread.join(5)
