"""The protocol points an outside conformance run and Mosquitto's own broker tests found
(issue 33): packet-level tests through the sans-I/O connection and core, each citing the
OASIS rule it checks (MQTT 5.0 of 7 March 2019 unless it says 3.1.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from filemq.mqtt.packets import (
    Connect,
    Disconnect,
    Publish,
)
from tests.test_broker_mqtt5 import client5
from tests.test_broker_session import Harness, run

PROTOCOL_ERROR = 0x82


# ---- a packet that parses but breaks a rule is a Protocol Error (0x82), not Malformed -------


def test_second_connect_gets_disconnect_0x82_mqtt_3_1_0_2(tmp_path: Path) -> None:
    """MQTT-3.1.0-2: a second CONNECT is a Protocol Error; the server closes with DISCONNECT
    0x82 (4.13.2), not 0x81 Malformed Packet: the packet itself is well formed."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        assert c.connect("twice").return_code == 0
        c.send(Connect(client_id="twice", protocol_level=5))
        assert c.received() == [Disconnect(PROTOCOL_ERROR)]
        assert c.conn.closed and c.transport.closed and "MQTT-3.1.0-2" in c.conn.close_reason
    run(main())


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"\x32\x06\x00\x01t\x00\x00\x00", id="PUBLISH QoS 1"),
        pytest.param(b"\x34\x06\x00\x01t\x00\x00\x00", id="PUBLISH QoS 2"),
        pytest.param(b"\x40\x02\x00\x00", id="PUBACK"),
        pytest.param(b"\x82\x06\x00\x00\x00\x00\x01t\x00", id="SUBSCRIBE"),
        pytest.param(b"\xa2\x05\x00\x00\x00\x00\x01t", id="UNSUBSCRIBE"),
    ],
)
def test_packet_id_0_gets_disconnect_0x82_mqtt_2_2_1_3(tmp_path: Path, wire: bytes) -> None:
    """MQTT-2.2.1-3: PUBLISH (QoS > 0), SUBSCRIBE and UNSUBSCRIBE carry a non-zero packet id
    (and so does each ack, 2.2.1). Packet id 0 parses, so breaking the rule is a Protocol
    Error: DISCONNECT 0x82, not 0x81 -- also behind a PUBLISH that took the decoder's fast
    path with the same topic."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        assert c.connect("pid0").return_code == 0
        c.send(Publish("t", b"ok", 0))
        c.send_bytes(wire)
        assert c.received() == [Disconnect(PROTOCOL_ERROR)]
        assert c.conn.closed and "packet id 0" in c.conn.close_reason
    run(main())
