"""A loopback TCP proxy that counts the MQTT PUBACKs a destination broker sends back.

The MQTT export bench's ``puback`` oracle: the export (or mosquitto's bridge) connects to the
proxy instead of the destination broker, the proxy pipes the bytes both ways and parses the
destination -> client direction packet by packet. The destination's PUBACK is its statement
that it holds the message (what an export's offset waits for), so the time from the first to
the N-th PUBACK is the drain time, with no subscriber's cost on the shared cores.

It runs its own event loop in a thread: :meth:`AckCounter.wait` blocks the caller until N
PUBACKs came back or the timeout passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from bench.harness.cpu import cpu_seconds

PUBACK = 0x40
_PUBACK_FIRST = bytes((PUBACK,))
_PUBACK_LEN = b"\x02"


class Pipe(asyncio.Protocol):
    """One direction of a proxied connection: what it receives goes to ``peer``."""

    def __init__(self, counter: AckCounter | None) -> None:
        self.peer: asyncio.Transport | None = None
        self.transport: asyncio.Transport | None = None
        self.counter = counter
        self.pending = b""
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.counter is not None:
            self._count(data)
        if self.peer is None:
            self.early.append(data)
        else:
            self.peer.write(data)

    def _count(self, data: bytes) -> None:
        buf = self.pending + data if self.pending else data
        n = len(buf) >> 2
        if n and not len(buf) & 3 and buf[0::4] == _PUBACK_FIRST * n and buf[1::4] == _PUBACK_LEN * n:
            # Nothing but whole PUBACKs (the usual read during a drain): counted in C.
            self.pending = b""
            assert self.counter is not None
            self.counter._acked(n)
            return
        pos, end, acks = 0, len(buf), 0
        while end - pos >= 2:
            i, length, mult, complete = pos + 1, 0, 1, False
            while i < end and i < pos + 5:  # the remaining length: 1-4 bytes
                byte = buf[i]
                i += 1
                length += (byte & 0x7F) * mult
                if not byte & 0x80:
                    complete = True
                    break
                mult <<= 7
            if not complete or i + length > end:
                break
            if buf[pos] == PUBACK:
                acks += 1
            pos = i + length
        self.pending = buf[pos:]
        if acks:
            assert self.counter is not None
            self.counter._acked(acks)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peer.close()


class AckCounter:
    """Proxy 127.0.0.1:``port`` -> 127.0.0.1:``target_port``, counting PUBACKs coming back."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.acks = 0
        self.first: float | None = None
        self.last: float | None = None
        self._goal = 0
        self.sample_at_first: int | None = None  # a pid whose CPU seconds are read at the first PUBACK
        self.sampled_cpu: float | None = None
        self.cpu_seconds = 0.0  # the proxy thread's own CPU, set when it stops
        self._done = threading.Event()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="ackcount", daemon=True)

    def start(self) -> AckCounter:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the PUBACK-counting proxy did not start")
        return self

    def wait(self, count: int, timeout: float) -> bool:
        """Block until ``count`` PUBACKs came back (True) or ``timeout`` seconds passed."""
        self._done.clear()
        self._goal = count
        if self.acks >= count:
            return True
        return self._done.wait(timeout)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _acked(self, n: int) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            if self.sample_at_first is not None:
                self.sampled_cpu = cpu_seconds(self.sample_at_first)
        self.acks += n
        self.last = now
        if self._goal and self.acks >= self._goal:
            self._done.set()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop

        def client_side() -> Pipe:
            inbound = Pipe(None)  # client -> destination

            async def connect() -> None:
                outbound = Pipe(self)  # destination -> client, counted
                try:
                    transport, _ = await loop.create_connection(lambda: outbound, "127.0.0.1", self.target_port)
                except OSError:
                    if inbound.transport is not None:
                        inbound.transport.close()
                    return
                outbound.peer = inbound.transport
                inbound.peer = transport
                for chunk in inbound.early:
                    transport.write(chunk)
                inbound.early.clear()
                if inbound.transport is None or inbound.transport.is_closing():
                    transport.close()

            loop.create_task(connect())
            return inbound

        server = loop.run_until_complete(loop.create_server(client_side, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self.cpu_seconds = time.thread_time()
            server.close()
            with contextlib.suppress(Exception):
                loop.run_until_complete(server.wait_closed())
            loop.close()
