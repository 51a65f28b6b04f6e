"""The MQTT 3.1.1 and 5.0 control packets as plain typed classes (no I/O, no validation).

Instances are what :mod:`filemq.mqtt.codec` decodes and encodes.  Fields follow the OASIS
MQTT 3.1.1 names; strings are ``str`` (UTF-8 on the wire), binary fields are ``bytes``.

MQTT 5.0 (OASIS Standard, 7 March 2019) adds, on the same classes, ``properties`` (a
:class:`Properties`, None when a packet has none and always on a 3.1.1 connection), a ``reason_code`` on the acknowledgements
and DISCONNECT, reason codes per filter on UNSUBACK, subscription options in the SUBSCRIBE
option byte, and the AUTH packet.  The defaults (reason code 0, no properties) are exactly the
3.1.1 packets, so 3.1.1 code builds and reads them unchanged.
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
AUTH = 15  # MQTT 5.0 only; reserved in 3.1.1

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

PACKET_NAMES_V5: dict[int, str] = {**PACKET_NAMES, AUTH: "AUTH"}

PROTOCOL_NAME = "MQTT"
PROTOCOL_LEVEL = 4  # MQTT 3.1.1
PROTOCOL_LEVEL_5 = 5  # MQTT 5.0

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

# MQTT 5.0 subscription options byte (spec 3.8.3.1): bits 0-1 maximum QoS, bit 2 no local,
# bit 3 retain as published, bits 4-5 retain handling, bits 6-7 reserved.  On a 3.1.1
# connection the byte is just the requested QoS, so ``Subscribe.topics`` carries it for both.
SUB_QOS_MASK = 0x03
SUB_NO_LOCAL = 0x04
SUB_RETAIN_AS_PUBLISHED = 0x08
SUB_RETAIN_HANDLING_SHIFT = 4


def subscription_options(qos: int, no_local: bool = False, retain_as_published: bool = False,
                         retain_handling: int = 0) -> int:
    """The MQTT 5.0 subscription options byte (spec 3.8.3.1) for ``Subscribe.topics``."""
    return (qos | (SUB_NO_LOCAL if no_local else 0) | (SUB_RETAIN_AS_PUBLISHED if retain_as_published else 0)
            | (retain_handling << SUB_RETAIN_HANDLING_SHIFT))


# MQTT 5.0 reason codes (spec 2.4), the ones the codec itself produces or checks.
RC_SUCCESS = 0x00
RC_UNSPECIFIED_ERROR = 0x80
RC_MALFORMED_PACKET = 0x81
RC_PROTOCOL_ERROR = 0x82
RC_IMPLEMENTATION_SPECIFIC_ERROR = 0x83
RC_UNSUPPORTED_PROTOCOL_VERSION = 0x84
RC_BAD_AUTHENTICATION_METHOD = 0x8C
RC_TOPIC_ALIAS_INVALID = 0x94
RC_PACKET_TOO_LARGE = 0x95

# The reason codes each MQTT 5.0 packet may carry (spec 3.2.2.2, 3.4.2.1, 3.5.2.1, 3.6.2.1,
# 3.7.2.1, 3.9.3, 3.11.3, 3.14.2.1, 3.15.2.1).
CONNACK_REASON_CODES = frozenset(
    {0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95, 0x97,
     0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}
)
PUBACK_REASON_CODES = frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99})  # and PUBREC
PUBREL_REASON_CODES = frozenset({0x00, 0x92})  # and PUBCOMP
SUBACK_REASON_CODES = frozenset({0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2})
UNSUBACK_REASON_CODES = frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91})
# 0x99 on CONNACK is in 3.2.2.2 but not in 2.4's list, 0x8C on DISCONNECT in 2.4 but not in
# 3.14.2.1: both are accepted (and paho-mqtt knows only the 2.4 list).
DISCONNECT_REASON_CODES = frozenset(
    {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8C, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94, 0x95,
     0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2}
)
AUTH_REASON_CODES = frozenset({0x00, 0x18, 0x19})


@dataclass(slots=True)
class Properties:
    """MQTT 5.0 properties (spec 2.2.2.2): every identifier, None when absent.

    ``user_properties`` keeps wire order and may repeat a key; ``subscription_identifiers``
    holds the one of a SUBSCRIBE or the one per matching subscription of a delivered PUBLISH.
    Which properties a packet may carry is checked by the codec (``ALLOWED_PROPERTIES`` in
    :mod:`filemq.mqtt.codec`).
    """

    payload_format_indicator: int | None = None  # 0x01 byte
    message_expiry_interval: int | None = None  # 0x02 four-byte integer
    content_type: str | None = None  # 0x03
    response_topic: str | None = None  # 0x08
    correlation_data: bytes | None = None  # 0x09
    subscription_identifiers: list[int] = field(default_factory=list)  # 0x0B variable byte integer
    session_expiry_interval: int | None = None  # 0x11 four-byte integer
    assigned_client_identifier: str | None = None  # 0x12
    server_keep_alive: int | None = None  # 0x13 two-byte integer
    authentication_method: str | None = None  # 0x15
    authentication_data: bytes | None = None  # 0x16
    request_problem_information: int | None = None  # 0x17 byte
    will_delay_interval: int | None = None  # 0x18 four-byte integer
    request_response_information: int | None = None  # 0x19 byte
    response_information: str | None = None  # 0x1A
    server_reference: str | None = None  # 0x1C
    reason_string: str | None = None  # 0x1F
    receive_maximum: int | None = None  # 0x21 two-byte integer
    topic_alias_maximum: int | None = None  # 0x22 two-byte integer
    topic_alias: int | None = None  # 0x23 two-byte integer
    maximum_qos: int | None = None  # 0x24 byte
    retain_available: int | None = None  # 0x25 byte
    user_properties: list[tuple[str, str]] = field(default_factory=list)  # 0x26 string pair
    maximum_packet_size: int | None = None  # 0x27 four-byte integer
    wildcard_subscription_available: int | None = None  # 0x28 byte
    subscription_identifier_available: int | None = None  # 0x29 byte
    shared_subscription_available: int | None = None  # 0x2A byte


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
    # MQTT 5.0 (protocol_level 5) only: CONNECT properties and will properties.
    properties: Properties | None = None
    will_properties: Properties | None = None


@dataclass(slots=True)
class Connack:
    """CONNACK (server to client). On MQTT 5.0 ``return_code`` is the Connect Reason Code."""

    session_present: bool = False
    return_code: int = CONNACK_ACCEPTED
    properties: Properties | None = None


@dataclass(slots=True)
class Publish:
    """PUBLISH (both directions). ``packet_id`` is None exactly when ``qos`` is 0."""

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties | None = None
    # MQTT 5: ``properties``' message properties as a record stores them
    # (filemq.mqtt.properties.encode_message_headers), when the decoder has them at hand (a
    # property section it has seen before on the connection); None: not computed.
    headers: bytes | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class Puback:
    """PUBACK: QoS 1 delivery done."""

    packet_id: int
    reason_code: int = 0  # MQTT 5.0
    properties: Properties | None = None


@dataclass(slots=True)
class Pubrec:
    """PUBREC: QoS 2 delivery, part 1 (received)."""

    packet_id: int
    reason_code: int = 0  # MQTT 5.0
    properties: Properties | None = None


@dataclass(slots=True)
class Pubrel:
    """PUBREL: QoS 2 delivery, part 2 (release)."""

    packet_id: int
    reason_code: int = 0  # MQTT 5.0
    properties: Properties | None = None


@dataclass(slots=True)
class Pubcomp:
    """PUBCOMP: QoS 2 delivery, part 3 (complete)."""

    packet_id: int
    reason_code: int = 0  # MQTT 5.0
    properties: Properties | None = None


@dataclass(slots=True)
class Subscribe:
    """SUBSCRIBE (client to server): ``topics`` is a non-empty list of (filter, requested QoS).

    On MQTT 5.0 the int is the whole subscription options byte (:func:`subscription_options`);
    its low two bits are the QoS on both levels."""

    packet_id: int
    topics: list[tuple[str, int]] = field(default_factory=list)
    properties: Properties | None = None


@dataclass(slots=True)
class Suback:
    """SUBACK (server to client): one return code per filter, 0-2 granted QoS or 0x80 failure
    (on MQTT 5.0 one of ``SUBACK_REASON_CODES``)."""

    packet_id: int
    return_codes: list[int] = field(default_factory=list)
    properties: Properties | None = None


@dataclass(slots=True)
class Unsubscribe:
    """UNSUBSCRIBE (client to server): a non-empty list of topic filters."""

    packet_id: int
    topics: list[str] = field(default_factory=list)
    properties: Properties | None = None


@dataclass(slots=True)
class Unsuback:
    """UNSUBACK (server to client); MQTT 5.0 adds one reason code per filter."""

    packet_id: int
    reason_codes: list[int] = field(default_factory=list)  # MQTT 5.0 only, non-empty there
    properties: Properties | None = None


@dataclass(slots=True)
class Pingreq:
    """PINGREQ (client to server)."""


@dataclass(slots=True)
class Pingresp:
    """PINGRESP (server to client)."""


@dataclass(slots=True)
class Disconnect:
    """DISCONNECT (client to server; on MQTT 5.0 also server to client, with a reason code)."""

    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class Auth:
    """AUTH (MQTT 5.0 only, both directions): extended authentication exchange, spec 3.15."""

    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class PublishRun:
    """Consecutive MQTT 3.1.1 PUBLISHes with one topic, QoS, RETAIN and DUP flag (a device
    publishing to one topic): what ``Decoder(runs=True)`` gives for a run of equal-shaped
    ones instead of one :class:`Publish` each (MQTT 5: QoS 1 ones, each without properties or
    all with the same property section, without a topic alias).  ``packet_ids`` is None
    exactly for QoS 0; ``properties`` and ``headers`` are every message's (as
    :class:`Publish`'s)."""

    topic: str
    payloads: list[bytes]
    qos: int
    retain: bool
    dup: bool
    packet_ids: list[int] | None
    properties: Properties | None = None
    headers: bytes | None = None

    def publishes(self) -> list[Publish]:
        """The run as one :class:`Publish` per message, in order."""
        pids: list[int] | list[None] = self.packet_ids if self.packet_ids is not None else [None] * len(self.payloads)
        return [Publish(self.topic, payload, self.qos, self.retain, self.dup, pid, self.properties, self.headers)
                for payload, pid in zip(self.payloads, pids, strict=True)]


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
    | Auth
    | PublishRun
)
