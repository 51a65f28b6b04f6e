"""Instruction counts (valgrind callgrind "Ir") of the broker's ingest path in one process,
per source tree: a measure of the per-PUBLISH work that neither machine load nor socket timing
moves (unlike `bench.callgrind_broker`, whose reads follow the timing).

    PYTHONPATH=$PWD python -m bench.callgrind_ingest ROUNDS name=/tree [name=/tree ...]
    PROTOCOL=5 READ=4096 PYTHONPATH=$PWD python -m bench.callgrind_ingest ROUNDS ...
    PROTOCOL=5 V5_PROPERTIES=1 PYTHONPATH=$PWD python -m bench.callgrind_ingest ROUNDS ...

Each tree's `BrokerCore` runs over the tests' `FakeQueue` (tests/broker_harness.py, no
disk, no sockets) with 4 publishers (``PROTOCOL=5``: MQTT 5 clients, no properties unless
``V5_PROPERTIES=1`` adds a content type and a user property to every PUBLISH, as `filemq bench
broker --protocol 5 --v5-properties`; else MQTT 3.1.1) on topics ``bench/ingest/<i>``, as `filemq bench broker --scenario ingest` loads
it; a round has each publisher send 100 QoS 1 PUBLISHes of 100 bytes (packet ids cycling
1..65535) in reads of ``READ`` bytes (4096 unless given; a read ends inside a packet as a TCP
read does), then commits them (PUBACKs released) and flushes.  Prints Ir for ROUNDS and for
ROUNDS / 2 and the difference per PUBLISH of the second half (not ROUNDS against 0: the
start-up -- imports, dataclass code generation -- differs by a few million instructions
between two trees with the same hot path, ~250 Ir per PUBLISH at 50 rounds, while one tree
gives the same count every time).  ``PYTHONHASHSEED=0``; valgrind ~50x slower.
"""
from __future__ import annotations

import asyncio
import importlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

PUBLISHERS = 4
PER_ROUND = 100


async def _load(rounds: int) -> None:
    from filemq.mqtt.codec import encode, encode5
    from filemq.mqtt.packets import Properties, Publish
    # Every tree loads tests/test_broker_session.py (older trees keep the harness there), so
    # the same modules are in memory and the garbage collector's passes cost every tree the
    # same (a tree importing only tests/broker_harness.py counted ~6 % fewer Ir per delivery).
    importlib.import_module("tests.test_broker_session")
    try:
        from tests.broker_harness import Client, Harness
    except ImportError:  # a tree from before tests/broker_harness.py
        from tests.test_broker_session import Client, Harness  # type: ignore[attr-defined]

    v5 = os.environ.get("PROTOCOL", "4") == "5"
    # bench.harness.loads.V5_PROPERTIES, spelt out: an older tree measured may not have it.
    props = Properties(content_type="application/octet-stream", user_properties=[("source", "bench")]) \
        if v5 and os.environ.get("V5_PROPERTIES") == "1" else None
    read = int(os.environ.get("READ", "4096"))
    h = Harness(Path(tempfile.mkdtemp(prefix="cg-ingest-")))
    pubs: list[Client] = []
    for i in range(PUBLISHERS):
        if v5:
            # every tree's tests/test_broker_mqtt5.py has client5 (older trees define it there,
            # newer ones import it from tests/broker_harness5.py): the same modules load in every tree
            client5 = importlib.import_module("tests.test_broker_mqtt5").client5
            c: Client = client5(h)
        else:
            c = h.client()
        c.connect(f"p{i}")
        c.transport.data.clear()  # the CONNACK
        pubs.append(c)
    if props is not None:
        _keep_headers(h)
    enc = encode5 if v5 else encode
    core, q = h.core, h.queue
    payload = b"x" * 100
    # Each publisher's PUBLISH bytes around the packet id (the same work per message for both
    # levels, so the harness adds the same to both): MQTT 5 has the empty property section.
    parts = []
    for i in range(PUBLISHERS):
        wire = enc(Publish(f"bench/ingest/{i}", payload, 1, packet_id=0x4242, properties=props))
        at = wire.index(b"\x42\x42")
        parts.append((wire[:at], wire[at + 2:]))
    pid = 0
    tails = [b""] * PUBLISHERS  # the part of a stream not sent yet (a packet cut by a read)
    acked = 0
    for _ in range(rounds):
        for i, c in enumerate(pubs):
            head, rest = parts[i]
            ids = [(pid + k) % 0xFFFF + 1 for k in range(PER_ROUND)]
            pid = ids[-1]
            stream = tails[i] + b"".join([b"".join((head, x.to_bytes(2, "big"), rest)) for x in ids])
            cut = len(stream) - len(stream) % read if len(stream) > read else len(stream)
            for k in range(0, cut, read):
                c.feed(stream[k:k + read], 0.0)
                core.flush()
            tails[i] = stream[cut:]
        q.commit()
        for _ in range(3):
            await asyncio.sleep(0)
        core.flush()
        for c in pubs:
            acked += len(c.transport.data) // 4
            c.transport.data.clear()
    for i, c in enumerate(pubs):  # the rest of each stream
        c.feed(tails[i], 0.0)
    q.commit()
    for _ in range(3):
        await asyncio.sleep(0)
    core.flush()
    for c in pubs:
        acked += len(c.transport.data) // 4
        assert not c.conn.closed
    assert acked == rounds * PER_ROUND * PUBLISHERS, acked
    assert len(q.log.records) == acked


def _keep_headers(h: Any) -> None:
    """The tests' FakeQueue stores no headers (an older tree's takes no ``headers=``): the
    core's single append keeps them in the record, as the real queue does."""
    from segments.record import Record

    queue = h.queue

    def append(topic: str, payload: bytes, qos: int = 0, retain: bool = False, timestamp_us: int | None = None,
               *, validated: bool = False, headers: bytes = b"") -> Any:
        offset, fut = queue.publish_nowait(topic, payload, qos, retain, timestamp_us, validated=validated)
        if headers:
            records = queue.log.records
            r = records[offset]
            records[offset] = Record(r.offset, r.timestamp_us, r.topic, r.payload, r.qos, r.retain, headers)
        return offset, fut

    getattr(h.core, "ingest", h.core)._append = append  # (a tree from before issue 31: the core's)


def _ir(tree: Path, rounds: int) -> int:
    from bench.valgrind import callgrind_ir  # (the outer process only: see bench/valgrind.py)

    return callgrind_ir(__file__, tree, rounds)


def main() -> None:
    if sys.argv[1] == "--inner":
        sys.path.insert(0, os.environ["PYTHONPATH"])
        asyncio.run(_load(int(sys.argv[2])))
        return
    rounds = int(sys.argv[1])
    half = rounds // 2
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        loaded, less = _ir(Path(path), rounds), _ir(Path(path), half)
        print(f"{name} rounds={rounds} Ir={loaded:,} rounds={half} Ir={less:,} "
              f"per PUBLISH={(loaded - less) / ((rounds - half) * PER_ROUND * PUBLISHERS):,.0f}", flush=True)


if __name__ == "__main__":
    main()
