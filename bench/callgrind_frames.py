"""Instruction counts (valgrind callgrind "Ir") per record of the record frame check's three
readers, per source tree: the read fast path (`segments.record.decode_run`), the recovery
fast path (`scan_run`) and the one-record check (`check_frame`, the walk, verify and resync).

    PYTHONPATH=$PWD python -m bench.callgrind_frames 4 old=/tmp/old-tree new=$PWD
    HEADERS=1 PYTHONPATH=$PWD python -m bench.callgrind_frames 4 new=$PWD

In memory, no file I/O: 20,000 records (100-byte payloads, 4 topics, QoS 1; ``HEADERS=1``:
40 bytes of headers each, record format 2) are framed once, then each reader walks them all
PASSES times.  Prints, per reader, Ir per record: the run with PASSES passes minus the run
with none (the framing cancels out).  ``PYTHONHASHSEED=0``; deterministic to a few hundred Ir.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

RECORDS = 20_000
READERS = ("decode_run", "scan_run", "check_frame")


def _load(passes: int, reader: str) -> None:
    from segments import record as framing

    headers = b"&\x00\x03key\x00\x05value" * 2 + b"\x03\x00\x0atext/plain" if os.environ.get("HEADERS") == "1" else b""
    topics = [t.encode() for t in ("sensors/a/temp", "sensors/b/temp", "sensors/c/hum", "sensors/d/hum")]
    payload = bytes(range(100))
    buf = b"".join(framing.encode(i, 1_700_000_000_000_000 + i, topics[i & 3], payload, 1, headers)
                   for i in range(RECORDS))
    end = len(buf)
    for _ in range(passes):
        if reader == "decode_run":
            out: list[framing.Record] = []
            stop = framing.decode_run(buf, 0, -1, 0, 1 << 62, out, RECORDS + 1, 1 << 40, 0)[0]
            assert len(out) == RECORDS
        elif reader == "scan_run":
            stop = framing.scan_run(buf, 0, end, 0, 0, [], 0, 4096, 0)[0]
        else:
            check, stop = framing.check_frame, 0
            while stop < end:
                stop += check(buf, stop, end)
        assert stop == end, (reader, stop, end)


def _ir(tree: Path, passes: int, reader: str) -> int:
    from bench.valgrind import callgrind_ir  # (the outer process only: see bench/valgrind.py)

    os.environ["READER"] = reader
    return callgrind_ir(__file__, tree, passes)


def main() -> None:
    if sys.argv[1] == "--inner":
        sys.path.insert(0, os.environ["PYTHONPATH"])
        _load(int(sys.argv[2]), os.environ["READER"])
        return
    passes = int(sys.argv[1])
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        for reader in READERS:
            loaded, idle = _ir(Path(path), passes, reader), _ir(Path(path), 0, reader)
            print(f"{name} {reader} headers={os.environ.get('HEADERS', '0')} passes={passes} "
                  f"per record={(loaded - idle) / (passes * RECORDS):,.1f}", flush=True)


if __name__ == "__main__":
    main()
