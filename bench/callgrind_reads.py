"""Instruction counts (valgrind callgrind "Ir") of one read of a few PUBACKs in the broker:
`Connection.receive_data` -> `BrokerCore.receive` -> `on_pubacks` -> `flush`, with no refill and no socket.

    A=4 PYTHONPATH=$PWD python -m bench.callgrind_reads READS name=/tree [name=/tree ...]

One persistent QoS 1 subscriber over the tests' `FakeQueue` (tests/broker_harness.py)
gets 4,000 messages in flight (its window is 4,000: the acks below reach the refill mark,
a quarter of the window in flight, only past 3,000 ids, and the refill then finds nothing
to send); then READS reads of ``A`` PUBACKs each (ids in the order they were sent) are
fed to it, each followed by the broker's `flush`, as `data_received` does.  Prints the Ir per
read: the run with READS reads minus the run with none (the PUBACK bytes are built before
the reads, in both).  The regime of a subscriber that sends each PUBACK in a send of its own
(`filemq bench broker --subscriber-client single`), whose reads carry a few PUBACKs each.
``PYTHONHASHSEED=0``; a few thousand Ir of noise between runs.
"""
from __future__ import annotations

import asyncio
import importlib
import os
import sys
import tempfile
from pathlib import Path

MESSAGES = 4000


def _acks_per_read() -> int:
    return int(os.environ.get("A", "4"))


async def feed_reads(reads: int) -> int:
    """Feed ``reads`` reads of PUBACKs; returns how many ids were acked."""
    from filemq.mqtt.packets import Subscribe
    from filemq.ops.gctune import tune_gc
    # Every tree loads tests/test_broker_session.py (older trees keep the harness there), so
    # the same modules are in memory and the garbage collector's passes cost every tree the
    # same (a tree importing only tests/broker_harness.py counted ~6 % fewer Ir per delivery).
    importlib.import_module("tests.test_broker_session")
    try:
        from tests.broker_harness import Harness
    except ImportError:  # a tree from before tests/broker_harness.py
        from tests.test_broker_session import Harness  # type: ignore[attr-defined]

    per_read = _acks_per_read()
    if reads * per_read > MESSAGES:
        raise SystemExit(f"at most {MESSAGES // per_read} reads of {per_read} PUBACKs")
    tune_gc()
    h = Harness(Path(tempfile.mkdtemp(prefix="cg-reads-")), max_inflight=MESSAGES)
    c = h.connected("s0", False, subscribe=Subscribe(1, [("t/#", 1)]))
    core, q = h.core, h.queue
    # no offset-file threads (a tree from before issue 31's core parts: the core's own method)
    setattr(getattr(core, "delivery", core), "persist_offsets" if hasattr(core, "delivery") else "_persist_offsets",
            lambda: None)
    for i in range(MESSAGES):
        q.publish_nowait(f"t/{i % 4}", b"x" * 100, 1, validated=True)
    q.commit()
    for _ in range(10):  # the commit's routing, then the pump's passes (1,000 records each)
        await asyncio.sleep(0)
    core.flush()
    state = c.conn.session
    assert state is not None and len(state.qos.inflight) == MESSAGES, "the window did not fill"
    pids = list(state.qos.inflight)
    datas = [b"".join(b"\x40\x02" + p.to_bytes(2, "big") for p in pids[i:i + per_read])
             for i in range(0, reads * per_read, per_read)]
    conn, receive, flush = c.conn, core.receive, core.flush
    for data in datas:
        receive(conn, conn.receive_data(data, 0.0))
        flush()
    acked = MESSAGES - len(state.qos.inflight)
    assert acked == reads * per_read, (acked, reads * per_read)
    return acked


def _ir(tree: Path, reads: int) -> int:
    from bench.valgrind import callgrind_ir  # (the outer process only: see bench/valgrind.py)

    return callgrind_ir(__file__, tree, reads)


def main() -> None:
    if sys.argv[1] == "--inner":
        sys.path.insert(0, os.environ["PYTHONPATH"])
        asyncio.run(feed_reads(int(sys.argv[2])))
        return
    reads = int(sys.argv[1])
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        loaded, idle = _ir(Path(path), reads), _ir(Path(path), 0)
        print(f"{name} A={_acks_per_read()} reads={reads} Ir={loaded:,} idle={idle:,} "
              f"per read={(loaded - idle) / reads:,.0f}", flush=True)


if __name__ == "__main__":
    main()
