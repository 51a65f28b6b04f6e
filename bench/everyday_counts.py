"""What one everyday message costs the broker in Python, counted (issue 29): instructions and
bytecodes per message when sensors trickle in, which machine load does not move.

    PYTHONHASHSEED=0 PYTHONPATH=$PWD python -m bench.everyday_counts callgrind name=/tree [...]
    PYTHONPATH=$PWD python -m bench.everyday_counts bytecodes name=/tree [...]

Each tree's `filemq broker` (default settings: durable, fsync always) runs twice for
``SECONDS`` (default 15): once under the `filemq bench broker --scenario everyday` load of 50
raw-socket sensors at ``RATE`` msg/s in all (default 20: every message arrives alone, as at a
device's 10-100 msg/s, but slow enough for valgrind), once with the sensors connected and
silent; the difference divided by the messages acknowledged is the cost of one message.

* ``callgrind``: valgrind callgrind's total instructions ("Ir", user space: the interpreter,
  uvloop, libc; no kernel) per message (``apt-get install valgrind``; ~50x slower).
* ``bytecodes``: Python bytecodes executed per message, per function and per module (an
  opcode tracer, ``sys.settrace`` with ``f_trace_opcodes``, in the broker's process; C code
  -- uvloop, the codec's ``struct`` calls -- counts as the one bytecode that calls it). Prints
  the 25 busiest modules and the 60 busiest functions.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.everyday import SensorLoad, run_sensors
from bench.harness.processes import LOOPBACK, free_port, spawn
from bench.valgrind import callgrind_prefix, callgrind_total

RATE = float(os.environ.get("RATE", "20"))
SECONDS = float(os.environ.get("SECONDS", "15"))
SENSORS = int(os.environ.get("SENSORS", "50"))

# Run as the broker's entry point in bytecodes mode: trace every opcode, dump counts at exit.
_TRACER = """
import atexit, collections, json, os, runpy, sys, threading
counts = collections.Counter()
def tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    if event == "opcode":
        c = frame.f_code
        counts[(c.co_filename, c.co_firstlineno, c.co_name)] += 1
    return tracer
def dump():
    sys.settrace(None)
    with open(os.environ["EVERYDAY_COUNTS_OUT"], "w") as f:
        json.dump([[k[0], k[1], k[2], v] for k, v in counts.items()], f)
atexit.register(dump)
sys.argv = sys.argv[1:]
sys.settrace(tracer)
threading.settrace(tracer)
runpy.run_path(sys.argv[0], run_name="__main__")
"""

Counts = dict[tuple[str, int, str], int]


def _run(mode: str, tree: Path, rate: float, work: Path) -> tuple[int, Counts, int]:
    """One broker run at ``rate``: (total Ir or 0, bytecode counts or {}, messages acked)."""
    port = free_port()
    out = work / ("cg.out" if mode == "callgrind" else "ops.json")
    broker_args = [str(tree / "cli.py"), "broker", "--data-dir", str(work / "data"),
                   "--host", LOOPBACK, "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    if mode == "callgrind":
        argv = [*callgrind_prefix(out), sys.executable, *broker_args]
        env["PYTHONMALLOC"] = "malloc"
    else:
        tracer = work / "tracer.py"
        tracer.write_text(_TRACER)
        argv = [sys.executable, str(tracer), *broker_args]
        env["EVERYDAY_COUNTS_OUT"] = str(out)
    broker = spawn(tree.name, argv, LOOPBACK, port, work / "broker.log", env=env, cwd=tree)
    try:
        broker.wait_ready(600)
        result = run_sensors(SensorLoad(LOOPBACK, port, sensors=SENSORS, rate=rate, seconds=SECONDS), broker)
        if result.errors:
            raise RuntimeError(f"{tree.name}: the sensors saw errors: {result.errors[:3]}")
    finally:
        broker.proc.send_signal(signal.SIGINT)
        broker.proc.wait(600)
    if mode == "callgrind":
        return callgrind_total(out), {}, result.acked
    counts = {(f, line, fn): v for f, line, fn, v in json.loads(out.read_text())}
    return 0, counts, result.acked


def _report_bytecodes(tree: Path, loaded: Counts, idle: Counts, n: int) -> None:
    per = {k: (v - idle.get(k, 0)) / n for k, v in loaded.items()}
    total = sum(per.values())
    print(f"  bytecodes per message: {total:,.0f}")
    modules: dict[str, float] = collections.defaultdict(float)
    for (f, _, _), v in per.items():
        modules[f.replace(f"{tree}/", "").split("/site-packages/")[-1]] += v
    for name, v in sorted(modules.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {v:8.0f}  {name}")
    for (f, line, fn), v in sorted(per.items(), key=lambda kv: -kv[1])[:60]:
        print(f"  {v:8.1f}  {fn}  {f.replace(f'{tree}/', '')}:{line}")


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ("callgrind", "bytecodes"):
        sys.exit(__doc__)
    mode = sys.argv[1]
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        tree = Path(path).resolve()
        t0 = time.time()
        runs = {}
        for rate in (RATE, 0.0):
            print(f"{name}: {mode} run at {rate:g} msg/s for {SECONDS:g} s ...", flush=True)
            with tempfile.TemporaryDirectory(prefix="everyday-counts-") as d:
                runs[rate] = _run(mode, tree, rate, Path(d))
        (ir1, c1, n), (ir0, c0, _) = runs[RATE], runs[0.0]
        if not n:
            sys.exit(f"{name}: no message was acknowledged")
        if mode == "callgrind":
            print(f"{name}: {n} messages at {RATE:g} msg/s: Ir {ir1:,} against {ir0:,} silent: "
                  f"{(ir1 - ir0) / n:,.0f} Ir per message ({time.time() - t0:.0f} s)", flush=True)
        else:
            print(f"{name}: {n} messages at {RATE:g} msg/s ({time.time() - t0:.0f} s)")
            _report_bytecodes(tree, c1, c0, n)


if __name__ == "__main__":
    main()
