"""Debian mosquitto as an upstream broker for export tests, plus an oracle subscriber there.

:class:`Mosquitto` runs ``/usr/sbin/mosquitto`` on a free loopback port with persistence in a
temporary directory (so a restart keeps sessions and queued messages) and unlimited queues.
:class:`Oracle` is a persistent QoS 2 subscriber on it that reconnects by itself: what it has
received is what arrived upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

from filemq.broker.server import free_port
from filemq.mqtt.client import MQTTClient
from filemq.mqtt.packets import Publish

MOSQUITTO = "/usr/sbin/mosquitto"
MOSQUITTO_PASSWD = "mosquitto_passwd"


def available() -> bool:
    return os.access(MOSQUITTO, os.X_OK)


class Mosquitto:
    def __init__(self, work: Path, port: int = 0, *, password: tuple[str, str] | None = None) -> None:
        self.work = work
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        work.mkdir(parents=True, exist_ok=True)
        self.passwd = work / "passwd"
        auth = "allow_anonymous true\n"
        if password is not None:
            self.set_password(*password)
            auth = f"allow_anonymous false\npassword_file {self.passwd}\n"
        self.conf = work / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n{auth}user root\nmax_queued_messages 0\nmax_queued_bytes 0\n"
            f"max_inflight_messages 0\npersistence true\npersistence_location {work}/\nautosave_interval 0\n"
            f"log_dest file {work}/mosquitto.log\n"
        )

    def set_password(self, user: str, password: str) -> None:
        """The password file with this one user (created anew)."""
        subprocess.run([MOSQUITTO_PASSWD, "-b", "-c", str(self.passwd), user, password], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def add_user(self, user: str, password: str) -> None:
        """Add ``user`` to the password file, or change its password; the others stay
        (a running broker reads it again at :meth:`reload`)."""
        subprocess.run([MOSQUITTO_PASSWD, "-b", str(self.passwd), user, password], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self, timeout: float = 10.0) -> None:
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        import socket

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}; see {self.work}/mosquitto.log")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.05)
        raise TimeoutError("mosquitto did not start listening")

    def reload(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        """SIGTERM: mosquitto saves its store (sessions, queued messages) and exits."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


class Oracle:
    """A persistent subscriber upstream; ``payloads`` counts what arrived."""

    def __init__(self, port: int, topics: str = "#", client_id: str = "oracle") -> None:
        self.port = port
        self.topics = topics
        self.client_id = client_id
        self.payloads: Counter[bytes] = Counter()
        self.messages: list[Publish] = []
        self.changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    def _on_message(self, message: Publish) -> None:
        self.payloads[message.payload] += 1
        self.messages.append(message)
        self.changed.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        async with asyncio.timeout(10):
            await self._subscribed.wait()

    async def _run(self) -> None:
        while True:
            client = MQTTClient(self.client_id, "127.0.0.1", self.port, clean_session=False,
                                on_message=self._on_message, keepalive=10)
            try:
                await client.connect(timeout=2)
                if not self._subscribed.is_set():
                    await client.subscribe([(self.topics, 2)])
                    self._subscribed.set()
                await client.closed.wait()
            except (OSError, TimeoutError, ConnectionError):
                pass
            except Exception:  # a refused or dropped connection during a restart: try again
                pass
            finally:
                with contextlib.suppress(Exception):
                    await client.disconnect(timeout=0.5)
            await asyncio.sleep(0.1)

    async def wait_for(self, expected: set[bytes], timeout: float) -> None:
        """Until every payload of ``expected`` arrived (TimeoutError naming how many are missing)."""
        try:
            async with asyncio.timeout(timeout):
                while not expected <= self.payloads.keys():
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            missing = len(expected - self.payloads.keys())
            raise TimeoutError(f"{missing} of {len(expected)} messages never arrived upstream") from None

    async def wait_count(self, n: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while len(self.payloads) < n:
                self.changed.clear()
                await self.changed.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
