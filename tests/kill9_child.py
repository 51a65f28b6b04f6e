"""Child process for tests/test_kill9.py: appends under load until it is killed with SIGKILL.

Usage: ``python tests/kill9_child.py DATA_DIR SEED [--group]``

It opens ``DATA_DIR/log`` (continuing at its next offset) and appends through the real
:class:`segments.GroupCommitter` (fsync = "always") from several producers, each keeping many
appends in flight.  The record at offset ``o`` is always :func:`expected_record` ``(seed, o)``,
so the parent can check every byte without being told the payloads.

It reports on stdout, one line each, flushed, *only after the fact is durable*:

``R <next_offset>``   ready (the log is open and recovered)
``A <n>``             every offset < n is acknowledged (its commit future resolved)

With ``--group`` it also consumes with the durable consumer group ``kill9`` (acks in random
order, persisting every few dozen acks) and reports:

``P <p>``             about to persist Pending = p (the group's lowest unacked offset now)
``D <p>``             Pending = p is persisted (atomic_write returned)

So after a kill, the group's Pending on disk lies between the last ``D`` and the last ``P``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import struct
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from filemq.queue.groups import ConsumerGroup, GroupConfig, group_directories  # noqa: E402
from segments import GroupCommitter, Log, LogConfig  # noqa: E402

CONFIG = LogConfig(segment_bytes=128 * 1024, index_interval_bytes=4096, fsync="always")
PRODUCERS = 4
IN_FLIGHT = 64
MAX_PAYLOAD = 700
GROUP = "kill9"


def expected_record(seed: int, offset: int) -> tuple[str, bytes]:
    """The topic and payload of offset ``offset`` in a run with ``seed`` (random size 0..700)."""
    digest = hashlib.blake2b(struct.pack(">QQ", seed, offset), digest_size=32).digest()
    size = int.from_bytes(digest[:2], "big") % (MAX_PAYLOAD + 1)
    payload = (digest * (size // 32 + 1))[:size]
    return f"dev/{offset % 7}/t", payload


class Reporter:
    def __init__(self) -> None:
        self.acked = 0

    def line(self, text: str) -> None:
        os.write(1, (text + "\n").encode())  # unbuffered: the line is in the pipe when this returns

    def acked_below(self, n: int) -> None:
        if n > self.acked:
            self.acked = n
            self.line(f"A {n}")


async def producer(gc: GroupCommitter, log: Log, seed: int, out: Reporter) -> None:
    window: deque[tuple[int, asyncio.Future[None]]] = deque()
    while True:
        offset = log.next_offset  # appends run on this one loop thread: this is the offset we get
        topic, payload = expected_record(seed, offset)
        got, future = gc.append_nowait(topic, payload, qos=1)
        if got != offset:
            raise AssertionError(f"append got offset {got}, expected {offset}")
        window.append((got, future))
        if len(window) >= IN_FLIGHT:
            done, fut = window.popleft()
            await asyncio.shield(fut)
            out.acked_below(done + 1)  # commit order is offset order: all below are durable too
        else:
            await asyncio.sleep(0)


async def consumer(group: ConsumerGroup, seed: int, out: Reporter, rng: random.Random) -> None:
    held: list[int] = []
    acks = 0
    while True:
        for record in group.fetch(200):
            topic, payload = expected_record(seed, record.offset)
            if (record.topic, record.payload) != (topic, payload):
                raise AssertionError(f"group got a wrong record at offset {record.offset}")
            held.append(record.offset)
        rng.shuffle(held)
        for offset in held[len(held) // 2 :]:  # ack half, in random order, keep the rest for later
            group.ack(offset)
            acks += 1
        del held[len(held) // 2 :]
        if acks >= 50:
            acks = 0
            pending = group.pending_offset
            out.line(f"P {pending}")
            group.persist()
            out.line(f"D {pending}")
        await asyncio.sleep(0.001)


async def main(data_dir: Path, seed: int, with_group: bool) -> None:
    log = Log.open(data_dir / "log", CONFIG)
    out = Reporter()
    tasks = []
    if with_group:
        groups_dir = data_dir / "groups"
        config = GroupConfig(persist_every_acks=10**9, persist_interval_ms=10**9)
        existing = list(group_directories(groups_dir))
        if existing:
            group = ConsumerGroup.load(existing[0], log, config=config)
        else:
            group = ConsumerGroup.create(GROUP, log, groups_dir, start="earliest", config=config)
        rng = random.Random(seed ^ log.next_offset)
    gc = GroupCommitter(log)
    await gc.start()
    out.line(f"R {log.next_offset}")
    tasks = [asyncio.create_task(producer(gc, log, seed, out)) for _ in range(PRODUCERS)]
    if with_group:
        tasks.append(asyncio.create_task(consumer(group, seed, out, rng)))
    await asyncio.gather(*tasks)  # runs until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), "--group" in sys.argv[3:]))
