"""Instruction counts (valgrind callgrind "Ir") per record of `filemq bench append`'s filemq
run, per source tree (issue 29 item 5): the group-commit append path alone, which neither
machine load nor disk timing moves.

    PYTHONPATH=$PWD python -m bench.callgrind_append 40000 old=/tmp/old-tree new=$PWD
    MODE=thread FSYNC=always PYTHONPATH=$PWD python -m bench.callgrind_append 40000 new=$PWD

Each tree's `segments.GroupCommitter` takes RECORDS records of 100 bytes from 8 asyncio
producers with 100 appends in flight each, as `filemq bench append` does (fsync ``FSYNC``:
never by default, so that no sync time changes how records batch). ``MODE``: ``loop`` (the
default) commits on the event loop whatever a commit takes (valgrind makes every commit
slower than the 20 ms `commit_on_loop_max_ms` bound), ``thread`` on the commit thread
(``commit_on_loop_max_ms = 0``), ``default`` leaves the tree's own setting (trees from before
the on-loop commit have only the thread). Prints Ir for RECORDS and for RECORDS / 4 and
the difference per record (start-up and the log's open and close cancel out).
``PYTHONHASHSEED=0``; valgrind ~50x slower (40,000 records: about 30 s per run, unloaded).
"""
from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections import deque
from pathlib import Path

PRODUCERS = 8
INFLIGHT = 100


async def _produce(committer: object, count: int, payload: bytes) -> None:
    pending: deque[tuple[asyncio.Future[None], int]] = deque()
    in_flight = 0
    append = committer.append_nowait  # type: ignore[attr-defined]
    for _ in range(count):
        _, future = append("bench/append", payload, qos=1)
        if pending and pending[-1][0] is future:
            pending[-1] = (future, pending[-1][1] + 1)
        else:
            pending.append((future, 1))
        in_flight += 1
        while in_flight >= INFLIGHT:
            oldest, n = pending.popleft()
            await oldest
            in_flight -= n
    for future, _ in pending:
        await future


async def _run(records: int) -> None:
    from segments import GroupCommitter, Log, LogConfig

    config = LogConfig(fsync=os.environ.get("FSYNC", "never"))  # type: ignore[arg-type]
    mode = os.environ.get("MODE", "loop")
    if mode != "default" and hasattr(config, "commit_on_loop_max_ms"):
        config.commit_on_loop_max_ms = 1e9 if mode == "loop" else 0.0
    with tempfile.TemporaryDirectory(prefix="cg-append-") as d:
        log = Log.open(Path(d), config)
        committer = GroupCommitter(log)
        await committer.start()
        payload = b"x" * 100
        await asyncio.gather(*(_produce(committer, records // PRODUCERS, payload) for _ in range(PRODUCERS)))
        await committer.close()
        log.close()
        assert log.committed_offset == records // PRODUCERS * PRODUCERS


def _ir(tree: Path, records: int) -> int:
    from bench.valgrind import callgrind_ir  # (the outer process only: see bench/valgrind.py)

    return callgrind_ir(__file__, tree, records, system_malloc=False)


def main() -> None:
    if sys.argv[1] == "--inner":
        sys.path.insert(0, os.environ["PYTHONPATH"])
        asyncio.run(_run(int(sys.argv[2])))
        return
    records = int(sys.argv[1])
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        full, quarter = _ir(Path(path), records), _ir(Path(path), records // 4)
        print(f"{name} records={records} Ir={full:,} Ir({records // 4})={quarter:,} "
              f"per record={(full - quarter) / (records - records // 4):,.0f}", flush=True)


if __name__ == "__main__":
    main()
