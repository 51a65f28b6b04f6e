"""Fewer wake-ups for a subscriber's one-by-one acks (filemq.broker.batching, [broker] ack_batching).

While a subscriber whose TCP segments are small owes the acks of its next refill, the broker
sets its socket's SO_RCVLOWAT to the bytes those acks take at the least; a sweep sets it back
to 1 on any socket not read for SWEEP_S.  Every wait is bounded; the broker listens on
loopback, port 0.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import time
from pathlib import Path

import pytest

from filemq.broker.batching import ACK_BYTES, SAMPLE_READS, SWEEP_S, AckBatcher, AckBatching
from filemq.mqtt.codec import Decoder
from filemq.mqtt.packets import Pingresp, Publish
from tests.broker_harness import SocketTransport
from tests.broker_process import SLOW_RECV_S, ack_one_by_one, backlog

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(socket, "SO_RCVLOWAT") or not hasattr(socket, "TCP_INFO"),
    reason="SO_RCVLOWAT and TCP_INFO as used here are Linux's; elsewhere the broker goes without batching")

LOWAT = (socket.SOL_SOCKET, getattr(socket, "SO_RCVLOWAT", -1))


class _Sock:
    """A TCP socket's options as the batcher sees them: TCP_INFO gives the bytes and data
    segments received so far (``received``, ``segs``); setsockopt calls are recorded."""

    type = socket.SOCK_STREAM
    family = socket.AF_INET

    def __init__(self, info_len: int = 232, refuse: bool = False) -> None:
        self.received = 0
        self.segs = 0
        self.info_len = info_len
        self.refuse = refuse
        self.set: list[int] = []

    def getsockopt(self, level: int, name: int, buflen: int) -> bytes:
        assert (level, name) == (socket.IPPROTO_TCP, socket.TCP_INFO)
        info = bytearray(max(self.info_len, 160))
        struct.pack_into("=Q", info, 128, self.received)
        struct.pack_into("=I", info, 152, self.segs)
        return bytes(info[:min(buflen, self.info_len)])

    def setsockopt(self, level: int, name: int, value: int) -> None:
        if self.refuse:
            raise OSError(92, "Protocol not available")
        assert (level, name) == LOWAT
        self.set.append(value)


def _batcher(sock: _Sock, batching: AckBatching | None = None) -> AckBatcher:
    b = AckBatcher.for_transport(SocketTransport(sock), batching or AckBatching())  # type: ignore[arg-type]
    assert b is not None
    return b


def _reads(b: AckBatcher, sock: _Sock, n: int, bytes_per_seg: int, inflight: int = 5, window: int = 32) -> None:
    """``n`` reads, one segment of ``bytes_per_seg`` each, ``inflight`` left after each."""
    for _ in range(n):
        sock.received += bytes_per_seg
        sock.segs += 1
        assert b.after_read(inflight, window, time.monotonic()) is True


@linux_only
def test_the_mark_is_the_bytes_of_the_acks_the_next_refill_needs() -> None:
    async def main() -> None:
        sock = _Sock()
        b = _batcher(sock)
        # Until the first look at TCP_INFO (SAMPLE_READS reads) nothing is known: no mark.
        _reads(b, sock, SAMPLE_READS - 1, 4, inflight=32)
        assert sock.set == [] and b.mark == 1
        _reads(b, sock, 1, 4, inflight=32)  # the sample: 4 bytes per segment, a one-by-one acker
        # 32 in flight, the refill comes at 8 (a quarter of the window): 24 acks of 4 bytes.
        assert sock.set == [ACK_BYTES * 24] and b.mark == 96
        assert b.after_read(20, 32, time.monotonic()) and sock.set[-1] == ACK_BYTES * 12
        assert b.after_read(20, 32, time.monotonic()) and len(sock.set) == 2  # unchanged: no call
        assert b.after_read(8, 32, time.monotonic()) and sock.set[-1] == 1  # at the mark: wake for anything
        assert b.after_read(3, 32, time.monotonic()) and len(sock.set) == 3
        # An MQTT 5 Receive Maximum of 2 is refilled after each ack (the mark is 1 message).
        assert b.after_read(2, 2, time.monotonic()) and sock.set[-1] == ACK_BYTES
        b.close()

    asyncio.run(main())


@linux_only
def test_clients_with_larger_segments_are_left_alone() -> None:
    """Bulk ackers (many PUBACKs per segment) and Nagle clients (PUBACKs held until our ACK,
    then sent together) already wake the broker once per many acks."""
    async def main() -> None:
        for per_segment in (8, 40, 400):
            sock = _Sock()
            b = _batcher(sock)
            _reads(b, sock, 4 * SAMPLE_READS, per_segment, inflight=32)
            assert sock.set == [] and b.mark == 1 and not b.small
        # A client that turns from one-by-one to bulk loses its mark at the next sample.
        sock = _Sock()
        b = _batcher(sock)
        _reads(b, sock, SAMPLE_READS, 4, inflight=32)
        assert b.mark == 96
        _reads(b, sock, SAMPLE_READS, 100, inflight=32)
        assert b.mark == 1 and sock.set[-1] == 1 and not b.batching.raised

    asyncio.run(main())


@linux_only
def test_a_socket_that_refuses_or_an_old_kernel_means_no_batching() -> None:
    async def main() -> None:
        short = _Sock(info_len=120)  # a TCP_INFO without tcpi_data_segs_in (Linux < 4.6)
        b = _batcher(short)
        for _ in range(SAMPLE_READS - 1):
            assert b.after_read(32, 32, time.monotonic())
        assert b.after_read(32, 32, time.monotonic()) is False
        refusing = _Sock(refuse=True)
        b = _batcher(refusing)
        _reads_refused = [b.after_read(32, 32, time.monotonic()) for _ in range(SAMPLE_READS - 1)]
        assert all(_reads_refused)
        refusing.received, refusing.segs = 400, 100
        assert b.after_read(32, 32, time.monotonic()) is False  # the raise was refused
        assert not b.batching.raised

    asyncio.run(main())


@linux_only
def test_the_sweep_sets_back_marks_not_read_for_sweep_s() -> None:
    async def main() -> None:
        batching = AckBatching()
        idle_sock, busy_sock = _Sock(), _Sock()
        idle, busy = _batcher(idle_sock, batching), _batcher(busy_sock, batching)
        _reads(idle, idle_sock, SAMPLE_READS, 4, inflight=32)
        _reads(busy, busy_sock, SAMPLE_READS, 4, inflight=32)
        assert batching.raised == {idle, busy}
        # busy is read at every instant of the next minute (its last read ahead of the clock):
        # no sweep finds it idle, however late a loaded machine runs the loop. (Refreshed from
        # this loop every SWEEP_S / 4, a pause of the process longer than SWEEP_S between two
        # refreshes let a sweep set it back: flaky under parallel tests.)
        busy.last_read = time.monotonic() + 60.0
        deadline = time.monotonic() + 1.0
        while idle.mark != 1 and time.monotonic() < deadline:
            await asyncio.sleep(SWEEP_S / 4)
        assert idle.mark == 1 and idle_sock.set[-1] == 1 and batching.sweeps >= 1
        assert busy.mark == 96 and batching.raised == {busy}
        busy.last_read = time.monotonic()  # busy is no longer read: its mark is set back too,
        deadline = busy.last_read + 1.0  # within the bound idle had (polled, not one sleep)
        while busy.mark != 1 and time.monotonic() < deadline:
            await asyncio.sleep(SWEEP_S / 4)
        assert busy.mark == 1 and not batching.raised and batching.sweeps >= 2
        await asyncio.sleep(SWEEP_S * 3)
        assert batching._handle is None  # nothing raised: the sweep stops re-arming itself
        batching.close()

    asyncio.run(main())


@linux_only
def test_only_tcp_sockets_get_a_batcher() -> None:
    batching = AckBatching()
    assert AckBatcher.for_transport(SocketTransport(None), batching) is None  # type: ignore[arg-type]
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        assert AckBatcher.for_transport(SocketTransport(a), batching) is None  # type: ignore[arg-type]
    finally:
        a.close()
        b.close()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        assert AckBatcher.for_transport(SocketTransport(tcp), batching) is not None  # type: ignore[arg-type]
    finally:
        tcp.close()


# ---- a real broker on loopback ----------------------------------------------------------------

MESSAGES = 1600  # 50 refills of the default window of 32


def _one_by_one(port: int, client_id: str, ack_until: int, deadline_s: float) -> tuple[int, int, float | None]:
    """A raw-socket client with TCP_NODELAY that answers each QoS 1 PUBLISH with a PUBACK in
    a send of its own, for the first ``ack_until`` messages; then it takes what is in flight
    without acking it and sends a PINGREQ.  Returns (messages received, recvs that blocked
    longer than SLOW_RECV_S while acking, seconds from PINGREQ to PINGRESP or None)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    decoder = Decoder(server=False)
    pong: float | None = None
    deadline = time.monotonic() + deadline_s
    try:
        received, slow = ack_one_by_one(sock, client_id, ack_until, deadline)
        # Take what is still in flight, unacked (the broker's window is full: nothing else comes).
        sock.settimeout(0.3)
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                decoder.feed(data)
                received += sum(isinstance(p, Publish) for p in decoder.packets())
        except TimeoutError:
            pass
        sock.settimeout(5.0)
        sent = time.monotonic()
        sock.sendall(b"\xc0\x00")  # PINGREQ
        while pong is None and time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            decoder.feed(data)
            if any(isinstance(p, Pingresp) for p in decoder.packets()):
                pong = time.monotonic() - sent
    finally:
        sock.close()
    return received, slow, pong


