"""Hypothesis strategies of MQTT packets, shared by the codec tests (tests/test_codec*.py), the
fuzzers, the paho cross-checks and the collector's property tests.

MQTT 3.1.1 first (valid strings, topics, packet ids and the packets each side sends), then
MQTT 5.0 (OASIS Standard, 7 March 2019): arbitrary valid properties per packet kind and every
packet type with them; :func:`normalized` is a packet as the decoder gives it back.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from filemq.mqtt.codec import ALLOWED_PROPERTIES, PROPERTY_TYPES
from filemq.mqtt.packets import (
    AUTH_REASON_CODES,
    CONNACK_REASON_CODES,
    DISCONNECT_REASON_CODES,
    PUBACK_REASON_CODES,
    PUBREL_REASON_CODES,
    SUBACK_FAILURE,
    SUBACK_REASON_CODES,
    UNSUBACK_REASON_CODES,
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
    subscription_options,
)

# ---------------------------------------------------------------- MQTT 3.1.1

# Valid MQTT strings: no U+0000, no surrogates (spec 1.5.3).
mqtt_text = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=20
)
topic_names = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00+#"),
    min_size=1,
    max_size=30,
)
topic_filters = mqtt_text.filter(bool)
packet_ids = st.integers(1, 0xFFFF)
qos = st.integers(0, 2)
payloads = st.binary(max_size=300)


@st.composite
def publishes(draw: st.DrawFn) -> Publish:
    q = draw(qos)
    return Publish(
        topic=draw(topic_names),
        payload=draw(payloads),
        qos=q,
        retain=draw(st.booleans()),
        dup=draw(st.booleans()),
        packet_id=draw(packet_ids) if q else None,
    )


@st.composite
def connects(draw: st.DrawFn, v5: bool = False) -> Connect:
    """A CONNECT; ``v5``: an MQTT 5 one, with CONNECT and will properties."""
    will = draw(st.booleans())
    username = draw(st.none() | mqtt_text)
    # 3.1.1: a password only with a user name (MQTT-3.1.2-22); MQTT 5: a password alone is allowed
    password = draw(st.none() | st.binary(max_size=30)) if v5 or username is not None else None
    return Connect(
        client_id=draw(mqtt_text),
        clean_session=draw(st.booleans()),
        keepalive=draw(st.integers(0, 0xFFFF)),
        will_topic=draw(topic_names) if will else None,
        will_payload=draw(payloads) if will else b"",
        will_qos=draw(qos) if will else 0,
        will_retain=draw(st.booleans()) if will else False,
        username=username,
        password=password,
        protocol_level=5 if v5 else 4,
        properties=draw(properties("CONNECT")) if v5 else None,
        will_properties=draw(properties("WILL")) if v5 and will else None,
    )


client_packets: st.SearchStrategy[Packet] = st.one_of(
    connects(),
    publishes(),
    st.builds(Puback, packet_ids),
    st.builds(Pubrec, packet_ids),
    st.builds(Pubrel, packet_ids),
    st.builds(Pubcomp, packet_ids),
    st.builds(Subscribe, packet_ids, st.lists(st.tuples(topic_filters, qos), min_size=1, max_size=5)),
    st.builds(Unsubscribe, packet_ids, st.lists(topic_filters, min_size=1, max_size=5)),
    st.just(Pingreq()),
    st.just(Disconnect()),
)
server_packets: st.SearchStrategy[Packet] = st.one_of(
    st.builds(Connack, st.booleans(), st.integers(0, 5)),
    publishes(),
    st.builds(Puback, packet_ids),
    st.builds(Pubrec, packet_ids),
    st.builds(Pubrel, packet_ids),
    st.builds(Pubcomp, packet_ids),
    st.builds(
        Suback, packet_ids, st.lists(st.sampled_from([0, 1, 2, SUBACK_FAILURE]), min_size=1, max_size=5)
    ),
    st.builds(Unsuback, packet_ids),
    st.just(Pingresp()),
)


# ---------------------------------------------------------------- MQTT 5.0

MAX_VBI = 268_435_455


def _value(ident: int) -> st.SearchStrategy[object]:
    """Any valid value of property ``ident`` (spec 2.2.2.2 and the property's own section)."""
    _attr, ptype = PROPERTY_TYPES[ident]
    if ident in (0x01, 0x17, 0x19, 0x24, 0x25, 0x28, 0x29, 0x2A):
        return st.integers(0, 1)
    if ident in (0x21, 0x23):  # receive maximum, topic alias: 1..65535
        return st.integers(1, 0xFFFF)
    if ident == 0x27:  # maximum packet size: 1..2^32-1
        return st.integers(1, 0xFFFF_FFFF)
    return [
        st.integers(0, 0xFF),
        st.integers(0, 0xFFFF),
        st.integers(0, 0xFFFF_FFFF),
        st.integers(1, MAX_VBI),
        mqtt_text,
        st.binary(max_size=40),
    ][ptype]


@st.composite
def properties(draw: st.DrawFn, kind: str, subscription_ids: int = 0) -> Properties:
    """Arbitrary valid properties for packet ``kind`` (a key of ALLOWED_PROPERTIES): any
    subset of its allowed set, user properties repeated (keys too) in any order."""
    props = Properties()
    for ident in sorted(ALLOWED_PROPERTIES[kind]):
        attr, _ptype = PROPERTY_TYPES[ident]
        if ident == 0x26:
            props.user_properties = draw(st.lists(st.tuples(mqtt_text, mqtt_text), max_size=4))
        elif ident == 0x0B:
            props.subscription_identifiers = draw(st.lists(st.integers(1, MAX_VBI), max_size=subscription_ids))
        elif draw(st.booleans()):
            setattr(props, attr, draw(_value(ident)))
    if props.authentication_data is not None and props.authentication_method is None:
        props.authentication_method = draw(mqtt_text)
    return props


def connects5() -> st.SearchStrategy[Connect]:
    return connects(v5=True)


@st.composite
def publishes5(draw: st.DrawFn, to_client: bool = False) -> Publish:
    q = draw(qos)
    props = draw(properties("PUBLISH", subscription_ids=3 if to_client else 0))
    topic = draw(topic_names)
    if props.topic_alias is not None and draw(st.booleans()):
        topic = ""  # spec 3.3.2.1: the topic alias stands for the topic
    return Publish(topic, draw(payloads), q, draw(st.booleans()), draw(st.booleans()),
                   draw(packet_ids) if q else None, props)


@st.composite
def subscribes5(draw: st.DrawFn) -> Subscribe:
    topics = []
    for topic_filter in draw(st.lists(topic_filters, min_size=1, max_size=5)):
        no_local = draw(st.booleans()) and not topic_filter.startswith("$share/")
        options = subscription_options(draw(qos), no_local, draw(st.booleans()), draw(st.integers(0, 2)))
        topics.append((topic_filter, options))
    return Subscribe(draw(packet_ids), topics, draw(properties("SUBSCRIBE", subscription_ids=1)))


def _ack(cls: type[Puback | Pubrec | Pubrel | Pubcomp], codes: frozenset[int]) -> st.SearchStrategy[Packet]:
    return st.builds(cls, packet_ids, st.sampled_from(sorted(codes)), properties(cls.__name__.upper()))


def _server_disconnect(props: Properties) -> Properties:
    props.session_expiry_interval = None  # MQTT-3.14.2-2: never from the server
    return props


@st.composite
def connacks5(draw: st.DrawFn) -> Connack:
    code = draw(st.sampled_from(sorted(CONNACK_REASON_CODES)))
    return Connack(draw(st.booleans()) and code == 0, code, draw(properties("CONNACK")))


client_packets5: st.SearchStrategy[Packet] = st.one_of(
    connects5(),
    publishes5(),
    _ack(Puback, PUBACK_REASON_CODES),
    _ack(Pubrec, PUBACK_REASON_CODES),
    _ack(Pubrel, PUBREL_REASON_CODES),
    _ack(Pubcomp, PUBREL_REASON_CODES),
    subscribes5(),
    st.builds(Unsubscribe, packet_ids, st.lists(topic_filters, min_size=1, max_size=5), properties("UNSUBSCRIBE")),
    st.just(Pingreq()),
    st.builds(Disconnect, st.sampled_from(sorted(DISCONNECT_REASON_CODES)), properties("DISCONNECT")),
    st.builds(Auth, st.sampled_from(sorted(AUTH_REASON_CODES)), properties("AUTH")),
)
server_packets5: st.SearchStrategy[Packet] = st.one_of(
    connacks5(),
    publishes5(to_client=True),
    _ack(Puback, PUBACK_REASON_CODES),
    _ack(Pubrec, PUBACK_REASON_CODES),
    _ack(Pubrel, PUBREL_REASON_CODES),
    _ack(Pubcomp, PUBREL_REASON_CODES),
    st.builds(Suback, packet_ids, st.lists(st.sampled_from(sorted(SUBACK_REASON_CODES)), min_size=1, max_size=5),
              properties("SUBACK")),
    st.builds(Unsuback, packet_ids,
              st.lists(st.sampled_from(sorted(UNSUBACK_REASON_CODES)), min_size=1, max_size=5),
              properties("UNSUBACK")),
    st.just(Pingresp()),
    st.builds(Disconnect, st.sampled_from(sorted(DISCONNECT_REASON_CODES)),
              properties("DISCONNECT").map(_server_disconnect)),
    st.builds(Auth, st.sampled_from(sorted(AUTH_REASON_CODES)), properties("AUTH")),
)


def normalized(packet: Packet) -> Packet:
    """``packet`` as the decoder gives it back: a packet without properties has None (the wire
    cannot tell an empty ``Properties()`` from none)."""
    copy = dataclasses.replace(packet)
    for attr in ("properties", "will_properties"):
        if getattr(copy, attr, None) == Properties():
            setattr(copy, attr, None)
    return copy
