"""kill -9 of a real process appending under load: every acknowledged record survives.

The child (tests/kill9_child.py) appends through the real GroupCommitter with fsync = "always"
and reports what is acknowledged; the parent SIGKILLs it at a random moment, reopens the log
with ``Log.open`` and checks every record byte for byte.  Rounds continue on the same, growing
data directory, so recovery of earlier kills is exercised again and again.

A process kill loses no page-cache data, so this tests the process side of durability (no
acknowledgement before the write, recovery of whatever state a kill leaves, torn writes
from a kill in the middle of a roll or an atomic_write); power loss is covered by
tests/test_crash_model.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from filemq.queue.groups import ConsumerGroup, GroupConfig, group_directories
from segments import Log
from tests.kill9_child import CONFIG, expected_record

CHILD = Path(__file__).with_name("kill9_child.py")
ROUNDS = 20
SEED = 20240607


def run_round(data_dir: Path, rng: random.Random, *, group: bool, from_spawn: bool) -> tuple[list[str], float]:
    """Start the child, SIGKILL it after 50-400 ms (counted from its ready line, or from spawn)."""
    args = [sys.executable, str(CHILD), str(data_dir), str(SEED)] + (["--group"] if group else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode().strip()
            lines.append(line)
            if line.startswith("R "):
                ready.set()
        ready.set()  # EOF: the child died (killed, or crashed: the check below says which)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    delay = rng.uniform(0.05, 0.4)
    if not from_spawn:
        assert ready.wait(30), "child did not get ready in 30 s"
    time.sleep(delay)
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    reader.join(30)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert alive, f"child exited by itself (code {proc.returncode}): {err[-2000:]}"
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    return lines, delay


def last(lines: list[str], tag: str, default: int) -> int:
    values = [int(line.split()[1]) for line in lines if line.startswith(tag + " ")]
    return values[-1] if values else default


def check_log(data_dir: Path, acked: int) -> int:
    """Every acknowledged offset present and byte-identical, nothing else unexpected; returns next_offset."""
    log = Log.open(data_dir / "log", CONFIG)
    try:
        assert log.next_offset >= acked, f"acknowledged up to {acked}, log ends at {log.next_offset}"
        assert log.recovery.corrupt_records == 0, log.recovery
        offset = 0
        while offset < log.next_offset:
            records = log.read(offset, 5000, 8 << 20)
            assert records, f"offset {offset} missing"
            for r in records:
                assert r.offset == offset, f"expected offset {offset}, got {r.offset}"
                assert (r.topic, r.payload) == expected_record(SEED, r.offset), f"record {r.offset} differs"
                offset += 1
        assert log.stats.corrupt_skipped == 0
        return log.next_offset
    finally:
        log.close()


def check_group(data_dir: Path, lines: list[str], end: int) -> bool:
    """The group resumes between its last completed persist and its last announced Pending."""
    config = GroupConfig(persist_every_acks=10**9, persist_interval_ms=10**9)
    log = Log.open(data_dir / "log", CONFIG)
    try:
        dirs = list(group_directories(data_dir / "groups"))
        if not dirs:  # killed before the group was created
            assert not any(line.startswith("D ") for line in lines)
            return False
        group = ConsumerGroup.load(dirs[0], log, config=config)
        pending = group.pending_offset
        # Announced values were the group's lowest unacked offset at the time and Pending only
        # grows, so resuming at or below the last one never skips an unacked record; resuming
        # at or above the last completed persist redelivers only acks made after it.
        announced = [int(x.split()[1]) for x in lines if x.startswith("P ")]
        if announced:
            done = last(lines, "D", -1)
            assert done <= pending <= max(announced), (
                f"group resumed at {pending}, persisted {done}, announced up to {max(announced)}"
            )
        assert pending <= end
        first = group.fetch(1)
        if first:  # the group restarts exactly at its Pending
            assert first[0].offset == pending
            assert (first[0].topic, first[0].payload) == expected_record(SEED, first[0].offset)
        return bool(announced)
    finally:
        log.close()


@pytest.mark.slow
def test_kill9_loses_no_acknowledged_record_and_group_resumes_safely(tmp_path: Path) -> None:
    """20 rounds: producers (fsync=always, 4 x 64 in flight) and a consumer group, killed at random."""
    rng = random.Random(SEED)
    acked_total = 0
    end = 0
    progressed = 0
    group_rounds = 0
    for round_no in range(ROUNDS):
        # Every 5th kill is timed from spawn, so some land during start-up and recovery.
        lines, _ = run_round(tmp_path, rng, group=True, from_spawn=round_no % 5 == 4)
        started_at = last(lines, "R", -1)
        if started_at >= 0:
            assert started_at == end, f"round {round_no}: child resumed at {started_at}, log ended at {end}"
        acked = last(lines, "A", 0)
        if acked:
            assert acked > end, f"round {round_no}: acknowledged {acked} but the log already ended at {end}"
            progressed += 1
        acked_total = max(acked_total, acked)
        end = check_log(tmp_path, acked_total)
        group_rounds += check_group(tmp_path, lines, end)
    # The kills must have landed under load, not only before the first append.
    assert progressed >= ROUNDS // 3, f"only {progressed} of {ROUNDS} rounds acknowledged anything"
    assert group_rounds >= ROUNDS // 3, f"the group persisted in only {group_rounds} rounds"
    assert end >= acked_total > 0


def test_child_records_are_deterministic_and_vary_in_size() -> None:
    sizes = {len(expected_record(SEED, o)[1]) for o in range(200)}
    assert expected_record(SEED, 5) == expected_record(SEED, 5)
    assert expected_record(SEED, 5) != expected_record(SEED + 1, 5)
    assert min(sizes) < 50 and max(sizes) > 600
    assert os.path.exists(CHILD)
