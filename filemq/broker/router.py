"""The router (:class:`Router`): which connections and shared groups a topic reaches, and the
consumer groups subscriptions read from.

One part of :class:`~filemq.broker.core.BrokerCore`.  It owns the topic trie (filters ->
live connections and shared groups), the shared groups by share name, and the making of
consumer groups (the factory, every group reading through the tail cache).  Registering a
subscription puts its connection (or its shared group) in the trie; the commit listener's
routing asks the trie which targets a committed record's topic wakes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from filemq.broker.session.connection import Connection
from filemq.broker.session_state import (
    CLEAN_GROUP_PREFIX,
    SESSION_GROUP_PREFIX,
    SHARE_GROUP_PREFIX,
    SessionState,
    SharedGroup,
    Subscription,
)
from filemq.common.topics import TopicTrie

if TYPE_CHECKING:
    from filemq.broker.ports import QueuePort
    from filemq.broker.tailcache import TailCache
    from filemq.queue.groups import ConsumerGroup
    from segments.log import LogView

log = logging.getLogger("filemq.broker")

GroupFactory = Callable[[str, tuple[str, ...], bool], "ConsumerGroup"]
"""Makes (or opens) the consumer group ``name`` with ``filters``, durable or not."""
Target = Connection | SharedGroup
"""What a topic filter in the trie leads to: a live connection or a shared group."""


class Router:
    """The topic trie, the shared groups and the consumer groups subscriptions read."""

    def __init__(self, queue: QueuePort, cache: TailCache, log_view: LogView, group_factory: GroupFactory) -> None:
        self.queue = queue
        self.cache = cache
        self.log = log_view
        self.group_factory = group_factory
        self.trie: TopicTrie[Target] = TopicTrie()
        self.shares: dict[str, SharedGroup] = {}
        self._clean_ids = 0  # numbers the non-durable groups of clean sessions

    # ---- subscriptions in the trie ---------------------------------------------------------

    def register(self, conn: Connection, sub: Subscription) -> None:
        """``conn`` takes what ``sub`` matches (its shared group, for a ``$share`` one)."""
        if sub.share is None:
            self.trie.add(sub.plain, conn)
            return
        sh = self._share(sub.share, sub.plain)
        if conn not in sh.members:
            sh.members.append(conn)
        sh.filter_refs[sub.plain] += 1
        if sh.filter_refs[sub.plain] == 1:
            self.trie.add(sub.plain, sh)

    def unregister(self, conn: Connection, sub: Subscription) -> None:
        if sub.share is None:
            self.trie.remove(sub.plain, conn)
            return
        sh = self.shares.get(sub.share)
        if sh is None:
            return
        sh.filter_refs[sub.plain] -= 1
        if sh.filter_refs[sub.plain] <= 0:
            del sh.filter_refs[sub.plain]
            self.trie.remove(sub.plain, sh)

    def _share(self, name: str, plain: str) -> SharedGroup:
        sh = self.shares.get(name)
        if sh is None:
            group = self.through_cache(self.group_factory(SHARE_GROUP_PREFIX + name, (plain,), True))
            sh = self.shares[name] = SharedGroup(name, group)
        filters = sh.group.filters
        if plain not in filters:
            # Shared-group filters only grow: offline members may still need the old ones.
            sh.group.set_filters(tuple(filters) + (plain,))
        return sh

    # ---- consumer groups -------------------------------------------------------------------

    def update_groups(self, state: SessionState) -> None:
        """Give ``state`` the group its own (not shared) filters need, with those filters; a
        clean session without any loses its group."""
        own = state.own_filters()
        if not own:
            if state.group is not None and not state.persistent:
                self.drop_group(state.group.name)
                state.group = None
            return
        if state.group is None:
            if state.persistent:
                name = SESSION_GROUP_PREFIX + state.client_id
            else:
                self._clean_ids += 1
                name = f"{CLEAN_GROUP_PREFIX}{state.client_id}:{self._clean_ids}"
            state.group = self.group(name, own, state.persistent)
        elif tuple(state.group.filters) != own:
            state.group.set_filters(own)

    def group(self, name: str, filters: tuple[str, ...], durable: bool) -> ConsumerGroup:
        group = self.group_factory(name, filters, durable)
        if tuple(group.filters) != filters:
            group.set_filters(filters)
        return self.through_cache(group)

    def recreate_if_missing(self, cid: str, name: str, filters: tuple[str, ...]) -> None:
        """A group a session loaded from its file needs: if its directory is gone, re-create it
        at the log's first offset, never at its end: re-delivering what is still retained
        loses nothing acknowledged, resuming at the end would (issue 10 item 13)."""
        if self.queue.get_group(name) is None:
            log.error("client %r: its session is stored but its consumer group %r is missing (directory "
                      "deleted or unreadable, see `filemq verify`); re-created at the log's first offset %d: "
                      "every retained message is delivered again", cid, name, self.log.first_offset)
            self.queue.group(name, filters, durable=True, start="earliest")

    def through_cache(self, group: ConsumerGroup) -> ConsumerGroup:
        # Groups read the log through the tail cache, so live subscribers never hit the files.
        if group.reader is not self.cache:
            group.use_reader(self.cache)
        return group

    def drop_group(self, name: str) -> None:
        self.queue.drop_group(name)
