"""Instruction counts (valgrind callgrind "Ir") of the broker's fanout delivery path in one
process, per source tree: a measure of the per-delivery work that neither machine load nor
socket timing moves (unlike `bench.callgrind_broker`, whose batch sizes follow the timing).

    PYTHONPATH=$PWD python -m bench.callgrind_delivery ROUNDS name=/tree [name=/tree ...]
    ACKS_PER_READ=5 V5=1 PYTHONPATH=$PWD python -m bench.callgrind_delivery ROUNDS ...

Each tree's `BrokerCore` runs over the tests' `FakeQueue` (tests/broker_harness.py, no
disk, no sockets) with 10 persistent QoS 1 subscribers on ``bench/fanout/#`` (``V5=1``: MQTT 5
clients); a round publishes 100 QoS 1 messages of 100 bytes to 4 topics, commits them (route ->
fetch -> _deliver -> write) and feeds every subscriber its PUBACKs, ``ACKS_PER_READ`` (100) per
read (receive_data -> receive -> on_pubacks -> group ack), and flushes after each read as the broker does
(``WINDOW=20``: the subscribers' in-flight window, 200 unless given; a read of PUBACKs then
refills it, fetch -> _deliver -> write, as in the real load).  Prints Ir for ROUNDS and for 0 rounds and the
difference per delivery (publish side included).  ``PYTHONHASHSEED=0``; valgrind ~50x slower.
"""
from __future__ import annotations

import asyncio
import importlib
import os
import sys
import tempfile
from pathlib import Path


async def _load(rounds: int) -> None:
    from filemq.mqtt.packets import Subscribe
    # Every tree loads tests/test_broker_session.py (older trees keep the harness there), so
    # the same modules are in memory and the garbage collector's passes cost every tree the
    # same (a tree importing only tests/broker_harness.py counted ~6 % fewer Ir per delivery).
    importlib.import_module("tests.test_broker_session")
    try:
        from tests.broker_harness import Client, Harness
    except ImportError:  # a tree from before tests/broker_harness.py
        from tests.test_broker_session import Client, Harness  # type: ignore[attr-defined]

    acks_per_read = int(os.environ.get("ACKS_PER_READ", "100"))
    window = int(os.environ.get("WINDOW", "200"))
    h = Harness(Path(tempfile.mkdtemp(prefix="cg-delivery-")), max_inflight=window)
    subs = []
    for i in range(10):
        c: Client
        if os.environ.get("V5") == "1":
            # every tree's tests/test_broker_mqtt5.py has client5 (older trees define it there,
            # newer ones import it from tests/broker_harness5.py): the same modules load in every tree
            client5 = importlib.import_module("tests.test_broker_mqtt5").client5
            c = client5(h)
            c.connect(f"s{i}", False)
        else:
            c = h.client()
            c.connect(f"s{i}", False)
        c.send(Subscribe(1, [("bench/fanout/#", 1)]))
        c.received()
        subs.append(c)
    core, q = h.core, h.queue
    # no offset-file threads (a tree from before issue 31's core parts: the core's own method)
    setattr(getattr(core, "delivery", core), "persist_offsets" if hasattr(core, "delivery") else "_persist_offsets",
            lambda: None)
    payload = b"x" * 100
    topics = [f"bench/fanout/{i}" for i in range(4)]
    delivered = 0
    for _ in range(rounds):
        for i in range(100):
            q.publish_nowait(topics[i % 4], payload, 1, validated=True)
        q.commit()
        for _ in range(3):
            await asyncio.sleep(0)
        core.flush()
        busy = True
        while busy:  # with a small WINDOW: each read of PUBACKs refills it (flush), as in the broker
            busy = False
            for s in subs:
                state = s.conn.session
                assert state is not None
                if not state.qos.inflight:
                    continue
                busy = True
                delivered += len(state.qos.inflight)
                acks = [b"\x40\x02" + pid.to_bytes(2, "big") for pid in state.qos.inflight]
                for j in range(0, len(acks), acks_per_read):
                    s.feed(b"".join(acks[j:j + acks_per_read]), 0.0)
                    core.flush()
                s.transport.data.clear()
        for s in subs:
            s.transport.data.clear()
    assert delivered == rounds * 1000, delivered


def _ir(tree: Path, rounds: int) -> int:
    from bench.valgrind import callgrind_ir  # (the outer process only: see bench/valgrind.py)

    return callgrind_ir(__file__, tree, rounds)


def main() -> None:
    if sys.argv[1] == "--inner":
        sys.path.insert(0, os.environ["PYTHONPATH"])
        asyncio.run(_load(int(sys.argv[2])))
        return
    rounds = int(sys.argv[1])
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        loaded, idle = _ir(Path(path), rounds), _ir(Path(path), 0)
        print(f"{name} rounds={rounds} Ir={loaded:,} idle={idle:,} per delivery={(loaded - idle) / (rounds * 1000):,.0f}",
              flush=True)


if __name__ == "__main__":
    main()
