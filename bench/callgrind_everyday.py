"""Instruction counts (valgrind callgrind "Ir") of the broker's everyday path in one process,
per source tree (issue 29): sensors that each send one QoS 1 PUBLISH in a read of its own and
wait for its PUBACK, a few of them per commit -- the per-message and per-commit work of that
shape, which neither machine load nor socket timing moves.

    PYTHONPATH=$PWD python -m bench.callgrind_everyday ROUNDS name=/tree [name=/tree ...]
    PER_COMMIT=1 PYTHONPATH=$PWD python -m bench.callgrind_everyday 2000 main=$PWD

Each tree's `BrokerCore` runs over the tests' `FakeQueue` (tests/test_broker_session.py, no
disk, no sockets) with ``SENSORS`` (50) MQTT 3.1.1 clients on topics ``sensors/<i>/reading``;
a round has ``PER_COMMIT`` (5: about what one commit gathers at 1,000 msg/s) of them, in turn,
send one 40-byte PUBLISH each in a read of its own (receive_data, then the flush the shell
does after each read), then commits (PUBACKs released) and flushes. Prints Ir for ROUNDS and
ROUNDS / 2 and the difference per PUBLISH of the second half (as bench.callgrind_ingest).
``PYTHONHASHSEED=0``; valgrind ~50x slower.
"""
from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path


async def _load(rounds: int) -> None:
    from filemq.mqtt.codec import encode
    from filemq.mqtt.packets import Publish
    from tests.test_broker_session import Client, Harness

    sensors = int(os.environ.get("SENSORS", "50"))
    per_commit = int(os.environ.get("PER_COMMIT", "5"))
    h = Harness(Path(tempfile.mkdtemp(prefix="cg-everyday-")))
    clients: list[Client] = []
    for i in range(sensors):
        c = h.client()
        c.connect(f"sensor-{i}")
        c.transport.data.clear()  # the CONNACK
        clients.append(c)
    core, q = h.core, h.queue
    payload = b'{"s":1,"n":1,"v":21.5}'.ljust(40)
    parts = []
    for i in range(sensors):
        wire = encode(Publish(f"sensors/{i}/reading", payload, 1, packet_id=0x4242))
        at = wire.index(b"\x42\x42")
        parts.append((wire[:at], wire[at + 2:]))
    pids = [0] * sensors
    acked = sent = 0
    turn = 0
    for _ in range(rounds):
        batch = []
        for _ in range(per_commit):
            i = turn % sensors
            turn += 1
            pids[i] = pids[i] % 0xFFFF + 1
            head, rest = parts[i]
            clients[i].conn.receive_data(b"".join((head, pids[i].to_bytes(2, "big"), rest)))
            core.flush()
            batch.append(clients[i])
            sent += 1
        q.commit()
        for _ in range(3):
            await asyncio.sleep(0)
        core.flush()
        for c in batch:
            acked += len(c.transport.data) // 4
            c.transport.data.clear()
    assert acked == sent, (acked, sent)
    assert len(q.log.records) == sent
    assert not any(c.conn.closed for c in clients)


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
    per_commit = int(os.environ.get("PER_COMMIT", "5"))
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        loaded, less = _ir(Path(path), rounds), _ir(Path(path), half)
        print(f"{name} rounds={rounds} Ir={loaded:,} rounds={half} Ir={less:,} "
              f"per PUBLISH={(loaded - less) / ((rounds - half) * per_commit):,.0f}", flush=True)


if __name__ == "__main__":
    main()
