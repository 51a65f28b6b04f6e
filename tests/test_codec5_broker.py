"""What the MQTT 5 codec changes at today's broker, which does not speak MQTT 5 yet: a real
level-5 CONNECT (properties and all) now decodes, so the broker answers it with the 3.1.1
CONNACK 0x01 "unacceptable protocol version" (spec 3.1.2-2 / MQTT 5 3.1.4) and closes, where
it used to close on a framing error with no CONNACK.  The broker part of issue 13 replaces this."""

from __future__ import annotations

from pathlib import Path

from filemq.mqtt.codec import Decoder, encode, encode5
from filemq.mqtt.packets import Connack, Connect, Properties, Publish
from tests.test_broker_session import Harness, run


def test_level_5_connect_is_refused_with_0x01(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.client()
        connect = Connect(client_id="v5", protocol_level=5, will_topic="w", will_payload=b"bye",
                          properties=Properties(session_expiry_interval=60, user_properties=[("a", "b")]),
                          will_properties=Properties(will_delay_interval=5))
        # Pipelined behind the CONNECT, as clients do: it must not be handled either.
        c.send_bytes(encode(connect) + encode5(Publish("t", b"x", 1, packet_id=1,
                                                      properties=Properties(content_type="c"))))
        assert c.received() == [Connack(False, 0x01)]
        assert c.conn.closed and c.transport.closed
        # An MQTT 5 client can read that refusal (3.1.4: the server answers in its own level).
        client_side = Decoder(server=False, protocol_level=5)
        client_side.feed(encode(Connack(False, 0x01)))
        assert client_side.packets() == [Connack(False, 0x01)]
    run(main())
