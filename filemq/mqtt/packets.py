"""The 14 MQTT 3.1.1 control packets as plain typed classes (no I/O, no validation).

Instances are what :mod:`filemq.mqtt.codec` decodes and encodes.  Fields follow the OASIS
MQTT 3.1.1 names; strings are ``str`` (UTF-8 on the wire), binary fields are ``bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Packet type numbers (the high nibble of the first byte), spec 2.2.1.
CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14

PACKET_NAMES: dict[int, str] = {
    CONNECT: "CONNECT",
    CONNACK: "CONNACK",
    PUBLISH: "PUBLISH",
    PUBACK: "PUBACK",
    PUBREC: "PUBREC",
    PUBREL: "PUBREL",
    PUBCOMP: "PUBCOMP",
    SUBSCRIBE: "SUBSCRIBE",
    SUBACK: "SUBACK",
    UNSUBSCRIBE: "UNSUBSCRIBE",
    UNSUBACK: "UNSUBACK",
    PINGREQ: "PINGREQ",
    PINGRESP: "PINGRESP",
    DISCONNECT: "DISCONNECT",
}

PROTOCOL_NAME = "MQTT"
PROTOCOL_LEVEL = 4  # MQTT 3.1.1

# CONNACK return codes, spec 3.2.2.3.
CONNACK_ACCEPTED = 0x00
CONNACK_UNACCEPTABLE_PROTOCOL_VERSION = 0x01
CONNACK_IDENTIFIER_REJECTED = 0x02
CONNACK_SERVER_UNAVAILABLE = 0x03
CONNACK_BAD_USERNAME_OR_PASSWORD = 0x04
CONNACK_NOT_AUTHORIZED = 0x05

CONNACK_RETURN_CODE_NAMES: dict[int, str] = {
    CONNACK_ACCEPTED: "accepted",
    CONNACK_UNACCEPTABLE_PROTOCOL_VERSION: "unacceptable protocol version",
    CONNACK_IDENTIFIER_REJECTED: "identifier rejected",
    CONNACK_SERVER_UNAVAILABLE: "server unavailable",
    CONNACK_BAD_USERNAME_OR_PASSWORD: "bad user name or password",
    CONNACK_NOT_AUTHORIZED: "not authorized",
}

# SUBACK return code for a refused subscription, spec 3.9.3.
SUBACK_FAILURE = 0x80


@dataclass(slots=True)
class Connect:
    """CONNECT (client to server). ``will_topic`` is None when there is no will."""

    client_id: str = ""
    clean_session: bool = True
    keepalive: int = 60
    will_topic: str | None = None
    will_payload: bytes = b""
    will_qos: int = 0
    will_retain: bool = False
    username: str | None = None
    password: bytes | None = None
    protocol_name: str = PROTOCOL_NAME
    protocol_level: int = PROTOCOL_LEVEL


@dataclass(slots=True)
class Connack:
    """CONNACK (server to client)."""

    session_present: bool = False
    return_code: int = CONNACK_ACCEPTED


@dataclass(slots=True)
class Publish:
    """PUBLISH (both directions). ``packet_id`` is None exactly when ``qos`` is 0."""

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None


@dataclass(slots=True)
class Puback:
    """PUBACK: QoS 1 delivery done."""

    packet_id: int


@dataclass(slots=True)
class Pubrec:
    """PUBREC: QoS 2 delivery, part 1 (received)."""

    packet_id: int


@dataclass(slots=True)
class Pubrel:
    """PUBREL: QoS 2 delivery, part 2 (release)."""

    packet_id: int


@dataclass(slots=True)
class Pubcomp:
    """PUBCOMP: QoS 2 delivery, part 3 (complete)."""

    packet_id: int


@dataclass(slots=True)
class Subscribe:
    """SUBSCRIBE (client to server): ``topics`` is a non-empty list of (filter, requested QoS)."""

    packet_id: int
    topics: list[tuple[str, int]] = field(default_factory=list)


@dataclass(slots=True)
class Suback:
    """SUBACK (server to client): one return code per filter, 0-2 granted QoS or 0x80 failure."""

    packet_id: int
    return_codes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Unsubscribe:
    """UNSUBSCRIBE (client to server): a non-empty list of topic filters."""

    packet_id: int
    topics: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Unsuback:
    """UNSUBACK (server to client)."""

    packet_id: int


@dataclass(slots=True)
class Pingreq:
    """PINGREQ (client to server)."""


@dataclass(slots=True)
class Pingresp:
    """PINGRESP (server to client)."""


@dataclass(slots=True)
class Disconnect:
    """DISCONNECT (client to server)."""


Packet = (
    Connect
    | Connack
    | Publish
    | Puback
    | Pubrec
    | Pubrel
    | Pubcomp
    | Subscribe
    | Suback
    | Unsubscribe
    | Unsuback
    | Pingreq
    | Pingresp
    | Disconnect
)
