"""A loopback TCP proxy for tests: forwards connections and can cut them at a chosen byte.

``TcpProxy(target_port)`` listens on 127.0.0.1 (``port`` after :meth:`start`) and pipes each
accepted connection to ``127.0.0.1:target_port``. :meth:`cut_after` arms a cut: once that
many more bytes have gone client -> server (summed over connections), every open connection
is reset, in the middle of whatever packet was passing. :meth:`cut_now` resets at once;
``refuse`` makes new connections fail immediately (an unreachable collector).
:meth:`flip_in` arms a byte flip: the next client -> server chunk that holds a given byte
string has one of its bytes XORed in transit (damage a link-layer CRC would miss).
``hold_down = True`` holds every server -> client byte (the server goes silent, the
connections stay open) until it is set back to False.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.refuse = False
        self.cuts = 0
        self.bytes_up = 0
        self.flips = 0
        self._down_open = asyncio.Event()
        self._down_open.set()
        self._cut_at: int | None = None
        self._flip: tuple[bytes, int, int] | None = None
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut_now(count=False)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    @property
    def hold_down(self) -> bool:
        return not self._down_open.is_set()

    @hold_down.setter
    def hold_down(self, hold: bool) -> None:
        if hold:
            self._down_open.clear()
        else:
            self._down_open.set()

    @property
    def cut_armed(self) -> bool:
        """A cut armed by :meth:`cut_after` has not happened yet."""
        return self._cut_at is not None

    def cut_after(self, nbytes: int) -> None:
        """Reset every connection once ``nbytes`` more bytes went upstream."""
        self._cut_at = self.bytes_up + nbytes

    def flip_in(self, needle: bytes, index: int, mask: int = 0x20) -> None:
        """XOR ``mask`` into byte ``index`` of the next upstream occurrence of ``needle`` (once)."""
        if not 0 <= index < len(needle) or not 0 < mask < 256:
            raise ValueError("index must fall inside needle and mask must be 1..255")
        self._flip = (needle, index, mask)

    def _maybe_flip(self, data: bytes) -> bytes:
        if self._flip is None:
            return data
        needle, index, mask = self._flip
        at = data.find(needle)
        if at < 0:
            return data
        self._flip = None
        self.flips += 1
        damaged = bytearray(data)
        damaged[at + index] ^= mask
        return bytes(damaged)

    def cut_now(self, count: bool = True) -> None:
        if count and self._pairs:
            self.cuts += 1
        self._cut_at = None
        for client, upstream in list(self._pairs):
            for writer in (client, upstream):
                _reset(writer)
        self._pairs.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            _reset(writer)
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer, pair, upstream=True)),
            asyncio.create_task(self._pipe(up_reader, writer, pair, upstream=False)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        *,
        upstream: bool,
    ) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if upstream and self._cut_at is not None:
                    room = self._cut_at - self.bytes_up
                    if room < len(data):
                        # Deliver the bytes before the cut point, then reset mid-stream.
                        if room > 0:
                            writer.write(data[:room])
                            self.bytes_up += room
                            with contextlib.suppress(OSError):
                                await writer.drain()
                        self.cut_now()
                        return
                if upstream:
                    self.bytes_up += len(data)
                    data = self._maybe_flip(data)
                else:
                    await self._down_open.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if pair in self._pairs:
                self._pairs.discard(pair)
                for w in pair:
                    _reset(w)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0) so the peer sees a broken connection, not a clean end."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.transport.abort()
