"""CPU per record of the segment log's append, read and recovery paths, for two (or more)
filemq source trees in one run (the log-level sibling of ``bench/compare_trees.py``).

    PYTHONPATH=$PWD python -m bench.compare_log 5 before=/tmp/old-tree after=$PWD
    RECORDS=100000 HEADERS=1 PYTHONPATH=$PWD python -m bench.compare_log 3 a=/tree/a b=/tree/b

Each repetition runs every tree in turn, each in a fresh interpreter with ``PYTHONPATH`` =
the tree, on a fresh log in a temporary directory (``fsync = "never"``: the file system is
not what is measured):

* ``append``: ``Log.append`` of ``RECORDS`` records (100-byte payloads, 4 topics, QoS 1),
  ``flush`` every 1000 (encode, buffer, write);
* ``read``: ``Log.read`` of them all, 1000 at a time (the ``decode_run`` fast path);
* ``recover``: ``Log.open`` of the log as one unsealed segment (the ``scan_run`` tail scan);
* ``encode`` / ``decode_run``: the framing function ``Log.append`` calls (``encode_v1`` where it
  exists, else ``encode``) and ``decode_run`` on 1000 records in memory, best of many rounds
  (no file I/O: the least noisy figures).

Figures are process CPU time (``time.process_time``) per record in microseconds, each the
best of several passes inside the run (3 logs; 2 reads of each); the summary gives each
tree's best run and its ratio to the first tree's. ``HEADERS=1`` gives every
record 40 bytes of headers (record format 2; only for trees whose ``Log.append`` takes
``headers``). On a shared machine only figures from one run compare (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_WORKLOAD = r"""
import json, os, sys, tempfile, time
from segments import Log, LogConfig, Record
from segments import record as framing
from segments.record import decode_run

n = int(sys.argv[1])
headers = b"&\x00\x03key\x00\x05value" * 2 + b"\x03\x00\x0atext/plain" if sys.argv[2] == "1" else None
kw = {} if headers is None else {"headers": headers}
topics = ["sensors/a/temp", "sensors/b/temp", "sensors/c/hum", "sensors/d/hum"]
payload = bytes(range(100))
cfg = LogConfig(segment_bytes=(1 << 32) - 1, fsync="never")
clock = time.process_time
best = {"append": 1e9, "read": 1e9, "recover": 1e9, "encode": 1e9, "decode_run": 1e9}
for rnd in range(3):
    with tempfile.TemporaryDirectory(prefix="filemq-compare-log-") as d:
        log = Log.open(d, cfg)
        append = log.append
        t0 = clock()
        for i in range(n):
            append(topics[i & 3], payload, qos=1, **kw)
            if i % 1000 == 999:
                log.flush()
        log.flush()
        best["append"] = min(best["append"], clock() - t0)
        for _ in range(2):
            t0 = clock()
            offset = got = 0
            while offset < n:
                records = log.read(offset, 1000, 1 << 30)
                got += len(records)
                offset = records[-1].offset + 1
            best["read"] = min(best["read"], clock() - t0)
            assert got == n
        log.close()  # the one segment stays unsealed (active): open scans it record by record
        t0 = clock()
        again = Log.open(d, cfg)
        best["recover"] = min(best["recover"], clock() - t0)
        assert again.next_offset == n and again.recovery.scanned_bytes > 0
        again.close()
# In memory, 1000 records at a time, best of many rounds: the per-record cost of the framing
# itself, without file I/O (the least noisy figures on a shared machine).
topic_bytes = [t.encode() for t in topics]
extra = () if headers is None else (headers,)
# The framing function Log.append calls: encode_v1 for a record without headers where it exists.
encode = getattr(framing, "encode_v1", framing.encode) if headers is None else framing.encode
rounds = max(20, n // 1000)
for _ in range(rounds):
    t0 = clock()
    chunks = [encode(i, 1_700_000_000_000_000 + i, topic_bytes[i & 3], payload, 1, *extra) for i in range(1000)]
    best["encode"] = min(best["encode"], (clock() - t0) * n / 1000)
buf = b"".join(chunks)
for _ in range(rounds):
    out = []
    t0 = clock()
    decode_run(buf, 0, -1, 0, 1 << 62, out, 10_000, 1 << 40, 0)
    best["decode_run"] = min(best["decode_run"], (clock() - t0) * n / 1000)
    assert len(out) == 1000
print(json.dumps(best))
"""

PHASES = ("append", "read", "recover", "encode", "decode_run")


def run_tree(tree: Path, records: int, headers: bool) -> dict[str, float]:
    """One run of the workload against ``tree``: CPU microseconds per record, per phase."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", _WORKLOAD, str(records), "1" if headers else "0"],
        env=env, cwd=tree, check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    seconds: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return {phase: 1e6 * seconds[phase] / records for phase in PHASES}


def compare(reps: int, trees: dict[str, Path], records: int, headers: bool) -> list[str]:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    lines: list[str] = []
    for rep in range(reps):
        for name, tree in trees.items():
            figures = run_tree(tree, records, headers)
            runs[name].append(figures)
            line = f"log {name:10} run {rep}: " + "  ".join(f"{p} {figures[p]:.3f} us" for p in PHASES)
            lines.append(line)
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    base = next(iter(trees))
    best = {name: {p: min(r[p] for r in figures) for p in PHASES} for name, figures in runs.items()}
    for name in trees:
        lines.append(f"SUMMARY log {name:10} best " + "  ".join(
            f"{p} {best[name][p]:.3f} us ({best[name][p] / best[base][p]:.3f}x {base})" for p in PHASES))
    return lines


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit(__doc__)
    trees = {name: Path(path).resolve() for name, path in (a.split("=", 1) for a in argv[1:])}
    records = int(os.environ.get("RECORDS", "200000"))
    headers = os.environ.get("HEADERS", "") == "1"
    for line in compare(int(argv[0]), trees, records, headers)[-len(trees):]:
        sys.stdout.write(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
