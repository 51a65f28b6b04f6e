"""SUBSCRIBE / UNSUBSCRIBE: the topic trie, shared groups, start offsets and the
retained messages a new subscription gets (bounded per connection).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from filemq.broker.base import CoreBase
from filemq.broker.session import Connection
from filemq.broker.state import (
    RC_NOT_AUTHORIZED,
    RC_TOPIC_FILTER_INVALID,
    RETAINED_OUT_HIGH,
    Outbound,
    SessionState,
    Subscription,
    _too_long,
    message_expiry,
    parse_share_key,
)
from filemq.common.native import mypyc_attr
from filemq.common.topics import (
    InvalidTopic,
    topic_matches,
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
from filemq.mqtt.properties import _vbi

if TYPE_CHECKING:
    pass

log = logging.getLogger("filemq.broker")

# The subscription options kept with a subscription (3.8.3.1): all but the QoS bits.
_SUB_OPTION_BITS = SUB_NO_LOCAL | SUB_RETAIN_AS_PUBLISHED | (3 << SUB_RETAIN_HANDLING_SHIFT)


@mypyc_attr(native_class=False)
class SubscribeMixin(CoreBase):
    """SUBSCRIBE/UNSUBSCRIBE, shared groups, retained messages for new subscriptions."""

    # ---- subscriptions -------------------------------------------------------------------

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
        start = self._routed
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
            self._send_retained(conn, state, sub, mark if sub.share is None else start)
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

    def _send_retained(self, conn: Connection, state: SessionState, sub: Subscription, below: int) -> None:
        """Send the retained messages ``sub`` matches that were stored below offset ``below``
        (the routed offset at SUBSCRIBE time): later ones reach it live."""
        if sub.share is not None:
            return  # retained messages are not sent for shared subscriptions (as MQTT 5)
        if sub.plain.startswith("$SYS"):
            acl = conn.acl
            for topic, payload in self.sys_retained.items():
                if topic_matches(sub.plain, topic) and (
                        acl is None or acl.can_receive(topic)):
                    conn.send(conn.publish_bytes(topic, payload, 0, False, None, True))
            return
        if not self.retained_ready:
            self._retained_waiting.append((conn, state, sub, below))
            return
        if below > self._routed:
            if self._routed < self.log.next_offset:
                self._retained_after.setdefault(conn, []).append((state, sub, below))
                if self._pending:  # if that commit fails, the offsets are given back: send then
                    self._pending[-1][1].add_done_callback(self._retained_after_failed)
                return
            # A failed commit gave the offsets up to ``below`` back: records there come later.
            below = sub.retain_below = self._routed
            state.subs_changed()
            if state.persistent:
                state.save_due = True  # (retain_below is in the session file)
        acl = conn.acl
        queue = self._retained_out.get(conn)
        if queue is None:
            queue = self._retained_out[conn] = deque()
        elif any(e[0] == sub.filter for e in queue):
            # A repeated SUBSCRIBE re-sends (MQTT-3.8.4-3): what it still had queued is replaced.
            queue = self._retained_out[conn] = deque(e for e in queue if e[0] != sub.filter)
        for m in self.retained.match(sub.plain):
            if m.offset >= below:
                continue  # routed after the SUBSCRIBE (store rebuilt late): delivered live
            if acl is not None and not acl.can_receive(m.topic):
                continue
            queue.append((sub.filter, m, min(sub.qos, m.qos)))
        self._drain_retained(conn, state)

    def _send_retained_after(self) -> None:
        """Send the retained replays whose SUBSCRIBE's offset is routed now (see on_subscribe)."""
        waiting = dict(self._retained_after)  # (the dict itself is shared with delivery)
        self._retained_after.clear()
        for conn, subs in waiting.items():
            for state, sub, below in subs:
                if not conn.closed and state.conn is conn and state.subs.get(sub.filter) is sub:
                    self._send_retained(conn, state, sub, below)
            self.delivery.schedule_pump(conn)

    def _retained_after_failed(self, fut: asyncio.Future[None]) -> None:
        if self._retained_after and (fut.cancelled() or fut.exception() is not None):
            self._send_retained_after()
            self.delivery.flush()

    def _drain_retained(self, conn: Connection, state: SessionState) -> bool:
        """Send queued retained messages while the connection takes them: its output below
        :data:`RETAINED_OUT_HIGH`, its transport not paused, QoS 1/2 ones within the in-flight
        window.  The queue holds the store's messages (no payload copies); True when empty."""
        queue = self._retained_out.get(conn)
        if queue is None:
            return True
        sent = 0
        inflight = state.inflight
        blocked = False
        v5 = conn.protocol_level == PROTOCOL_LEVEL_5
        limit = conn.client_max_packet
        now_us = 0
        while queue and not conn.closed and not conn.paused:
            if len(conn.out) >= RETAINED_OUT_HIGH:
                break
            f, m, qos = queue[0]
            if qos and len(inflight) >= max(conn.max_inflight, 1):
                blocked = True  # the acks that free the window pump again
                break
            queue.popleft()
            if conn.acl is not None and not conn.acl.can_receive(m.topic):
                continue  # the read right went away (ACL reload) while it was queued
            headers = m.headers
            if headers:
                now_us = now_us or time.time_ns() // 1000
                expiring = message_expiry(headers, m.timestamp_us, now_us)
                if expiring is None:
                    continue  # its message expiry interval has passed (3.3.2.3.3): not sent
                headers = expiring
            if v5:
                sub = state.subs.get(f)
                if sub is not None and sub.identifier:
                    headers += b"\x0b" + _vbi(sub.identifier)  # 3.3.4, MQTT-3.3.4-3
            if qos == 0:
                data = conn.publish_bytes(m.topic, m.payload, 0, False, None, True, headers)
                if limit is not None and len(data) > limit:
                    self.delivery.too_large(conn, m.topic, len(data), limit)
                    continue
                conn.send(data)
            else:
                pid = state.alloc_pid()
                data = conn.publish_bytes(m.topic, m.payload, qos, False, pid, True, headers)
                if limit is not None and len(data) > limit:
                    self.delivery.too_large(conn, m.topic, len(data), limit)
                    continue
                inflight[pid] = Outbound(m.offset, None, qos, m.topic, m.payload, None, True, headers)
                if qos == 2 and state.persistent:
                    # Its id goes to the session file before it leaves (as a group record's,
                    # see DeliveryMixin._hold_output); the rest of the queue follows the write.
                    state.qos2_sent[pid] = -1
                    written = state.out_hold = self.registry.save_soon(state)
                    written.add_done_callback(functools.partial(self.delivery.release_output, conn, state, data))
                    sent += 1
                    break
                conn.send(data)
            sent += 1
        if sent:
            self.stats.publish_sent(sent)
        if queue:
            if not blocked and not conn.paused and not conn.closed:
                self.delivery.schedule_repump(conn)  # after this event's flush wrote the output
            return False
        del self._retained_out[conn]
        return True

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
