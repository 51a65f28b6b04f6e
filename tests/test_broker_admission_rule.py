"""PUBLISH admission has one home (issue 31 item 3): ``Ingest.admit`` and the rules of
``Ingest._rule_broken`` decide every PUBLISH, whichever entry it comes through -- one at a time
(``on_publish``), a read's run (``on_publishes``) or a decoded :class:`PublishRun`
(``on_publish_run``).  So the same PUBLISHes get the same answers whether each comes in a read
of its own or all in one read: the same bytes back (PUBACK/PUBREC, MQTT 5 reason codes,
DISCONNECT), the same records stored, the same connection closed or not, the same log lines.

The rules driven: MQTT-3.3.1-2 (DUP at QoS 0), ``max_topic_length`` in UTF-8 bytes (multi-byte
topics around it), MQTT-3.3.2-14 (a response topic is a topic name), 3.3.2.3.2 (payload format
indicator 1 and a payload that is not UTF-8: 0x99), ``message_size_limit`` (3.1.1: close; MQTT
5: 0x97, QoS 0 0x95), no ``$`` topics from clients (MQTT-4.7.2-1: acknowledged and dropped,
MQTT 5 0x87), the ACL (ack and drop or disconnect, MQTT 5 0x87), QoS 2 dedup (4.3.3: PUBREC
again, stored once), the publish hook."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from filemq.broker.acl import Acl
from filemq.broker.publish import (
    ACK_DROP,
    ALONE,
    CLOSE,
    PROTOCOL_ERROR,
    PUBREC_AGAIN,
    REFUSE,
    RULE_ACL,
    RULE_DOLLAR_TOPIC,
    RULE_DUP_AT_QOS_0,
    RULE_PAYLOAD_NOT_UTF8,
    RULE_RESPONSE_TOPIC,
    RULE_TOO_LARGE,
    RULE_TOPIC_TOO_LONG,
    STORE,
)
from filemq.broker.session_state import HookResult
from filemq.mqtt.packets import Properties, Puback, Publish, PublishRun
from tests.broker_harness import Client, run
from tests.broker_harness5 import Harness5, client5

MAX_TOPIC = 20  # bytes of UTF-8
LIMIT = 32  # message_size_limit

# Characters of 1, 2, 3 and 4 UTF-8 bytes: a topic of n characters is n..4n bytes.
_CHARS = ["a", "x", "/", "é", "€", "𝄞"]
_EDGE_TOPICS = ["a" * MAX_TOPIC, "a" * (MAX_TOPIC + 1), "é" * (MAX_TOPIC // 2), "é" * (MAX_TOPIC // 2) + "a",
                "€" * (MAX_TOPIC // 3) + "aa", "𝄞" * (MAX_TOPIC // 4), "𝄞" * (MAX_TOPIC // 4) + "a",
                "x/" + "é" * 9, "$SYS/" + "a" * 15, "$x"]
_topic = st.one_of(
    st.sampled_from(_EDGE_TOPICS),
    st.builds(lambda dollar, chars: ("$" if dollar else "") + "".join(chars),
              st.sampled_from([False, False, False, True]), st.lists(st.sampled_from(_CHARS), min_size=1, max_size=12)))
_edge_payload = st.sampled_from([b"", b"x" * LIMIT, b"x" * (LIMIT + 1), "é".encode() * (LIMIT // 2), b"\xff\xfe"])
_payload = st.one_of(st.binary(max_size=LIMIT + 8), st.text(max_size=LIMIT // 2).map(str.encode), _edge_payload)
_properties = st.one_of(
    st.none(),
    st.builds(Properties, payload_format_indicator=st.sampled_from([None, 0, 1]),
              response_topic=st.sampled_from([None, None, "r/1", "r/+"]),
              content_type=st.sampled_from([None, "text/plain"]),
              user_properties=st.sampled_from([[], [("k", "v")]])))
# A group: messages of one shape (topic, QoS, RETAIN, DUP, properties): 1..3 payloads, or 5..7
# of one size, of which one read decodes all but the first (its topic not yet in the decoder's
# cache) as one PublishRun.
_group = st.tuples(_topic, st.sampled_from([0, 1, 1, 1, 2]), st.booleans(), st.sampled_from([False] * 7 + [True]),
                   _properties, st.one_of(st.lists(_payload, min_size=1, max_size=3),
                                          st.tuples(st.one_of(_edge_payload, _payload), st.integers(5, 7))
                                          .map(lambda pn: [pn[0]] * pn[1])))


def _publishes(groups: list[tuple[Any, ...]], v5: bool) -> list[Publish]:
    """The groups' PUBLISHes: QoS 1 ids unique, QoS 2 ids from two (a repeated one while its
    PUBREL has not come is a re-send: 4.3.3)."""
    out: list[Publish] = []
    next_pid = 1
    for k, (topic, qos, retain, dup, props, payloads) in enumerate(groups):
        for payload in payloads:
            if qos == 1:
                pid: int | None = next_pid
                next_pid += 1
            else:
                pid = 1000 + k % 2 if qos == 2 else None
            out.append(Publish(topic, payload, qos, retain, dup, pid, props if v5 else None))
    return out


def _hook(info: Any, p: Publish) -> HookResult:
    """Rejects a topic ending in "x/x", acknowledges and drops one ending in "a/x", stores the
    rest with the payload reversed."""
    if p.topic.endswith("x/x"):
        return HookResult.reject("no x/x")
    if p.topic.endswith("a/x"):
        return HookResult.ack_drop("not a/x")
    return HookResult.store(p.payload[::-1])


async def _answers(tmp: Path, ps: list[Publish], v5: bool, one_read: bool, acl: str | None, disconnect: bool,
                   hook: bool, caplog: pytest.LogCaptureFixture) -> tuple[Any, ...]:
    """Send ``ps`` from one client, each in a read of its own or all in one read; commit:
    what the broker answered."""
    h = Harness5(tmp, max_topic_length=MAX_TOPIC, message_size_limit=LIMIT,
                 acl_denied_publish="disconnect" if disconnect else "ack_drop")
    if hook:
        h.hook = _hook
        h.core = h.make_core()
    if acl is not None:
        h.core.acl = Acl.parse(acl)
    c: Client = client5(h) if v5 else h.client()
    c.connect("p", username="u")
    real = h.core.on_publish_run

    def run_entry(conn: Any, r: PublishRun) -> None:
        event("a PublishRun")
        real(conn, r)

    h.core.on_publish_run = run_entry
    caplog.clear()
    if one_read:
        c.send(*ps)
    else:
        for p in ps:
            if c.conn.closed:
                break
            c.send(p)
    await h.commit()
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "filemq.broker"]
    records = [(r.offset, r.topic, r.payload, r.qos, r.retain, r.headers) for r in h.queue.log.records]
    return (bytes(c.transport.data), records, c.conn.closed, c.conn.close_reason, h.stats.messages_received,
            h.stats.publish_dropped, logged)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=st.lists(_group, min_size=1, max_size=6), v5=st.booleans(),
       acl=st.sampled_from([None, "pattern readwrite #\npattern deny x/#\n", "pattern write a/#\npattern write é/#\n"]),
       disconnect=st.booleans(), hook=st.sampled_from([False, False, True]))
def test_publishes_one_read_each_or_all_in_one_read_get_the_same_answers_mqtt_3_3_1_2_3_3_2_14_3_3_2_3_2(
        tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture, groups: list[tuple[Any, ...]],
        v5: bool, acl: str | None, disconnect: bool, hook: bool) -> None:
    """Random PUBLISHes -- topics around ``max_topic_length`` in UTF-8 bytes (MQTT 1.5.4: a
    character is 1-4 bytes), payloads around ``message_size_limit``, ``$`` topics
    (MQTT-4.7.2-1), ACL denies, DUP at QoS 0 (MQTT-3.3.1-2), QoS 0/1/2 with re-sent QoS 2 ids
    (4.3.3), MQTT 3.1.1 and 5, with and without properties (a response topic that is not a
    topic name, MQTT-3.3.2-14; payload format indicator 1, 3.3.2.3.2), with and without a
    publish hook -- sent each in a read of its own, then all in one read (runs of equal-shaped
    ones decoded as PublishRuns): the same bytes back, the same records, closed or not alike,
    the same close reason, counts and log lines."""
    ps = _publishes(groups, v5)
    with caplog.at_level(logging.INFO, "filemq.broker"):
        alone = run(_answers(tmp_path_factory.mktemp("alone"), ps, v5, False, acl, disconnect, hook, caplog))
        batched = run(_answers(tmp_path_factory.mktemp("batched"), ps, v5, True, acl, disconnect, hook, caplog))
    assert batched == alone


# ---- the rules themselves ---------------------------------------------------------------------


def _admission(tmp: Path, p: Publish, v5: bool = True, **broker: Any) -> tuple[int, Any]:
    """(the rule ``p`` breaks, admission's verdict) for ``p`` from a connected client."""
    async def main() -> tuple[int, Any]:
        tmp.mkdir(exist_ok=True)
        h = Harness5(tmp, max_topic_length=MAX_TOPIC, message_size_limit=LIMIT, **broker)
        h.core.acl = Acl.parse("pattern readwrite #\npattern deny x/#\n")
        c = client5(h) if v5 else h.client()
        c.connect("p", username="u")
        ingest = h.core.ingest
        rule = ingest._rule_broken(c.conn, p.topic, p.qos, p.dup, len(p.payload), p.properties, p.payload)
        return rule, ingest.admit(c.conn, p)
    return run(main())  # type: ignore[no-any-return]


@pytest.mark.parametrize(("p", "v5", "rule", "action", "code"), [
    # MQTT-3.3.1-2: checked first, before the topic's length.
    (Publish("a" * 99, b"", 0, dup=True), True, RULE_DUP_AT_QOS_0, PROTOCOL_ERROR, 0x81),
    # max_topic_length counts UTF-8 bytes: 10 "é" are 20 bytes (not too long), 11 are 22.
    (Publish("é" * 10, b"", 1, packet_id=1), False, 0, STORE, 0),
    (Publish("é" * 10 + "a", b"", 1, packet_id=1), False, RULE_TOPIC_TOO_LONG, CLOSE, 0),
    # MQTT-3.3.2-14, then 3.3.2.3.2: a response topic is checked before the payload format.
    (Publish("t", b"\xff", 1, packet_id=1, properties=Properties(response_topic="r/#", payload_format_indicator=1)),
     True, RULE_RESPONSE_TOPIC, PROTOCOL_ERROR, 0x82),
    (Publish("t", b"\xff", 1, packet_id=1, properties=Properties(payload_format_indicator=1)),
     True, RULE_PAYLOAD_NOT_UTF8, REFUSE, 0x99),
    (Publish("t", b"\xff", 0, properties=Properties(payload_format_indicator=1)),
     True, RULE_PAYLOAD_NOT_UTF8, CLOSE, 0x99),  # QoS 0: no ack to carry it, DISCONNECT 0x99
    # message_size_limit: MQTT 5 0x97 (QoS 0: DISCONNECT 0x95); 3.1.1 closes, no ack.
    (Publish("t", b"x" * (LIMIT + 1), 1, packet_id=1), True, RULE_TOO_LARGE, REFUSE, 0x97),
    (Publish("t", b"x" * (LIMIT + 1), 0), True, RULE_TOO_LARGE, CLOSE, 0x95),
    (Publish("t", b"x" * (LIMIT + 1), 2, packet_id=1), False, RULE_TOO_LARGE, CLOSE, 0),
    # MQTT-4.7.2-1: no $ topics from clients (before the ACL), 0x87 or acknowledged and dropped.
    (Publish("$x/y", b"", 2, packet_id=1), True, RULE_DOLLAR_TOPIC, REFUSE, 0x87),
    (Publish("$x/y", b"", 1, packet_id=1), False, RULE_DOLLAR_TOPIC, ACK_DROP, 0),
    (Publish("x/y", b"", 1, packet_id=1), True, RULE_ACL, REFUSE, 0x87),
    (Publish("x/y", b"", 1, packet_id=1), False, RULE_ACL, ACK_DROP, 0),
    (Publish("x/y", b"", 0), True, RULE_ACL, REFUSE, 0x87),  # QoS 0: dropped
])
def test_each_rule_has_its_verdict_by_protocol_mqtt_3_3_1_2_3_3_2_14_3_3_2_3_2(
        tmp_path: Path, p: Publish, v5: bool, rule: int, action: int, code: int) -> None:
    """The rule a PUBLISH breaks and the verdict it gets: MQTT 3.1.1 has no negative ack (close,
    or acknowledge and drop), MQTT 5 answers with a reason code on PUBACK/PUBREC (QoS 0: drop,
    or DISCONNECT with the code where the rule calls for it)."""
    got_rule, verdict = _admission(tmp_path, p, v5)
    assert (got_rule, verdict.action, verdict.code) == (rule, action, code)


def test_acl_disconnect_closes_a_qos0_mqtt5_publish_with_0x87(tmp_path: Path) -> None:
    """``acl_denied_publish = disconnect``: an MQTT 5 QoS 0 PUBLISH the ACL denies closes its
    connection with DISCONNECT 0x87 (it has no ack to carry the code); a QoS 1 one gets
    PUBACK 0x87 and the connection stays."""
    _, verdict = _admission(tmp_path / "0", Publish("x/y", b"", 0), acl_denied_publish="disconnect")
    assert (verdict.action, verdict.code) == (CLOSE, 0x87)
    _, verdict = _admission(tmp_path / "1", Publish("x/y", b"", 1, packet_id=1), acl_denied_publish="disconnect")
    assert (verdict.action, verdict.code) == (REFUSE, 0x87)


def test_a_run_asks_the_same_rules_without_a_payload(tmp_path: Path) -> None:
    """Asked for a run (no payload), the rules answer ALONE for what needs admission one
    PUBLISH at a time even when it breaks nothing: QoS 0 and 2 (QoS 2 dedup, 4.3.3), a
    response topic (MQTT-3.3.2-14) or payload format indicator 1 (3.3.2.3.2), checked
    against the payload; a broken rule is still named."""
    async def main() -> None:
        h = Harness5(tmp_path, max_topic_length=MAX_TOPIC, message_size_limit=LIMIT)
        c = client5(h)
        c.connect("p")
        broken = h.core.ingest._rule_broken
        conn = c.conn
        assert broken(conn, "t", 1, False, LIMIT, None, None) == 0
        assert broken(conn, "é" * 10, 1, False, LIMIT, Properties(content_type="a"), None) == 0
        assert broken(conn, "t", 0, False, 1, None, None) == ALONE
        assert broken(conn, "t", 2, False, 1, None, None) == ALONE
        assert broken(conn, "t", 1, False, 1, Properties(response_topic="r"), None) == ALONE
        assert broken(conn, "t", 1, False, 1, Properties(payload_format_indicator=1), None) == ALONE
        assert broken(conn, "é" * 11, 1, False, 1, None, None) == RULE_TOPIC_TOO_LONG
        assert broken(conn, "t", 1, False, LIMIT + 1, None, None) == RULE_TOO_LARGE
        assert broken(conn, "$t", 1, False, 1, None, None) == RULE_DOLLAR_TOPIC
    run(main())


def test_a_topic_within_the_limit_only_in_utf8_bytes_is_stored_in_the_run(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_topic_length`` is the exact UTF-8 rule on every path: a read of QoS 1 PUBLISHes to
    a topic of 10 two-byte characters (20 bytes, the limit; longer than a quarter of it in
    characters) is stored as one run, no PUBLISH of it admitted alone; 11 of them (22 bytes)
    close the connection, nothing stored (as one at a time)."""
    async def main() -> None:
        h = Harness5(tmp_path, max_topic_length=MAX_TOPIC)
        c = h.connected("p")
        alone: list[Publish] = []
        real = h.core.ingest.on_publish

        def spy(conn: Any, p: Publish) -> None:
            alone.append(p)
            real(conn, p)

        monkeypatch.setattr(h.core.ingest, "on_publish", spy)  # (the ingest part's own calls)
        monkeypatch.setattr(h.core, "on_publish", spy)  # (the connection's)
        c.send(*[Publish("é" * 10, b"%d" % k, 1, packet_id=k) for k in range(1, 4)])
        await h.commit()
        assert c.received() == [Puback(1), Puback(2), Puback(3)] and alone == []
        assert [r.payload for r in h.queue.log.records] == [b"1", b"2", b"3"]
        c.send(*[Publish("é" * 11, b"%d" % k, 1, packet_id=k) for k in range(4, 6)])
        assert c.conn.closed and "PUBLISH topic of 22 bytes exceeds max_topic_length 20" in c.conn.close_reason
        assert len(h.queue.log.records) == 3 and len(alone) == 1
    run(main())


def test_pubrec_again_for_a_qos2_id_not_released_mqtt_4_3_3(tmp_path: Path) -> None:
    """4.3.3 (MQTT-4.3.3-2): a QoS 2 PUBLISH whose id is stored and not yet released gets its
    PUBREC again and is not stored twice: admission's verdict is PUBREC_AGAIN."""
    async def main() -> None:
        h = Harness5(tmp_path)
        c = h.connected("p")
        c.send(Publish("t", b"1", 2, packet_id=7))
        await h.commit()
        verdict = h.core.ingest.admit(c.conn, Publish("t", b"1", 2, dup=True, packet_id=7))
        assert verdict.action == PUBREC_AGAIN and len(h.queue.log.records) == 1
    run(main())