@linux_only
@pytest.mark.timing  # reads of one PUBACK each: a loaded machine coalesces them (Makefile: run alone)
@pytest.mark.parametrize("ack_batching", [True, False])
def test_a_one_by_one_acker_gets_everything_and_a_pingreq_waits_at_most_a_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ack_batching: bool) -> None:
    """1,600 messages to a TCP_NODELAY client that acks each alone: the mark is raised (one
    wake-up per refill), nothing stalls, every message arrives.  Then the client stops acking
    with a full window in flight (the mark stands at 24 acks) and sends a PINGREQ, 2 bytes,
    below the mark: the sweep sets the mark back and the PINGRESP comes.  (Without the sweep,
    checked by hand 2026-11-27, no PINGRESP ever comes.)  With ``ack_batching = false`` no
    mark is ever set."""
    from tests.broker_process import make_config, running

    marks: list[int] = []
    original = AckBatcher.set_mark

    def record(self: AckBatcher, mark: int) -> bool:
        marks.append(mark)
        return original(self, mark)

    monkeypatch.setattr(AckBatcher, "set_mark", record)

    async def main() -> None:
        async with running(make_config(tmp_path / "d", ack_batching=ack_batching)) as b:
            await backlog(b.port, "one-by-one", MESSAGES, "batch")
            sweeps_before = b.batching.sweeps if b.batching is not None else 0
            received, slow, pong = await asyncio.to_thread(_one_by_one, b.port, "one-by-one", MESSAGES - 200, 60.0)
            # The first MESSAGES - 200 acked, then one more window's worth in flight, unacked.
            assert MESSAGES - 200 < received <= MESSAGES - 200 + 32
            assert slow <= 8, f"{slow} recvs waited > {SLOW_RECV_S * 1000:.0f} ms"
            assert pong is not None and pong < 1.0, pong
            if ack_batching:
                assert b.batching is not None
                assert max(marks) == ACK_BYTES * 24, marks[:20]  # raised, at a full window
                assert b.batching.sweeps > sweeps_before  # the PINGRESP came by the sweep
            else:
                assert b.batching is None

    asyncio.run(main())
    if not ack_batching:
        assert marks == []
