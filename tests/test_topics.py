"""MQTT 3.1.1 topic rules (section 4.7): validation, matching and the filter trie."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.common.topics import (
    MAX_TOPIC_BYTES,
    InvalidTopic,
    TopicTrie,
    parse_shared,
    topic_matches,
    validate_topic_filter,
    validate_topic_name,
)

# ---- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["a", "/", "a/b/c", "/finance", "sport/", "$SYS/broker/uptime", "é/ü", " ", "a//b"],
)
def test_valid_topic_names(name: str) -> None:
    validate_topic_name(name)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "at least one character"),
        ("a/+/b", "wildcards"),
        ("a/#", "wildcards"),
        ("a+b", "wildcards"),
        ("a\x00b", "null character"),
        ("a" * (MAX_TOPIC_BYTES + 1), "more than the 65535"),
        ("é" * (MAX_TOPIC_BYTES // 2 + 1), "UTF-8 bytes"),
        ("a\ud800", "UTF-8"),
    ],
)
def test_invalid_topic_names(name: str, reason: str) -> None:
    with pytest.raises(InvalidTopic, match=reason) as info:
        validate_topic_name(name)
    assert info.value.topic == name
    assert isinstance(info.value, ValueError)


def test_topic_of_exactly_max_bytes_is_valid() -> None:
    validate_topic_name("a" * MAX_TOPIC_BYTES)
    validate_topic_filter("a" * (MAX_TOPIC_BYTES - 2) + "/#")


@pytest.mark.parametrize(
    "topic_filter", ["#", "+", "a/#", "+/+", "/+", "a/+/b", "+/#", "sport/tennis/+", "$SYS/#"]
)
def test_valid_filters(topic_filter: str) -> None:
    validate_topic_filter(topic_filter)


@pytest.mark.parametrize(
    ("topic_filter", "reason"),
    [
        ("", "at least one character"),
        ("a#", "whole level"),
        ("a/#/b", "last level"),
        ("#/a", "last level"),
        ("a/b#", "whole level"),
        ("a+", "whole level"),
        ("a/+b/c", "whole level"),
        ("++", "whole level"),
        ("a\x00/#", "null character"),
    ],
)
def test_invalid_filters(topic_filter: str, reason: str) -> None:
    with pytest.raises(InvalidTopic, match=reason):
        validate_topic_filter(topic_filter)


# ---- matching: the examples of the specification -------------------------------------------


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        # 4.7.1.2 multi-level wildcard
        ("sport/tennis/player1/#", "sport/tennis/player1", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
        ("sport/#", "sport", True),
        ("sport/#", "sport/", True),
        ("sport/#", "sports", False),
        ("#", "anything/at/all", True),
        # 4.7.1.3 single-level wildcard
        ("sport/tennis/+", "sport/tennis/player1", True),
        ("sport/tennis/+", "sport/tennis/player2", True),
        ("sport/tennis/+", "sport/tennis/player1/ranking", False),
        ("sport/+", "sport", False),
        ("sport/+", "sport/", True),
        ("+/+", "/finance", True),
        ("/+", "/finance", True),
        ("+", "/finance", False),
        ("+", "finance", True),
        ("+/tennis/#", "sport/tennis/player1", True),
        # 4.7.2 topics beginning with $
        ("#", "$SYS/broker", False),
        ("+/monitor/Clients", "$SYS/monitor/Clients", False),
        ("$SYS/#", "$SYS/monitor/Clients", True),
        ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
        ("$SYS", "$SYS", True),
        # plain names are compared exactly, case-sensitively
        ("a/b", "a/b", True),
        ("a/b", "A/b", False),
        ("a/b", "a/b/", False),
        ("a//b", "a//b", True),
        ("a/+/b", "a//b", True),
    ],
)
def test_topic_matches_spec_examples(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected
    trie: TopicTrie[str] = TopicTrie()
    trie.add(topic_filter, "v")
    assert trie.match(topic) == ({"v"} if expected else set())


# ---- shared subscriptions ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("$share/g1/a/b", ("g1", "a/b")),
        ("$share/g1/#", ("g1", "#")),
        ("$share/consumers/+/temp", ("consumers", "+/temp")),
        ("a/b", (None, "a/b")),
        ("$SYS/#", (None, "$SYS/#")),
        ("$sharex/g/a", (None, "$sharex/g/a")),
    ],
)
def test_parse_shared(raw: str, expected: tuple[str | None, str]) -> None:
    assert parse_shared(raw) == expected


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("$share/g1", "needs"),
        ("$share//a", "empty"),
        ("$share/g+/a", "wildcard"),
        ("$share/#/a", "wildcard"),
        ("$share/g/", "at least one character"),
        ("$share/g/a#", "whole level"),
    ],
)
def test_parse_shared_rejects(raw: str, reason: str) -> None:
    with pytest.raises(InvalidTopic, match=reason):
        parse_shared(raw)


# ---- the trie ---------------------------------------------------------------------------


def test_trie_add_remove_len_and_pruning() -> None:
    trie: TopicTrie[int] = TopicTrie()
    assert trie.add("a/+/c", 1)
    assert not trie.add("a/+/c", 1)  # same pair again is not stored twice
    assert trie.add("a/+/c", 2)
    assert trie.add("a/#", 3)
    assert len(trie) == 3
    assert trie.match("a/b/c") == {1, 2, 3}
    assert trie.remove("a/+/c", 1)
    assert not trie.remove("a/+/c", 1)
    assert not trie.remove("x/y", 1)
    assert trie.match("a/b/c") == {2, 3}
    assert trie.remove("a/+/c", 2)
    assert trie.remove("a/#", 3)
    assert len(trie) == 0
    assert trie.match("a/b/c") == set()
    assert list(trie.filters()) == []  # every node pruned


def test_trie_remove_keeps_shared_prefix() -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add("a/b", "x")
    trie.add("a/b/c", "y")
    assert trie.remove("a/b/c", "y")
    assert trie.match("a/b") == {"x"}
    assert sorted(f for f, _ in trie.filters()) == ["a/b"]


def test_trie_handles_very_deep_topics() -> None:
    trie: TopicTrie[str] = TopicTrie()
    deep = "/".join(["x"] * 5000)
    trie.add(deep, "deep")
    trie.add("x/#", "hash")
    assert trie.match(deep) == {"deep", "hash"}


# Small alphabets make collisions between filters and topics likely, so matches happen often.
_level = st.sampled_from(["a", "b", "", "$SYS", "$x", "c"])
_topics = st.lists(_level, min_size=1, max_size=5).map("/".join).filter(bool)


@st.composite
def _filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from(["a", "b", "", "+", "$SYS", "c"]), min_size=1, max_size=5))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "+"  # a filter cannot be empty


@settings(max_examples=300, deadline=None)
@given(st.lists(_filters(), max_size=12), st.lists(_topics, min_size=1, max_size=10))
def test_trie_agrees_with_topic_matches(filters: list[str], topics: list[str]) -> None:
    trie: TopicTrie[int] = TopicTrie()
    for i, f in enumerate(filters):
        validate_topic_filter(f)
        trie.add(f, i)
    for topic in topics:
        expected = {i for i, f in enumerate(filters) if topic_matches(f, topic)}
        assert trie.match(topic) == expected, (topic, filters)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_filters(), st.integers(0, 3)), max_size=15), st.data())
def test_trie_after_removals_agrees_with_topic_matches(
    pairs: list[tuple[str, int]], data: st.DataObject
) -> None:
    trie: TopicTrie[int] = TopicTrie()
    live: set[tuple[str, int]] = set()
    for f, v in pairs:
        trie.add(f, v)
        live.add((f, v))
    for f, v in data.draw(st.lists(st.sampled_from(pairs), max_size=len(pairs))) if pairs else []:
        assert trie.remove(f, v) == ((f, v) in live)
        live.discard((f, v))
    assert len(trie) == len(live)
    topic = data.draw(_topics)
    assert trie.match(topic) == {v for f, v in live if topic_matches(f, topic)}
