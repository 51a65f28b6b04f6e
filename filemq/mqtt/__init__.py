"""MQTT 3.1.1: packets (:mod:`.packets`), the sans-I/O codec (:mod:`.codec`) and an asyncio
client (:mod:`.client`).

May import: ``filemq.common``. Must not import the queue, the broker, the upstream batch
format or operations: the codec knows bytes and packets, nothing of what a broker does.
"""

from filemq.mqtt.codec import Decoder, ProtocolError, encode
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)

__all__ = [
    "Connack",
    "Connect",
    "Decoder",
    "Disconnect",
    "Packet",
    "Pingreq",
    "Pingresp",
    "ProtocolError",
    "Puback",
    "Pubcomp",
    "Publish",
    "Pubrec",
    "Pubrel",
    "Suback",
    "Subscribe",
    "Unsuback",
    "Unsubscribe",
    "encode",
]
