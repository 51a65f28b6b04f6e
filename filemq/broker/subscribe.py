"""SUBSCRIBE / UNSUBSCRIBE: the topic trie, shared groups, start offsets and the
retained messages a new subscription gets (bounded per connection).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING

from filemq.broker.session.connection import Connection
from filemq.broker.session_state import (
    RC_NOT_AUTHORIZED,
    RC_TOPIC_FILTER_INVALID,
    SessionState,
    Subscription,
    _too_long,
    parse_share_key,
)
from filemq.common.native import mypyc_attr
from filemq.common.topics import (
    InvalidTopic,
    validate_topic_filter,
)
from filemq.mqtt.packets import (
    PROTOCOL_LEVEL_5,
    SUB_NO_LOCAL,
    SUB_QOS_MASK,
    SUB_RETAIN_AS_PUBLISHED,
    SUB_RETAIN_HANDLING_SHIFT,
    SUBACK_FAILURE,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)

if TYPE_CHECKING:
    from filemq.broker.delivery import Delivery
    from filemq.broker.publish import Ingest
    from filemq.broker.registry import SessionRegistry
    from filemq.broker.retain import Retained
    from filemq.broker.router import Router
    from filemq.common.config import BrokerSection
    from segments.log import LogView

log = logging.getLogger("filemq.broker")

# The subscription options kept with a subscription (3.8.3.1): all but the QoS bits.
_SUB_OPTION_BITS = SUB_NO_LOCAL | SUB_RETAIN_AS_PUBLISHED | (3 << SUB_RETAIN_HANDLING_SHIFT)


@mypyc_attr(native_class=False)  # (per SUBSCRIBE, not per message: left an ordinary class, as its mixin was)
class Subscriptions:
    """SUBSCRIBE / UNSUBSCRIBE: a session's subscriptions, their start offsets, the durable
    write before SUBACK / UNSUBACK, then the retained messages a new subscription gets.  The
    trie and groups are the router's, the session files the registry's; this part owns no
    state of its own beyond what it is wired to."""

    def __init__(self, log_view: LogView, config: BrokerSection, router: Router, registry: SessionRegistry,
                 delivery: Delivery, retained: Retained, ingest: Ingest) -> None:
        self.log = log_view
        self.config = config
        self.router = router
        self.registry = registry
        self.delivery = delivery
        self.retained = retained
        self.ingest = ingest

    def on_subscribe(self, conn: Connection, p: Subscribe) -> None:
        state = conn.session
        acl = conn.acl
        assert state is not None and acl is not None
        codes: list[int] = []
        new_subs: list[Subscription] = []
        durable_change = False  # a repeated SUBSCRIBE (same QoS) changes nothing on disk
        # MQTT-3.3.1-6: records routed before this point are in the retained store, records
        # from it on are delivered live (groups never read past it, see TailCache.limit), so
        # a retained message is never neither.  next_offset would skip appended records that
        # are not committed yet, while the retained store only has committed ones.
        start = self.ingest.routed_offset
        # Records appended before this SUBSCRIBE but not routed yet: the retained ones are sent
        # with RETAIN 1 by the replay (once routed), not live (MQTT-3.3.1-8).
        mark = self.log.next_offset
        v5 = conn.protocol_level == PROTOCOL_LEVEL_5
        props = p.properties
        # MQTT 5: one subscription identifier for every filter of this SUBSCRIBE (3.8.2.1.2).
        identifier = props.subscription_identifiers[0] if v5 and props is not None and \
            props.subscription_identifiers else 0
        with_retained: list[Subscription] = []
        for f, opts in p.topics:
            try:
                share, plain = parse_share_key(f)
                validate_topic_filter(plain)
            except InvalidTopic as exc:
                log.info("client %r: SUBSCRIBE %r refused: %s", conn.client_id, f, exc)
                codes.append(RC_TOPIC_FILTER_INVALID if v5 else SUBACK_FAILURE)
                continue
            if _too_long(f, self.config.max_topic_length):
                log.info("client %r: SUBSCRIBE filter of %d bytes refused (max_topic_length %d)",
                         conn.client_id, len(f.encode("utf-8")), self.config.max_topic_length)
                codes.append(RC_TOPIC_FILTER_INVALID if v5 else SUBACK_FAILURE)
                continue
            if not acl.can_subscribe(f):
                log.info("client %r (user %r): SUBSCRIBE %r denied by the ACL", conn.client_id, conn.username, f)
                codes.append(RC_NOT_AUTHORIZED if v5 else SUBACK_FAILURE)
                continue
            qos = min(opts & SUB_QOS_MASK, 2)  # MQTT 5: the options byte's QoS bits (3.8.3.1)
            # MQTT 5: no local, retain as published, retain handling (3.8.3.1); 0 on 3.1.1.
            options = opts & _SUB_OPTION_BITS if v5 else 0
            old = state.subs.get(f)
            if old is not None:
                self.router.unregister(conn, old)
            durable_change = durable_change or old is None or old.qos != qos or old.options != options \
                or old.identifier != identifier
            if old is not None:  # it took everything routed since old.start live already
                sub = Subscription(f, plain, share, qos, old.start, old.retain_below, options, identifier)
            else:
                sub = Subscription(f, plain, share, qos, start,
                                   mark if share is None and not plain.startswith("$") else 0,
                                   options, identifier)
            state.subs[f] = sub
            new_subs.append(sub)
            # Retain handling (MQTT-3.3.1-9..11): 0 send retained messages, 1 only for a new
            # subscription, 2 never.
            handling = options >> SUB_RETAIN_HANDLING_SHIFT
            if handling == 0 or (handling == 1 and old is None):
                with_retained.append(sub)
            codes.append(qos)
        written: asyncio.Future[None] | None = None
        if new_subs:
            state.subs_changed()
            try:  # group files (a new session or $share group)
                self.router.update_groups(state)
                for sub in new_subs:
                    self.router.register(conn, sub)
            except OSError as err:  # not "exc": mypyc gives a name one type per function
                # No SUBACK for a subscription whose state is not durable (a restart would forget it).
                conn.close(f"SUBSCRIBE refused: its state cannot be persisted: {err}", will=True, level=logging.ERROR)
                return
            if state.persistent and durable_change:
                # The session file is written in a worker thread; the SUBACK waits for it (in
                # order with the connection's other acks), the live deliveries need not
                # (3.8.4: PUBLISHes may precede the SUBACK).
                written = self.registry.save_now(state)
        suback = Suback(p.packet_id, codes)
        if written is not None and not written.done():
            # Its live records wait too: they go after its retained messages, never before
            # (a retained message is older than any live one of its topic).
            state.out_hold = written
            written.add_done_callback(functools.partial(
                self._subscription_written, conn, state, with_retained, mark, start, "SUBSCRIBE"))
            conn.queue_ack(written, conn.encode_packet(suback))
            self.delivery.join_batch(conn, written)
            return
        if written is not None and (written.cancelled() or written.exception() is not None):
            conn.close("SUBSCRIBE refused: its state cannot be persisted (writing the session file failed)",
                       will=True, level=logging.ERROR)
            return
        conn.send_packet(suback)
        self._after_suback(conn, state, with_retained, mark, start)

    def _after_suback(self, conn: Connection, state: SessionState, with_retained: list[Subscription],
                      mark: int, start: int) -> None:
        for sub in with_retained:
            # Every retained message appended before the SUBSCRIBE, once routed (MQTT-3.8.4-3
            # too: a repeated one's live copies still reach it through the old start).
            self.retained.send(conn, state, sub, mark if sub.share is None else start)
        self.delivery.pump(conn)

    def _subscription_written(self, conn: Connection, state: SessionState, with_retained: list[Subscription],
                              mark: int, start: int, what: str, written: asyncio.Future[None]) -> None:
        """The session file of a SUBSCRIBE / UNSUBSCRIBE is durable (or failed): release its
        ack (queued in order), then the retained messages the SUBSCRIBE gets."""
        if state.out_hold is written:
            state.out_hold = None
        if conn.closed or state.conn is not conn:
            if state.conn is not None and not state.conn.closed:
                self.delivery.pump(state.conn)  # (the session moved on to a new connection meanwhile)
                self.delivery.flush()
            return
        if written.cancelled() or written.exception() is not None:
            conn.close(f"{what} refused: its state cannot be persisted (writing the session file failed)",
                       will=True, level=logging.ERROR)
            self.delivery.flush()
            return
        if conn.ack_ready():
            self._after_suback(conn, state, with_retained, mark, start)
        self.delivery.flush()

    def on_unsubscribe(self, conn: Connection, p: Unsubscribe) -> None:
        state = conn.session
        assert state is not None
        changed = False
        shares_before = state.share_names()
        codes: list[int] = []  # MQTT 5: one per filter, 0x11 when there was no such subscription
        for f in p.topics:
            sub = state.subs.pop(f, None)
            if sub is not None:
                self.router.unregister(conn, sub)
                changed = True
            codes.append(0x00 if sub is not None else 0x11)
        if changed:
            state.subs_changed()
            for name in shares_before - state.share_names():
                self.delivery.leave_share(conn, state, name)
            self.router.update_groups(state)
            if state.persistent:
                written = self.registry.save_now(state)  # in a worker thread; the UNSUBACK waits for it
                if not written.done():
                    written.add_done_callback(functools.partial(
                        self._subscription_written, conn, state, [], 0, 0, "UNSUBSCRIBE"))
                    conn.queue_ack(written, conn.encode_packet(
                        Unsuback(p.packet_id, codes if conn.protocol_level == 5 else [])))
                    self.delivery.join_batch(conn, written)
                    return
                if written.cancelled() or written.exception() is not None:
                    conn.close("UNSUBSCRIBE refused: its state cannot be persisted (writing the session file "
                               "failed)", will=True, level=logging.ERROR)
                    return
        conn.send_packet(Unsuback(p.packet_id, codes if conn.protocol_level == 5 else []))
