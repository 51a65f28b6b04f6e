"""ACL files in Mosquitto's format: parsing, grants, patterns, filter containment."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.broker.acl import Access, Acl, filter_within
from filemq.common.config import ConfigError
from filemq.common.topics import topic_matches

EXAMPLE = """
# anonymous clients
topic read public/#

user alice
topic write sensors/alice/#
topic read sensors/#
topic cmd/alice

user bob
topic readwrite bob/+/x
topic deny bob/secret/x

pattern write devices/%c/status
pattern read users/%u/inbox/#
"""


@pytest.fixture
def acl() -> Acl:
    return Acl.parse(EXAMPLE, "acl.conf")


def test_parse_structure(acl: Acl) -> None:
    assert [r.filter for r in acl.anonymous] == ["public/#"]
    assert sorted(acl.users) == ["alice", "bob"]
    assert [(r.access, r.filter, r.line) for r in acl.users["alice"]] == [
        (Access.WRITE, "sensors/alice/#", 6),
        (Access.READ, "sensors/#", 7),
        (Access.READWRITE, "cmd/alice", 8),  # no access word -> readwrite
    ]
    assert [r.filter for r in acl.patterns] == ["devices/%c/status", "users/%u/inbox/#"]


def test_anonymous_rules(acl: Acl) -> None:
    assert acl.can_subscribe(None, "c1", "public/#")
    assert acl.can_subscribe(None, "c1", "public/+/news")
    assert acl.can_receive(None, "c1", "public/x")
    assert not acl.can_publish(None, "c1", "public/x")
    assert not acl.can_subscribe(None, "c1", "sensors/#")
    # anonymous rules are not a user's rules
    assert not acl.can_subscribe("alice", "c1", "public/#")


def test_user_rules(acl: Acl) -> None:
    assert acl.can_publish("alice", "a1", "sensors/alice/temp")
    assert not acl.can_publish("alice", "a1", "sensors/bob/temp")
    assert acl.can_subscribe("alice", "a1", "sensors/+/temp")
    assert acl.can_publish("alice", "a1", "cmd/alice") and acl.can_subscribe("alice", "a1", "cmd/alice")
    assert not acl.can_publish("alice", "a1", "cmd/alice/sub")
    # a user with no `user` block gets only patterns
    assert not acl.can_publish("carol", "c9", "sensors/alice/temp")
    assert acl.can_publish("carol", "c9", "devices/c9/status")


def test_deny_wins_and_needs_delivery_checks(acl: Acl) -> None:
    bob = acl.for_client("bob", "b1")
    assert bob.has_deny
    assert bob.can_publish("bob/open/x") and not bob.can_publish("bob/secret/x")
    assert not bob.can_subscribe("bob/secret/x")
    # `bob/+/x` is granted but partly denied: the subscription is allowed, deliveries filtered
    assert bob.can_subscribe("bob/+/x")
    assert bob.can_receive("bob/open/x") and not bob.can_receive("bob/secret/x")
    assert not acl.for_client("alice", "a1").has_deny


def test_patterns_substitute_username_and_client_id(acl: Acl) -> None:
    assert acl.can_publish("alice", "dev-7", "devices/dev-7/status")
    assert not acl.can_publish("alice", "dev-7", "devices/dev-8/status")
    assert acl.can_subscribe("alice", "x", "users/alice/inbox/#")
    assert not acl.can_subscribe("bob", "x", "users/alice/inbox/#")
    # anonymous clients have no %u: the pattern cannot apply
    assert not acl.can_subscribe(None, "x", "users//inbox/#")
    assert acl.can_publish(None, "anon-1", "devices/anon-1/status")


@pytest.mark.parametrize("bad_id", ["#", "+", "a/b", "dev/+", "x#"])
def test_wildcard_or_slash_ids_get_nothing_from_patterns(acl: Acl, bad_id: str) -> None:
    client = acl.for_client(bad_id, bad_id)
    for topic in ("devices/x/status", f"devices/{bad_id}/status", "devices/a/b/status"):
        assert not client.can_publish(topic)
    assert not client.can_subscribe("users/#")
    assert not client.can_subscribe("users/+/inbox/#")


def test_shared_subscription_checks_the_inner_filter(acl: Acl) -> None:
    assert acl.can_subscribe("alice", "a", "$share/g1/sensors/+/temp")
    assert not acl.can_subscribe("alice", "a", "$share/g1/other/#")
    assert not acl.can_subscribe("alice", "a", "$share//sensors/#")


def test_dollar_topics_need_explicit_grants() -> None:
    acl = Acl.parse("topic read #\ntopic read $SYS/broker/#\n")
    assert acl.can_subscribe(None, "c", "#") and acl.can_receive(None, "c", "a/b")
    assert not acl.can_receive(None, "c", "$SYS/x")
    assert acl.can_subscribe(None, "c", "$SYS/broker/uptime")
    assert not acl.can_subscribe(None, "c", "$SYS/#")


def test_no_file_allows_everything() -> None:
    acl = Acl.load(None)
    assert acl.can_publish(None, "", "any/topic") and acl.can_subscribe("u", "c", "#")
    assert acl.can_receive(None, "c", "$SYS/x") and not acl.for_client(None, "c").has_deny


def test_empty_file_allows_nothing(tmp_path: Path) -> None:
    p = tmp_path / "acl"
    p.write_text("# nothing\n")
    acl = Acl.load(p)
    assert not acl.can_publish(None, "c", "a") and not acl.can_subscribe("u", "c", "a")


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("topic read a\nfoo bar\n", 2, "unknown keyword"),
        ("user\n", 1, "needs a username"),
        ("\n\ntopic\n", 3, "needs a topic filter"),
        ("topic read\n", 1, "needs a topic filter"),
        ("user x\ntopic read a/#/b\n", 2, "invalid filter"),
        ("pattern write dev/%c+/x\n", 1, "invalid filter"),
    ],
)
def test_bad_lines_name_the_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    p = tmp_path / "acl"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        Acl.load(p)
    assert info.value.line == line and info.value.file == str(p)
    assert words in str(info.value) and f"line {line}" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read ACL file"):
        Acl.load(tmp_path / "missing")


@pytest.mark.parametrize(
    ("inner", "outer", "expected"),
    [
        ("sensors/+/temp", "sensors/#", True),
        ("sensors/#", "sensors/#", True),
        ("sensors", "sensors/#", True),  # '#' covers the parent level
        ("sensors/#", "sensors/+/#", False),  # inner matches "sensors", outer does not
        ("sensors/#", "sensors/+/temp", False),
        ("a/+", "a/b", False),
        ("a/b", "a/+", True),
        ("a/+/c", "a/+/+", True),
        ("a/b/c", "a/+", False),
        ("#", "#", True),
        ("$SYS/#", "#", False),
        ("$SYS/a", "+/a", False),
        ("+/a", "+/+", True),
        ("a", "a/b", False),
        ("#", "+/#", True),  # "+/#" matches one-level topics too: same set as "#"
        ("a/#", "a/+/#", False),
    ],
)
def test_filter_within_examples(inner: str, outer: str, expected: bool) -> None:
    assert filter_within(inner, outer) is expected


LEVELS = ["a", "b", "$x", "+", "#"]
TOPIC_LEVELS = ["a", "b", "$x", "z", ""]
ALL_TOPICS = [
    "/".join(parts)
    for n in range(1, 5)
    for parts in itertools.product(TOPIC_LEVELS, repeat=n)
]


@st.composite
def filters(draw: st.DrawFn) -> str:
    n = draw(st.integers(1, 3))
    levels = [draw(st.sampled_from(LEVELS[:4])) for _ in range(n)]
    if draw(st.booleans()):
        levels[-1] = "#"
    return "/".join(levels)


@settings(max_examples=500, deadline=None)
@given(filters(), filters())
def test_filter_within_agrees_with_topic_matching(inner: str, outer: str) -> None:
    # Model check over every topic of up to 4 levels from a small alphabet: "within" must
    # hold exactly when no topic matches inner without matching outer.
    counterexamples = [
        t for t in ALL_TOPICS if topic_matches(inner, t) and not topic_matches(outer, t)
    ]
    assert filter_within(inner, outer) == (not counterexamples), counterexamples[:3]


def test_pattern_substitution_is_one_pass() -> None:
    """A username or client id that itself contains ``%c``/``%u`` is taken literally: the
    pattern is filled in one pass, so ``pattern write users/%u/x`` with username ``%c`` and
    client id ``victim`` grants ``users/%c/x``, not ``users/victim/x``."""
    acl = Acl.parse("pattern write users/%u/x\npattern write devices/%c/y\n", "acl.conf")
    client = acl.for_client("%c", "victim")
    assert client.can_publish("users/%c/x")
    assert not client.can_publish("users/victim/x")
    other = acl.for_client("alice", "%u")
    assert other.can_publish("devices/%u/y")
    assert not other.can_publish("devices/alice/y")


def test_access_flag_values_are_fixed() -> None:
    """The Access flags keep their values (``READWRITE`` is exactly ``READ | WRITE``, an alias,
    not a member of its own), so the flags written as literals for the compiled build
    (mypyc cannot evaluate one enum member from others) mean what ``enum.auto()`` gave."""
    assert [(m.name, m.value) for m in Access] == [("READ", 1), ("WRITE", 2), ("DENY", 4)]
    assert list(Access.__members__) == ["NONE", "READ", "WRITE", "READWRITE", "DENY"]
    assert Access.READWRITE is Access.READ | Access.WRITE
    assert Access.NONE.value == 0 and not Access.READWRITE & Access.DENY
