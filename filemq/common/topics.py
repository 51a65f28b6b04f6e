"""MQTT 3.1.1 topic names and filters (spec section 4.7): validation, matching, a filter trie.

What a caller may rely on:

* :func:`validate_topic_name` / :func:`validate_topic_filter` raise :class:`InvalidTopic`
  (a ``ValueError``) whose message names the topic and the rule it breaks, and return
  nothing otherwise.
* :func:`topic_matches` and :meth:`TopicTrie.match` agree exactly (the trie is tested against
  the plain function): ``+`` matches one whole level (possibly empty), ``#`` matches its own
  level and everything below it *including the parent* (``a/#`` matches ``a``), and a filter
  that starts with a wildcard never matches a topic that starts with ``$`` (4.7.2).
* Matching functions assume their inputs were validated; they never raise on odd input.
* :func:`parse_shared` splits ``$share/<group>/<filter>`` (the MQTT 5 shared-subscription
  form, which filemq also accepts from 3.1.1 clients) into the group and the plain filter.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

MAX_TOPIC_BYTES = 65535
"""A topic is a UTF-8 string with a u16 length prefix on the wire (1.5.3)."""

SHARE_PREFIX = "$share/"

T = TypeVar("T", bound=Hashable)


class InvalidTopic(ValueError):
    """A topic name or filter breaks an MQTT rule; ``topic`` and ``reason`` say which."""

    def __init__(self, topic: str, reason: str) -> None:
        shown = topic if len(topic) <= 80 else topic[:77] + "..."
        super().__init__(f"invalid topic {shown!r}: {reason}")
        self.topic = topic
        self.reason = reason


def _check_common(topic: str, kind: str) -> None:
    if not topic:
        raise InvalidTopic(topic, f"a topic {kind} must be at least one character long")
    try:
        size = len(topic.encode("utf-8"))
    except UnicodeEncodeError as exc:
        # Lone surrogates can sit in a Python str but have no UTF-8 encoding (1.5.3).
        raise InvalidTopic(topic, f"not encodable as UTF-8 ({exc.reason})") from None
    if size > MAX_TOPIC_BYTES:
        raise InvalidTopic(topic, f"{size} UTF-8 bytes, more than the {MAX_TOPIC_BYTES} allowed")
    if "\x00" in topic:
        raise InvalidTopic(topic, "contains the null character U+0000")


def validate_topic_name(name: str) -> None:
    """Check a topic name a client publishes to: no wildcards allowed (4.7.3)."""
    _check_common(name, "name")
    if "+" in name or "#" in name:
        raise InvalidTopic(name, "wildcards '+' and '#' are not allowed in a topic name")


def validate_topic_filter(topic_filter: str) -> None:
    """Check a subscription filter: ``#`` only as the whole last level, ``+`` only a whole level."""
    _check_common(topic_filter, "filter")
    if "+" not in topic_filter and "#" not in topic_filter:
        return
    levels = topic_filter.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if "#" in level:
            if level != "#":
                raise InvalidTopic(topic_filter, f"'#' must occupy a whole level, got {level!r}")
            if i != last:
                raise InvalidTopic(topic_filter, "'#' must be the last level of a filter")
        if "+" in level and level != "+":
            raise InvalidTopic(topic_filter, f"'+' must occupy a whole level, got {level!r}")


def parse_shared(topic_filter: str) -> tuple[str | None, str]:
    """Split ``$share/<group>/<filter>`` into ``(group, filter)``; other filters give ``(None, f)``.

    Raises :class:`InvalidTopic` when the share name is empty or contains ``/``, ``+`` or
    ``#``, or when the filter part is missing or itself invalid.
    """
    if not topic_filter.startswith(SHARE_PREFIX):
        return None, topic_filter
    group, sep, rest = topic_filter[len(SHARE_PREFIX):].partition("/")
    if not sep:
        raise InvalidTopic(topic_filter, "a shared subscription needs $share/<group>/<filter>")
    if not group:
        raise InvalidTopic(topic_filter, "the share name of $share/<group>/<filter> is empty")
    if "+" in group or "#" in group:
        raise InvalidTopic(topic_filter, f"the share name {group!r} contains a wildcard")
    validate_topic_filter(rest)
    return group, rest


def topic_matches(topic_filter: str, topic: str) -> bool:
    """True when the (valid) ``topic_filter`` matches the (valid) topic name ``topic``."""
    if topic[:1] == "$" and topic_filter[:1] in ("+", "#"):
        return False
    if "+" not in topic_filter and "#" not in topic_filter:
        return topic_filter == topic
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    n_topic = len(t_levels)
    for i, level in enumerate(f_levels):
        if level == "#":
            return True
        if i >= n_topic:
            return False
        if level != "+" and level != t_levels[i]:
            return False
    return len(f_levels) == n_topic


class _Node(Generic[T]):
    __slots__ = ("children", "values")

    def __init__(self) -> None:
        self.children: dict[str, _Node[T]] = {}
        self.values: set[T] = set()


class TopicTrie(Generic[T]):
    """Filters mapped to values (e.g. subscriptions), with fast lookup of every match of a topic.

    One dict of children per level, so a lookup costs O(levels x matching wildcard branches)
    whatever the number of filters. ``len()`` counts distinct (filter, value) pairs. Values
    must be hashable; a value added twice under one filter is stored once.
    """

    __slots__ = ("_root", "_size")

    def __init__(self) -> None:
        self._root: _Node[T] = _Node()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, topic_filter: str, value: T) -> bool:
        """Add ``value`` under ``topic_filter``; False if it was already there."""
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        if value in node.values:
            return False
        node.values.add(value)
        self._size += 1
        return True

    def remove(self, topic_filter: str, value: T) -> bool:
        """Remove ``value`` from ``topic_filter``; False if it was not there. Prunes empty nodes."""
        path: list[tuple[_Node[T], str]] = []
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        if value not in node.values:
            return False
        node.values.discard(value)
        self._size -= 1
        # Prune bottom-up so a trie that saw many short-lived filters does not keep growing.
        for parent, level in reversed(path):
            child = parent.children[level]
            if child.values or child.children:
                break
            del parent.children[level]
        return True

    def match(self, topic: str) -> set[T]:
        """Every value whose filter matches the topic name ``topic``."""
        found: set[T] = set()
        levels = topic.split("/")
        n = len(levels)
        # Explicit stack, not recursion: a topic may have thousands of levels ("a////...").
        stack: list[tuple[_Node[T], int]] = [(self._root, 0)]
        dollar = topic[:1] == "$"
        while stack:
            node, i = stack.pop()
            children = node.children
            # 4.7.2: wildcards at the first level do not match topics starting with '$'.
            wild_ok = i > 0 or not dollar
            if wild_ok:
                hash_node = children.get("#")
                if hash_node is not None:
                    found.update(hash_node.values)  # '#' also matches the parent level
            if i == n:
                found.update(node.values)
                continue
            child = children.get(levels[i])
            if child is not None:
                stack.append((child, i + 1))
            if wild_ok:
                plus = children.get("+")
                if plus is not None:
                    stack.append((plus, i + 1))
        return found

    def filters(self) -> Iterator[tuple[str, set[T]]]:
        """Every stored filter with a copy of its values (order unspecified)."""
        stack: list[tuple[_Node[T], str]] = [
            (child, level) for level, child in self._root.children.items()
        ]
        while stack:
            node, prefix = stack.pop()
            if node.values:
                yield prefix, set(node.values)
            for level, child in node.children.items():
                stack.append((child, prefix + "/" + level))
