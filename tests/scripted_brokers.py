"""Two minimal MQTT servers on loopback, on our codec, for the tests of MQTT clients.

:class:`ScriptedBroker` stands for a destination broker (the agent's MQTT exports): it records
every packet, acknowledges each PUBLISH or holds it as told (:meth:`ScriptedBroker.release`),
and can answer as a broken broker does. :class:`AnsweringBroker` answers each packet with
what a script function returns (tests/test_client.py's reconnect and keepalive tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from filemq.mqtt.codec import Decoder, encode, encode5
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
)


class ScriptedBroker:
    """A minimal MQTT server on loopback that records every packet and acks as told.

    ``ack`` decides per PUBLISH whether to acknowledge it now (default: yes); ``held`` keeps
    the ones not acknowledged so a test can release them later with :meth:`release`.
    """

    def __init__(self) -> None:
        self.port = 0
        self.connects: list[Connect] = []
        self.packets: list[tuple[int, Packet]] = []  # (connection number, packet)
        self.ack: Callable[[int, Publish], bool] = lambda conn, p: True
        # True: answer this QoS 1 PUBLISH with PUBREC, as a broken destination does (never PUBACK)
        self.pubrec_for_qos1: Callable[[int, Publish], bool] = lambda conn, p: False
        # bytes to answer this PUBLISH with instead of its acknowledgement (None: the usual answer)
        self.raw_reply: Callable[[int, Publish], bytes | None] = lambda conn, p: None
        self.session_present = True
        self.levels: tuple[int, ...] = (4, 5)  # protocol levels it accepts
        self.connack_properties: Properties | None = None  # MQTT 5 CONNACK properties
        self.held: list[tuple[asyncio.StreamWriter, Publish]] = []
        self.changed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_connections()

    def drop_connections(self) -> None:
        for w in self._writers:
            w.close()
        self._writers.clear()

    def publishes(self, conn: int | None = None) -> list[Publish]:
        return [p for c, p in self.packets if isinstance(p, Publish) and (conn is None or c == conn)]

    def release(self) -> None:
        held, self.held = self.held, []
        for writer, p in held:
            assert p.packet_id is not None
            writer.write(encode(Puback(p.packet_id) if p.qos == 1 else Pubrec(p.packet_id)))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = len(self.connects)
        self._writers.append(writer)
        decoder = Decoder(1 << 20, server=True)
        try:
            while data := await reader.read(1 << 16):
                decoder.feed(data)
                for packet in decoder.packets():
                    self.packets.append((conn, packet))
                    self.changed.set()
                    if isinstance(packet, Connect):
                        self.connects.append(packet)
                        if packet.protocol_level not in self.levels:
                            # As a 3.1.1-only broker answers a level it does not speak (MQTT-3.1.2-2).
                            writer.write(encode(Connack(False, 0x01)))
                            return
                        ack = Connack(self.session_present and not packet.clean_session, 0)
                        if packet.protocol_level == 5:
                            ack.properties = self.connack_properties
                            writer.write(encode5(ack))
                        else:
                            writer.write(encode(ack))
                    elif isinstance(packet, Publish):
                        assert packet.packet_id is not None
                        raw = self.raw_reply(conn, packet)
                        if raw is not None:
                            writer.write(raw)
                        elif packet.qos == 1 and self.pubrec_for_qos1(conn, packet):
                            writer.write(encode(Pubrec(packet.packet_id)))
                        elif self.ack(conn, packet):
                            writer.write(encode(Puback(packet.packet_id) if packet.qos == 1 else Pubrec(packet.packet_id)))
                        else:
                            self.held.append((writer, packet))
                    elif isinstance(packet, Pubrel):
                        writer.write(encode(Pubcomp(packet.packet_id)))
                    elif isinstance(packet, Pingreq):
                        writer.write(encode(Pingresp()))
                    elif isinstance(packet, Disconnect):
                        return
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


class AnsweringBroker:
    """A tiny server using our Decoder: records what it decodes, answers via a script."""

    def __init__(self, answer: Callable[[Packet, int], list[Packet]]) -> None:
        self.answer = answer
        self.received: list[Packet] = []
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        self.writers.append(writer)
        decoder = Decoder(server=True)
        try:
            while data := await reader.read(65536):
                decoder.feed(data)
                for packet in decoder.packets():
                    self.received.append(packet)
                    for reply in self.answer(packet, conn):
                        writer.write(encode(reply))
        finally:
            writer.close()

    async def wait_for(self, predicate: Callable[[list[Packet]], bool], timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate(self.received):
                await asyncio.sleep(0.01)
