"""Access control lists in Mosquitto's ACL file format.

File format (one rule a line; ``#`` starts a comment line; blank lines ignored)::

    topic [read|write|readwrite|deny] <filter>    # before any `user` line: anonymous clients
    user <name>                                   # following `topic` lines are this user's
    pattern [read|write|readwrite|deny] <filter>  # every client; %u = username, %c = client id

No access word means ``readwrite``.  ``read`` covers subscribing and receiving, ``write``
covers publishing, ``deny`` (as in Mosquitto 2) takes away both and wins over any grant.

What a caller may rely on:

* :meth:`Acl.load` raises :class:`~filemq.common.config.ConfigError` with the line for any bad line
  (unknown keyword, missing or invalid filter, ``user`` without a name).
* A client with no rules at all may do nothing; :meth:`Acl.permissive` (no ACL file) allows
  everything.
* :meth:`ClientAcl.can_subscribe` allows a filter only when it lies *within* one granted
  read filter (every topic it can match is matched by that grant: ``read sensors/#``
  allows ``sensors/+/temp`` but ``read sensors/+/temp`` does not allow ``sensors/#``) and
  no deny filter contains it.  ``$share/<group>/<f>`` is checked as ``f``.
* The broker checks every delivered message with :meth:`ClientAcl.can_receive` (cached per
  topic), so a deny rule that only partly overlaps a granted subscription, a session restored
  under rules that changed, or a read right removed by a reload (SIGHUP) stops deliveries;
  :attr:`ClientAcl.allow_all` says when no check is needed.
* A username or client id containing ``+``, ``#`` or ``/`` makes the patterns that use it
  not apply to that client (as Mosquitto), so an id like ``#`` grants nothing extra.
* Wildcard grants follow the MQTT ``$`` rule: ``read #`` does not cover ``$SYS/...``.
"""

from __future__ import annotations

import enum
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from filemq.common.config import ConfigError, read_config_text
from filemq.common.topics import InvalidTopic, parse_shared, topic_matches, validate_topic_filter

log = logging.getLogger(__name__)


class Access(enum.Flag):
    """What a rule grants; ``DENY`` is a separate kind that removes both."""

    # Literal values (what enum.auto() gave): mypyc cannot compile a member computed from
    # others (tests/test_acl.py::test_access_flag_values_are_fixed).
    NONE = 0
    READ = 1
    WRITE = 2
    READWRITE = 3  # READ | WRITE
    DENY = 4


_ACCESS_WORDS = {
    "read": Access.READ,
    "write": Access.WRITE,
    "readwrite": Access.READWRITE,
    "deny": Access.DENY,
}


@dataclass(frozen=True)
class Rule:
    """One ``topic``/``pattern`` line: the access it grants (or denies) on ``filter``."""

    access: Access
    filter: str
    line: int


def filter_within(inner: str, outer: str) -> bool:
    """True when every topic matched by filter ``inner`` is also matched by filter ``outer``.

    Both must be valid filters.  Level by level: ``#`` in ``outer`` covers the rest (and the
    parent level); ``+`` in ``outer`` covers any single level of ``inner`` except ``#``; a
    literal covers only the same literal.  A wildcard-first ``outer`` never covers an
    ``inner`` that starts with a ``$`` level (those topics are not matched by it).
    """
    if outer[:1] in ("+", "#") and inner[:1] == "$":
        return False
    o_levels = outer.split("/")
    i_levels = inner.split("/")
    for i, o in enumerate(o_levels):
        if o == "#":
            return True
        if i >= len(i_levels):
            return False
        level = i_levels[i]
        if level == "#":
            # inner matches every depth >= i (>= 1 when i == 0); an outer tail "+/.../#"
            # needs depth > i, except "+/#" at the root, which matches any depth >= 1 too.
            return i == 0 and o_levels == ["+", "#"]
        if o != "+" and o != level:
            return False  # a literal covers only itself, not a '+' that matches anything
    return len(i_levels) == len(o_levels)


_PLACEHOLDER = re.compile("%[uc]")


def fill_pattern(filter_: str, username: str | None, client_id: str) -> str | None:
    """``filter_`` with every ``%u`` (username) and ``%c`` (client id) replaced in one pass;
    None when it needs a value that is missing or unsafe (see :func:`_safe`)."""
    if "%u" in filter_ and (username is None or not _safe(username)):
        return None
    if "%c" in filter_ and not _safe(client_id):
        return None
    values = {"%u": username or "", "%c": client_id}
    return _PLACEHOLDER.sub(lambda m: values[m.group()], filter_)


def _safe(value: str) -> bool:
    # Mosquitto refuses pattern substitution for such values: a client id of "#" or "a/b"
    # would otherwise turn `pattern write devices/%c` into a grant on many topics.
    return bool(value) and not any(ch in value for ch in "+#/")


