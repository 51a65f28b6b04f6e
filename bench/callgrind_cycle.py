"""Instruction counts (valgrind callgrind "Ir") of one subscriber's steady-state fanout cycle
in one process, per source tree (issue 16): the per-delivery work of the run path alone, with
no publish side and no sockets, which neither machine load nor socket timing moves.

    PYTHONPATH=$PWD python -m bench.callgrind_cycle CYCLES name=/tree [name=/tree ...]
    WINDOW=20 ACKS=20 PYTHONPATH=$PWD python -m bench.callgrind_cycle 1000 main=$PWD

Each tree's `BrokerCore` runs over the tests' `FakeQueue` (tests/broker_harness.py) with
one persistent QoS 1 subscriber on ``bench/fanout/#`` and a window of ``WINDOW`` (20); the
log holds 40,300 committed, routed records of 100 bytes on 4 topics, all in the tail cache,
and the subscriber starts at its beginning. A cycle feeds the subscriber the PUBACKs of its
whole window, ``ACKS`` (= the window) per read (receive_data -> receive -> on_pubacks -> ack), and
flushes after each read as the broker does (refill: fetch -> _deliver_run -> write). Prints
Ir for CYCLES and for 0 cycles and the difference per delivery. Collected garbage is frozen
before the cycles (the broker freezes its start-up, filemq/ops/gctune.py).
``PYTHONHASHSEED=0``; valgrind ~50x slower (1,000 cycles: about 30 s per run).
"""
from __future__ import annotations

import asyncio
import gc
import importlib
import os
import sys
import tempfile
from pathlib import Path

RECORDS = 20 * 2010 + 100


async def run_cycles(cycles: int) -> None:
    """``cycles`` steady-state cycles of the subscriber (the body the ``--inner`` run counts);
    asserts that every cycle's PUBACKs refilled the window."""
    from filemq.mqtt.packets import Subscribe
    from segments.record import Record
    # Every tree loads tests/test_broker_session.py (older trees keep the harness there), so
    # the same modules are in memory and the garbage collector's passes cost every tree the
    # same (a tree importing only tests/broker_harness.py counted ~6 % fewer Ir per delivery).
    importlib.import_module("tests.test_broker_session")
    try:
        from tests.broker_harness import Harness
    except ImportError:  # a tree from before tests/broker_harness.py
        from tests.test_broker_session import Harness  # type: ignore[attr-defined]

    window = int(os.environ.get("WINDOW", "20"))
    per = int(os.environ.get("ACKS", str(window)))
    h = Harness(Path(tempfile.mkdtemp(prefix="cg-cycle-")), max_inflight=window)
    c = h.connected("s0", False, subscribe=Subscribe(1, [("bench/fanout/#", 1)]))
    core, q = h.core, h.queue
    # no offset-file threads (a tree from before issue 31's core parts: the core's own method)
    setattr(getattr(core, "delivery", core), "persist_offsets" if hasattr(core, "delivery") else "_persist_offsets",
            lambda: None)
    payload = b"x" * 100
    topics = [f"bench/fanout/{i}" for i in range(4)]
    q.log.records.extend(Record(i, 0, topics[i % 4], payload, 1, False) for i in range(RECORDS))
    q.log.committed_offset = RECORDS
    core.cache._tail_limit = 1 << 40  # all of them in the tail
    core.cache.put_many(q.log.records)
    setattr(getattr(core, "ingest", core), "_routed", RECORDS)  # noqa: B010 (a tree from before issue 31: the core's)
    core.cache.limit = RECORDS
    conn = c.conn
    state = conn.session
    assert state is not None
    core.pump(conn)
    core.flush()
    gc.collect()
    gc.freeze()
    sent = c.transport.data
    for _ in range(cycles):
        acks = b"".join([b"\x40\x02" + pid.to_bytes(2, "big") for pid in state.qos.inflight])
        for j in range(0, len(acks), 4 * per):
            c.feed(acks[j:j + 4 * per], 0.0)
            core.flush()
        assert sent and state.qos.inflight, "a cycle's PUBACKs refilled nothing"
        sent.clear()


def _ir(tree: Path, cycles: int) -> int:
    from bench.valgrind import callgrind_ir  # (the outer process only: see bench/valgrind.py)

    return callgrind_ir(__file__, tree, cycles, system_malloc=False)


def main() -> None:
    if sys.argv[1] == "--inner":
        sys.path.insert(0, os.environ["PYTHONPATH"])
        asyncio.run(run_cycles(int(sys.argv[2])))
        return
    cycles = int(sys.argv[1])
    window = int(os.environ.get("WINDOW", "20"))
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        loaded, idle = _ir(Path(path), cycles), _ir(Path(path), 0)
        print(f"{name} cycles={cycles} Ir={loaded:,} idle={idle:,} per delivery={(loaded - idle) / (cycles * window):,.0f}",
              flush=True)


if __name__ == "__main__":
    main()
