"""Prompt TCP ACKs after a read of a subscriber's acks (filemq.broker.pacing, [broker] ack_pacing).

The broker refills a subscriber's window in batches, so most reads of PUBACKs write nothing
back; without TCP_QUICKACK, a client with Nagle's algorithm on that sends each PUBACK in a
send of its own waits for the kernel's delayed ACK (40 ms on Linux) at every refill.
Every wait is bounded; the broker listens on loopback, port 0.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import pytest

from filemq.broker.pacing import AckPacer
from filemq.mqtt.client import MQTTClient
from tests.broker_harness import SocketTransport
from tests.broker_process import SLOW_RECV_S, ack_one_by_one, backlog, make_config, running

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(socket, "TCP_QUICKACK"),
                                reason="TCP_QUICKACK is a Linux socket option; elsewhere the broker goes without it")

MESSAGES = 1600  # 50 refills of the default window of 32


def _nagle_subscriber(port: int, client_id: str, expect: int, deadline_s: float) -> tuple[int, int]:
    """A raw-socket client with Nagle's algorithm on (no TCP_NODELAY) that answers each QoS 1
    PUBLISH with a PUBACK in a send of its own.  Returns (messages received, recv calls that
    blocked longer than SLOW_RECV_S)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
    try:
        return ack_one_by_one(sock, client_id, expect, time.monotonic() + deadline_s)
    finally:
        sock.close()


@linux_only
def test_a_nagle_subscriber_acking_one_by_one_is_not_held_at_each_refill(tmp_path: Path) -> None:
    """1,600 messages (50 refills of the window of 32) to a client with Nagle's algorithm on
    that sends each PUBACK alone: the broker sets TCP_QUICKACK after each read of acks that
    wrote nothing back, so the client's next PUBACKs go out at once, not after our delayed ACK.
    Without it (checked by hand, 2026-11-27) every refill waits ~40 ms: ~50 slow recvs, and
    8,500 deliveries/s to ten such clients in `filemq bench broker --subscriber-client nagle`."""

    async def main() -> None:
        async with running(make_config(tmp_path / "d")) as b:
            await backlog(b.port, "nagle-sub", MESSAGES)
            received, slow = await asyncio.to_thread(_nagle_subscriber, b.port, "nagle-sub", MESSAGES, 60.0)
            assert received == MESSAGES
            # A few slow recvs may come from a busy machine; one per refill means no pacing.
            assert slow <= 8, f"{slow} of ~50 refills waited > {SLOW_RECV_S * 1000:.0f} ms"

    asyncio.run(main())


class _RecordingSocket:
    type = socket.SOCK_STREAM
    family = socket.AF_INET

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.fail = fail

    def setsockopt(self, level: int, name: int, value: int) -> None:
        if self.fail:
            raise OSError(95, "Operation not supported")
        self.calls.append((level, name, value))


@linux_only
def test_acks_read_sets_tcp_quickack_and_reports_a_refusal() -> None:
    sock = _RecordingSocket()
    pacer = AckPacer.for_transport(SocketTransport(sock))  # type: ignore[arg-type]
    assert pacer is not None
    assert pacer.acks_read("c") is True
    assert sock.calls == [(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)]
    refusing = AckPacer.for_transport(SocketTransport(_RecordingSocket(fail=True)))  # type: ignore[arg-type]
    assert refusing is not None and refusing.acks_read("c") is False


@linux_only
def test_only_tcp_sockets_get_a_pacer() -> None:
    assert AckPacer.for_transport(SocketTransport(None)) is None  # type: ignore[arg-type]  # a fake transport
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        assert AckPacer.for_transport(SocketTransport(a)) is None  # type: ignore[arg-type]
    finally:
        a.close()
        b.close()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        pacer = AckPacer.for_transport(SocketTransport(tcp))  # type: ignore[arg-type]
        assert pacer is not None and pacer.acks_read("c") is True
    finally:
        tcp.close()


@linux_only
@pytest.mark.parametrize("ack_pacing", [True, False])
def test_the_ack_is_asked_for_after_reads_of_acks_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       ack_pacing: bool) -> None:
    """The protocol asks its pacer for the ACK after reads of the subscriber's acks, never
    after a publisher's reads (its PUBLISHes shrink no window); ``[broker] ack_pacing =
    false`` gives a connection no pacer at all.  Messages flow either way."""
    asked: list[str] = []
    original = AckPacer.acks_read

    def record(self: AckPacer, client_id: str) -> bool:
        asked.append(client_id)
        return original(self, client_id)

    monkeypatch.setattr(AckPacer, "acks_read", record)

    async def main() -> None:
        async with running(make_config(tmp_path / "d", max_inflight=8, ack_pacing=ack_pacing)) as b:
            await backlog(b.port, "count-sub", 40)
            received, _ = await asyncio.to_thread(_nagle_subscriber, b.port, "count-sub", 40, 30.0)
            assert received == 40
            pub = MQTTClient("count-pub", port=b.port)
            await pub.connect()
            for i in range(5):
                await pub.publish("elsewhere/t", b"%d" % i, qos=1)
            await pub.disconnect()

    asyncio.run(main())
    if ack_pacing:
        # 40 PUBACKs in reads of one or more; the publishers ("pace-pub", "count-pub") never.
        assert set(asked) == {"count-sub"} and 1 <= len(asked) <= 40
    else:
        assert asked == []
