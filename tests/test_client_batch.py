"""``MQTTClient.publish_batch``: many QoS 1/2 publishes in one socket write, completion
reported by packet id through ``on_complete``, the DUP flag on request, and the same
resend-with-DUP-after-reconnect rule as every publish (MQTT-4.4.0-1)."""

from __future__ import annotations

import asyncio

from filemq.mqtt.client import MQTTClient
from filemq.mqtt.packets import Connack, Connect, Packet, Puback, Pubcomp, Publish, Pubrec, Pubrel
from tests.scripted_brokers import AnsweringBroker


def test_publish_batch_completes_by_packet_id_and_resends_with_dup() -> None:
    def answer(packet: Packet, conn: int) -> list[Packet]:
        if isinstance(packet, Connect):
            return [Connack(session_present=conn > 1)]
        if isinstance(packet, Publish) and conn > 1:
            assert packet.packet_id is not None
            return [Puback(packet.packet_id)] if packet.qos == 1 else [Pubrec(packet.packet_id)]
        if isinstance(packet, Pubrel):
            return [Pubcomp(packet.packet_id)]
        return []

    async def scenario() -> None:
        fake = AnsweringBroker(answer)
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = MQTTClient("batcher", port=port, clean_session=False, max_inflight=10)
        completed: list[int] = []
        client.on_complete = completed.extend
        await client.connect()
        ids = client.publish_batch([("t/a", b"1", False, False), ("t/b", b"2", True, True)], qos=1)
        ids2 = client.publish_batch([("t/c", b"3", False, False)], qos=2)
        await fake.wait_for(lambda got: sum(isinstance(p, Publish) for p in got) == 3)
        first = [p for p in fake.received if isinstance(p, Publish)]
        # MQTT-3.3.1-1: DUP as asked on the first attempt; retain passed through.
        assert [(p.topic, p.dup, p.retain, p.packet_id) for p in first] == [
            ("t/a", False, False, ids[0]), ("t/b", True, True, ids[1]), ("t/c", False, False, ids2[0])]
        for w in fake.writers:
            w.transport.abort()
        await asyncio.wait_for(client.wait_closed(), 5)
        assert completed == []
        await client.connect()
        async with asyncio.timeout(5):
            while sorted(completed) != sorted(ids + ids2):
                await asyncio.sleep(0.01)
        again = [p for p in fake.received if isinstance(p, Publish)][3:]
        # MQTT-4.4.0-1: resent with the original packet ids, DUP set, in order.
        assert [(p.packet_id, p.dup) for p in again] == [(ids[0], True), (ids[1], True), (ids2[0], True)]
        assert client.session.inflight == 0
        await client.disconnect()
        server.close()

    asyncio.run(asyncio.wait_for(scenario(), 20))
