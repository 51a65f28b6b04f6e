"""The delivery run path's two caches (issue 16): ``SessionState.run_qos`` answers a fetch's
frozenset of topics from a cache once the run is past every subscription's start, and a
consumer group's fetch tests a run's topics against the set of topics known to match.  Both
must give, for any subscriptions, filters, runs and subscription changes, what the uncached
computation gives: a subscription that starts inside a later run, one added or removed, or a
filter changed must be seen at once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.broker.session_state import SessionState, Subscription
from filemq.common.topics import topic_matches
from filemq.queue.groups import ConsumerGroup

TOPICS = ["a/b", "a/c", "a/b/c", "x", "$SYS/x"]
FILTERS = ["a/b", "a/+", "a/#", "#", "+", "x", "$SYS/#"]
SHARES = [None, "g/a/#"]


def _reference(state: SessionState, topics: frozenset[str], lowest: int, share: str | None) -> int:
    """run_qos from its definition: the QoS granted_qos gives every record >= lowest of the
    topics (for offsets far beyond it too), if one value for all; -1 if a subscription of
    ``share`` starts inside the run."""
    answers = set()
    for topic in topics:
        for s in state.subs.values():
            if s.share == share and topic_matches(s.plain, topic) and s.start > lowest:
                return -1
        best = -1
        for s in state.subs.values():
            if s.share == share and topic_matches(s.plain, topic) and s.start <= lowest and s.qos > best:
                best = s.qos
        answers.add(best)
    return answers.pop() if len(answers) == 1 else -1


_subscription = st.tuples(st.sampled_from(FILTERS), st.integers(0, 2), st.integers(0, 60), st.sampled_from(SHARES))
# A few topic sets, so that runs repeat one (a cache hit) at offsets before and after starts.
_TOPIC_SETS = [frozenset({"a/b"}), frozenset({"a/b", "a/c"}), frozenset({"x", "a/b/c"}), frozenset(TOPICS)]
_step = st.one_of(
    st.tuples(st.just("run"), st.sampled_from(_TOPIC_SETS), st.integers(0, 80),
              st.sampled_from(SHARES)),
    st.tuples(st.just("subscribe"), _subscription),
    st.tuples(st.just("unsubscribe"), st.sampled_from(FILTERS)),
)


@given(st.lists(_subscription, max_size=4), st.lists(_step, min_size=1, max_size=40))
@settings(max_examples=300, deadline=None)
def test_run_qos_with_its_cache_is_the_uncached_answer(subs: list[tuple[str, int, int, str | None]],
                                                       steps: list[tuple]) -> None:  # type: ignore[type-arg]
    state = SessionState("c", True)

    def subscribe(f: str, qos: int, start: int, share: str | None) -> None:
        key = f if share is None else f"$share/g/{f}"
        state.subs[key] = Subscription(key, f, None if share is None else f"g/{f}", qos, start)
        state.subs_changed()  # as the broker does on every SUBSCRIBE / UNSUBSCRIBE

    for f, qos, start, share in subs:
        subscribe(f, qos, start, share)
    for step in steps:
        if step[0] == "run":
            _, topics, lowest, share = step
            if share is not None:
                share = next((s.share for s in state.subs.values() if s.share is not None), share)
            assert state.run_qos(topics, lowest, share) == _reference(state, topics, lowest, share), step
            # the same set again (a cache hit when past every start), and a set of its own
            assert state.run_qos(topics, lowest, share) == _reference(state, topics, lowest, share), step
            assert state.run_qos(set(topics), lowest, share) == _reference(state, topics, lowest, share), step
        elif step[0] == "subscribe":
            subscribe(*step[1])
        else:
            state.subs.pop(step[1], None)
            state.subs_changed()


class _Log:
    """The slice of a LogView a group's fetch reads: committed records on given topics."""

    def __init__(self, topics: list[str]) -> None:
        from segments.record import Record
        self.records = [Record(i, 0, t, b"p", 1, False) for i, t in enumerate(topics)]
        self.committed_offset = len(self.records)

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list:  # type: ignore[type-arg]
        return self.records[offset:offset + max_records]


@given(st.lists(st.sampled_from(TOPICS), min_size=20, max_size=60), st.lists(st.sampled_from(FILTERS), min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(1, 6), st.one_of(st.none(), st.lists(st.sampled_from(FILTERS), min_size=1, max_size=3))),
                min_size=1, max_size=12))
@settings(max_examples=300, deadline=None)
def test_a_groups_fetch_delivers_exactly_the_matching_records_across_filter_changes(
        topics: list[str], filters: list[str], steps: list[tuple[int, list[str] | None]]) -> None:
    """Fetches of any sizes, with the filters replaced between some of them: every record is
    delivered iff its topic matches the filters in force when it was fetched (the run fast path
    and its set of matching topics included)."""
    log = _Log(topics)
    group = ConsumerGroup("g", log, filters=filters, start_offset=0, durable=False)  # type: ignore[arg-type]
    current = list(filters)
    delivered: list[int] = []
    expected: list[int] = []
    for size, new_filters in [*steps, (len(topics), None)]:
        if new_filters is not None:
            group.set_filters(new_filters)
            current = list(new_filters)
        before = group.doing_offset
        got = group.fetch(size, "c")
        for r in got:
            group.ack(r.offset)
        delivered += [r.offset for r in got]
        expected += [o for o in range(before, group.doing_offset)
                     if any(topic_matches(f, topics[o]) for f in current)]
    assert delivered == expected
    assert group.doing_offset == len(topics)



def test_a_cached_run_qos_is_not_used_before_a_subscriptions_start() -> None:
    """Cached at offset 60 (past the start 50), the answer for the same topics at 40 is -1:
    the subscription starts inside that run."""
    state = SessionState("c", True)
    state.subs["a/#"] = Subscription("a/#", "a/#", None, 1, 50)
    state.subs_changed()
    assert state.run_qos(frozenset({"a/b"}), 60, None) == 1
    assert state.run_qos(frozenset({"a/b"}), 40, None) == -1
    assert state.run_qos(frozenset({"a/b"}), 50, None) == 1


def test_a_filter_change_is_seen_by_the_next_fetch_of_a_topic_that_matched() -> None:
    """Three records on a/b fetched under a/#; after set_filters(["x"]) the next fetch
    delivers none of the next ones (the topic is no longer in the set of matching ones)."""
    log = _Log(["a/b"] * 10)
    group = ConsumerGroup("g", log, filters=["a/#"], start_offset=0, durable=False)  # type: ignore[arg-type]
    assert [r.offset for r in group.fetch(3, "c")] == [0, 1, 2]
    group.set_filters(["x"])
    assert group.fetch(3, "c") == []
    assert group.doing_offset == 10
