"""The device-to-collector pipeline in the tests: real ``filemq`` processes and in-process agents,
publishers on the agent's broker, and bounded waits.

:func:`agent_config` is an agent's config for the export tests (no collector unless a key says
so; extra exports in TOML); :func:`publish_local` publishes to the agent's broker and returns
what it acknowledged; :class:`Publishers` keep publishing through restarts and hold what was
PUBACKed (the oracle). :func:`run` runs a scenario bounded at 100 s, :func:`until` waits for a
condition (30 s, then prints where every task is stuck). :func:`start_process` starts
``filemq <args>`` and waits for its ready line; :func:`kill9`, :func:`terminate` and
:func:`kill_leftovers` end them. (tests/collector_harness.py has the in-process collector's.)
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from filemq.common.config import Config, load_config
from filemq.mqtt.client import MQTTClient
from tests import loops
from tests.tcpproxy import TcpProxy

REPO = Path(__file__).resolve().parent.parent
DEVICE = "dev-1"

# ---- configs and publishers -------------------------------------------------------------------


def agent_config(tmp: Path, toml: str = "", /, **extra: Any) -> Config:
    values: dict[str, Any] = {
        "data_dir": str(tmp / "agent"),
        "broker.port": 0,
        "broker.sys_interval_s": 1,
        "agent.device_id": DEVICE,
        "agent.backoff_initial_ms": 20,
        "agent.backoff_max_ms": 200,
        "log.fsync": "never",
        "log.min_free_bytes": 0,
    }
    values.update(extra)
    path = None
    if toml:
        path = tmp / "agent.toml"
        path.write_text(toml)
    return load_config(path, values)


async def publish_local(port: int, n: int, topic: str = "sensors/t", prefix: str = "m", qos: int = 1) -> list[bytes]:
    """Publish ``n`` messages to the agent's broker; the payloads it PUBACKed, in order."""
    client = MQTTClient(f"pub-{prefix}", port=port, max_inflight=100)
    await client.connect()
    payloads = [f"{prefix}-{i}".encode() for i in range(n)]
    futures = [client.publish_nowait(topic, p, qos=qos) for p in payloads]
    await asyncio.gather(*futures)
    await client.disconnect()
    return payloads


class Publishers:
    """``count`` MQTT clients publishing unique payloads; ``acked`` holds what was PUBACKed."""

    def __init__(self, port_of: Callable[[], int], count: int = 3, prefix: str = "m") -> None:
        self.port_of = port_of
        self.count = count
        self.prefix = prefix
        self.acked: set[bytes] = set()
        self.sent = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, messages_each: int | None, rate_pause: float = 0.0) -> None:
        for i in range(self.count):
            self._tasks.append(asyncio.create_task(self._run(i, messages_each, rate_pause)))

    async def _run(self, index: int, limit: int | None, pause: float) -> None:
        seq = 0
        while not self._stop.is_set() and (limit is None or seq < limit):
            client = MQTTClient(f"pub-{self.prefix}-{index}", port=self.port_of(), max_inflight=50)
            try:
                await client.connect(timeout=2)
            except Exception:  # the agent is down (being restarted): try again
                await asyncio.sleep(0.1)
                continue
            try:
                while not self._stop.is_set() and (limit is None or seq < limit):
                    futures = []
                    for _ in range(20):
                        if limit is not None and seq >= limit:
                            break
                        payload = f"{self.prefix}-{index}-{seq}".encode()
                        seq += 1
                        self.sent += 1
                        futures.append((payload, client.publish_nowait(f"sensors/{index}", payload, qos=1)))
                    # A new client after each reconnect: what was not PUBACKed is simply not
                    # in the oracle (it may or may not have been stored).
                    closed = asyncio.ensure_future(client.closed.wait())
                    all_acked = asyncio.ensure_future(asyncio.wait([f for _, f in futures]))
                    await asyncio.wait([all_acked, closed], timeout=5, return_when=asyncio.FIRST_COMPLETED)
                    closed.cancel()
                    all_acked.cancel()
                    for payload, future in futures:
                        if future.done() and not future.cancelled() and future.exception() is None:
                            self.acked.add(payload)
                    if pause:
                        await asyncio.sleep(pause)
                    if client.closed.is_set():
                        break
            finally:
                with contextlib.suppress(Exception):
                    await client.disconnect(timeout=1)

    async def wait(self) -> None:
        await asyncio.gather(*self._tasks)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def publish_through_cuts(pubs: Publishers, proxy: TcpProxy, rng: random.Random, *, cuts: int,
                               messages: int, cut_bytes: tuple[int, int], timeout: float = 60) -> None:
    """Keep ``pubs`` publishing (started with no message limit) until ``proxy`` has cut its
    connections ``cuts`` times and ``messages`` were sent, however fast the machine is (at
    most ``timeout`` s), then stop them.  A cut is armed at a random byte
    (``rng.randrange(*cut_bytes)`` more bytes upstream) only once the one before has happened,
    so each falls where its draw says (re-arming would push it on); none after the last."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (proxy.cuts < cuts or pubs.sent < messages) and loop.time() < deadline:
        if proxy.cuts < cuts and not proxy.cut_armed:
            proxy.cut_after(rng.randrange(*cut_bytes))
        await asyncio.sleep(0.02)
    proxy.cut_after(1 << 60)  # disarm
    await pubs.stop()


# ---- bounded waits ----------------------------------------------------------------------------


def run(coro: Coroutine[Any, Any, None], timeout: float = 100) -> None:
    """A pipeline scenario, bounded at ``timeout`` s (:func:`tests.loops.run`)."""
    loops.run(coro, timeout)


async def until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "", poll: float = 0.05) -> None:
    """Wait until ``predicate()``, looked at every ``poll`` s for up to ``timeout`` s; at the
    timeout, print where every task is stuck and fail (AssertionError naming ``what``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            # Where every task is stuck, for whoever reads the failure.
            stacks = io.StringIO()
            for task in asyncio.all_tasks():
                task.print_stack(file=stacks)
            print("asyncio tasks at the timeout:\n" + stacks.getvalue())
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(poll)


# ---- real processes ---------------------------------------------------------------------------


async def start_process(
    args: list[str], ready_word: str, started: list[asyncio.subprocess.Process]
) -> asyncio.subprocess.Process:
    """Start ``filemq <args>`` and wait for its ready line; it is added to ``started``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cli", *args, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )
    started.append(proc)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    assert ready_word in line.decode(), f"unexpected first line {line!r}"
    return proc


async def kill_leftovers(started: list[asyncio.subprocess.Process]) -> None:
    """A failed test must not leave its processes running."""
    for proc in started:
        if proc.returncode is None:
            await kill9(proc)


async def kill9(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    await asyncio.wait_for(proc.wait(), 10)


async def terminate(proc: asyncio.subprocess.Process) -> int:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), 20)