class ClientAcl:
    """The rules that apply to one connected client, with %u/%c already substituted."""

    _CACHE_MAX = 1024

    def __init__(self, rules: list[Rule] | None) -> None:
        """``rules=None`` allows everything (no ACL file)."""
        self._allow_all = rules is None
        self._grants = [r for r in rules or [] if r.access != Access.DENY]
        self._denies = [r for r in rules or [] if r.access == Access.DENY]
        self._publish_cache: dict[str, bool] = {}
        self._receive_cache: dict[str, bool] = {}

    @property
    def allow_all(self) -> bool:
        """True when there is no ACL file: everything is allowed, no check needed."""
        return self._allow_all

    @property
    def has_deny(self) -> bool:
        """True when deny rules exist, so deliveries need :meth:`can_receive` checks."""
        return bool(self._denies)

    def _allowed(self, topic: str, access: Access) -> bool:
        if self._allow_all:
            return True
        if any(topic_matches(r.filter, topic) for r in self._denies):
            return False
        return any(access in r.access and topic_matches(r.filter, topic) for r in self._grants)

    def can_publish(self, topic: str) -> bool:
        """May this client publish to topic name ``topic``?"""
        cached = self._publish_cache.get(topic)
        if cached is None:
            cached = self._allowed(topic, Access.WRITE)
            if len(self._publish_cache) >= self._CACHE_MAX:
                self._publish_cache.clear()  # bounded; clients use few distinct topics
            self._publish_cache[topic] = cached
        return cached

    def can_receive(self, topic: str) -> bool:
        """May a message on ``topic`` be delivered to this client?"""
        cached = self._receive_cache.get(topic)
        if cached is None:
            cached = self._allowed(topic, Access.READ)
            if len(self._receive_cache) >= self._CACHE_MAX:
                self._receive_cache.clear()
            self._receive_cache[topic] = cached
        return cached

    def can_subscribe(self, topic_filter: str) -> bool:
        """May this client subscribe to ``topic_filter`` (``$share/<g>/<f>`` checks ``f``)?"""
        if self._allow_all:
            return True
        try:
            _, plain = parse_shared(topic_filter)
        except InvalidTopic:
            return False
        if any(filter_within(plain, r.filter) for r in self._denies):
            return False
        return any(
            Access.READ in r.access and filter_within(plain, r.filter) for r in self._grants
        )


class Acl:
    """A parsed ACL file (or the permissive no-file ACL)."""

    def __init__(
        self,
        anonymous: list[Rule],
        users: dict[str, list[Rule]],
        patterns: list[Rule],
        *,
        path: str | None = None,
        allow_all: bool = False,
    ) -> None:
        self.anonymous = anonymous
        self.users = users
        self.patterns = patterns
        self.path = path
        self.allow_all = allow_all

    @classmethod
    def permissive(cls) -> Acl:
        """The ACL when no file is configured: everything allowed."""
        return cls([], {}, [], allow_all=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None) -> Acl:
        """Parse the ACL file at ``path`` (``None`` -> :meth:`permissive`)."""
        if path is None:
            return cls.permissive()
        file = os.fspath(path)
        return cls.parse(read_config_text(file, "ACL file"), file)

    @classmethod
    def parse(cls, text: str, file: str = "<acl>") -> Acl:
        """Parse ACL text; ``file`` is used in errors."""
        anonymous: list[Rule] = []
        users: dict[str, list[Rule]] = {}
        patterns: list[Rule] = []
        current = anonymous
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            keyword, _, rest = line.partition(" ")
            rest = rest.strip()

            def bad(message: str, lineno: int = lineno) -> ConfigError:
                return ConfigError(f"line {lineno}: {message}", file=file, line=lineno)

            if keyword == "user":
                if not rest:
                    raise bad("'user' needs a username")
                current = users.setdefault(rest, [])
            elif keyword in ("topic", "pattern"):
                rule = _parse_rule(keyword, rest, lineno, bad)
                (patterns if keyword == "pattern" else current).append(rule)
            else:
                raise bad(f"unknown keyword {keyword!r} (expected user, topic or pattern)")
        acl = cls(anonymous, users, patterns, path=file)
        log.debug(
            "ACL %s: %d anonymous rules, %d users, %d patterns",
            file, len(anonymous), len(users), len(patterns),
        )
        return acl

    def for_client(self, username: str | None, client_id: str) -> ClientAcl:
        """The rules for one client (``username=None`` = anonymous); build once at CONNECT."""
        if self.allow_all:
            return ClientAcl(None)
        own = self.anonymous if username is None else self.users.get(username, [])
        rules = list(own)
        for p in self.patterns:
            filt = fill_pattern(p.filter, username, client_id)
            if filt is not None:
                rules.append(Rule(p.access, filt, p.line))
        return ClientAcl(rules)

    def can_publish(self, username: str | None, client_id: str, topic: str) -> bool:
        """May this client publish to ``topic``?  (Prefer :meth:`for_client` per connection.)"""
        return self.for_client(username, client_id).can_publish(topic)

    def can_subscribe(self, username: str | None, client_id: str, topic_filter: str) -> bool:
        """May this client subscribe to ``topic_filter``?"""
        return self.for_client(username, client_id).can_subscribe(topic_filter)

    def can_receive(self, username: str | None, client_id: str, topic: str) -> bool:
        """May a message on ``topic`` be delivered to this client?"""
        return self.for_client(username, client_id).can_receive(topic)


def _parse_rule(
    keyword: str, rest: str, lineno: int, bad: Callable[[str], ConfigError]
) -> Rule:
    if not rest:
        raise bad(f"'{keyword}' needs a topic filter")
    first, _, after = rest.partition(" ")
    access = Access.READWRITE
    filt = rest
    if first in _ACCESS_WORDS:
        access = _ACCESS_WORDS[first]
        filt = after.strip()
        if not filt:
            raise bad(f"'{keyword} {first}' needs a topic filter after {first!r}")
    # Placeholders are checked as if substituted by a plain level-safe value.
    probe = filt.replace("%u", "u").replace("%c", "c") if keyword == "pattern" else filt
    try:
        validate_topic_filter(probe)
    except InvalidTopic as exc:
        raise bad(f"invalid filter: {exc}") from None
    return Rule(access, filt, lineno)
