"""PublisherRuns (filemq/broker/session_state.py), the no-local publisher map kept as runs
(MQTT-3.8.3-3), against the OrderedDict of one entry per offset it replaced."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.broker.session_state import PublisherRuns

_ops = st.lists(st.one_of(
    st.tuples(st.just("run"), st.integers(0, 3), st.integers(1, 40), st.sampled_from("pq")),  # gap, n, id
    st.tuples(st.just("forget"), st.integers(0, 60)),  # how far back from the end
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(kept=st.integers(1, 100), ops=_ops)
def test_runs_hold_what_one_entry_per_offset_holds(kept: int, ops: list[tuple[object, ...]]) -> None:
    runs = PublisherRuns(kept)
    model: OrderedDict[int, str] = OrderedDict()
    nxt = 0
    for op in ops:
        if op[0] == "run":
            _, gap, n, cid = op
            assert isinstance(gap, int) and isinstance(n, int) and isinstance(cid, str)
            first = nxt + gap
            if n == 1:
                runs.set(first, cid)
            else:
                runs.add_run(first, n, cid)
            for o in range(first, first + n):
                model[o] = cid
                if len(model) > kept:
                    model.popitem(last=False)
            nxt = first + n
        else:
            back = op[1]
            assert isinstance(back, int)
            cut = max(0, nxt - back)
            runs.forget_from(cut)
            for o in [o for o in model if o >= cut]:
                del model[o]
            nxt = min(nxt, cut) if model else cut  # the log reuses offsets from the cut on
        assert runs.items() == list(model.items())
        assert len(runs) == len(model)
        for o in range(max(0, nxt - kept - 5), nxt + 3):
            assert runs.get(o) == model.get(o), o


def test_a_long_stream_stays_bounded_and_compacts() -> None:
    runs = PublisherRuns(1000)
    for i in range(20_000):
        runs.add_run(i * 7, 7, "p" if i % 3 else "q")
    assert len(runs) == 1000
    # Neighbouring runs of one client id are one entry: q (7 offsets), p p (14), ...
    assert len(runs._starts) - runs._head == 96  # the runs that hold the last 1,000 offsets
    assert len(runs._starts) < 400  # dropped runs are compacted away
    assert runs.get(20_000 * 7 - 1) == ("q" if (20_000 - 1) % 3 == 0 else "p")
    assert runs.get(20_000 * 7 - 1000) is not None
    assert runs.get(20_000 * 7 - 1001) is None
