"""Profile `filemq broker` under the `filemq bench broker` ingest or fanout load (issue 16).

    PYTHONPATH=$PWD python -m bench.profile_broker ingest  /tmp/ingest.txt  [messages]
    PYTHONPATH=$PWD python -m bench.profile_broker fanout  /tmp/fanout.txt  [messages]
    PYTHONPATH=$PWD python -m bench.profile_broker summary /tmp/fanout.txt

The first two start a broker (``fsync = "always"``, fresh data dir), attach ``py-spy record
--threads --format raw --nonblocking`` (``pip install py-spy``) and run the same load as the
bench scenario (4 publishers x 100 in flight, 100-byte QoS 1; fanout adds 10 persistent QoS 1
subscribers), then print the broker's CPU per message (PUBACK or delivery). ``summary``
prints the share of samples per thread, per leaf function and per filemq function
(inclusive) of a raw profile.  ``PROTOCOL=5`` runs the load with MQTT 5 clients and
``V5_PROPERTIES=1`` adds a content type and a user property to every PUBLISH (issue 13);
``SUBSCRIBER_CLIENT=single|nagle|paho`` and ``MAX_INFLIGHT=N`` are the bench's ``--subscriber-client``
and ``--max-inflight``.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.brokers import BrokerBenchOptions, start_filemq
from bench.harness.loads import V5_PROPERTIES, fanout_run, ingest_run

PY_SPY = str(Path(sys.executable).with_name("py-spy"))


def record(scenario: str, out: str, messages: int | None) -> str:
    """Run the load under py-spy; returns one line with the broker's CPU per message."""
    window = int(os.environ["MAX_INFLIGHT"]) if os.environ.get("MAX_INFLIGHT") else None
    opts = BrokerBenchOptions(max_seconds=10, subscriber_client=os.environ.get("SUBSCRIBER_CLIENT", "loadgen"),
                              max_inflight=window)
    protocol = int(os.environ.get("PROTOCOL", "4"))
    props = V5_PROPERTIES if protocol == 5 and os.environ.get("V5_PROPERTIES") == "1" else None
    with (tempfile.TemporaryDirectory(prefix="filemq-profile-") as d,
          start_filemq(Path(d) / "data", max_inflight=window) as broker):
        spy = subprocess.Popen([PY_SPY, "record", "--pid", str(broker.pid), "--rate", os.environ.get("PYSPY_RATE", "250"), "--threads",
                                "--format", "raw", "--nonblocking", "-o", out],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attached
        cpu0 = broker.cpu_seconds()
        if scenario == "ingest":
            result = ingest_run(broker, opts, messages or 400_000, "bench/ingest", protocol=protocol,
                                 properties=props)
            n = result.acked
        else:
            result = fanout_run(broker, opts, messages or 40_000, protocol=protocol, properties=props)
            n = result.delivered
        cpu = broker.cpu_seconds() - cpu0
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    return f"{scenario}: {n:,} messages, broker CPU {1e6 * cpu / max(n, 1):.1f} us/msg {result.errors[:2]}"


def summary(path: str, top: int = 25) -> str:
    """Shares of a raw py-spy profile: threads, leaf functions, filemq/segments functions (inclusive)."""
    leaf: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        threads[re.sub(r" \(\d+\)", "", frames[0])] += n
        funcs = [re.sub(r":\d+\)", ")", f) for f in frames[1:]] or frames[:1]
        leaf[funcs[-1]] += n
        for f in set(funcs):
            incl[f] += n
    lines = [f"{total} samples"] + [f"  {100 * n / total:5.1f}%  {t}" for t, n in threads.most_common()]
    lines += ["leaf functions:"] + [f"  {100 * n / total:5.1f}%  {f}" for f, n in leaf.most_common(top)]
    lines += ["inclusive (filemq, segments):"] + [
        f"  {100 * n / total:5.1f}%  {f}" for f, n in incl.most_common()
        if ("filemq/" in f or "segments/" in f) and "broker_app" not in f and "service.py" not in f][:top]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "summary":
        sys.stdout.write(summary(argv[1]) + "\n")
    elif len(argv) >= 2 and argv[0] in ("ingest", "fanout"):
        sys.stdout.write(record(argv[0], argv[1], int(argv[2]) if len(argv) > 2 else None) + "\n")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
