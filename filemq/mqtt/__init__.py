"""MQTT 3.1.1 and 5.0: packets (:mod:`.packets`), the sans-I/O codec (:mod:`.codec`, over
:mod:`.codec5`, :mod:`.properties` and :mod:`.wire`) and an asyncio 3.1.1 client (:mod:`.client`).

May import: ``filemq.common``. Must not import the queue, the broker, the upstream batch
format or operations: the codec knows bytes and packets, nothing of what a broker does.
"""

from filemq.mqtt.codec import Decoder, ProtocolError, encode, encode5, encoder
from filemq.mqtt.packets import (
    Auth,
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
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)

__all__ = [
    "Auth",
    "Connack",
    "Connect",
    "Decoder",
    "Disconnect",
    "Packet",
    "Pingreq",
    "Pingresp",
    "Properties",
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
    "encode5",
    "encoder",
]
