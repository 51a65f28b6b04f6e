"""The MQTT 5 side of the broker test harness (tests/broker_harness.py): fake MQTT 5 clients
and a queue that keeps each record's headers (the message properties).

:class:`Client5` is one fake MQTT 5 connection (:func:`client5` makes one on a harness);
:class:`Harness5` runs the core over :class:`FakeQueue5`, which stores the records' headers and
can refuse the next append; :func:`publishes` is what a client got that is a PUBLISH;
:func:`append_old_record` appends a record of a given age with a Message Expiry Interval.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from filemq.mqtt.codec import Decoder, encode5
from filemq.mqtt.packets import Connack, Properties, Publish, Suback, Subscribe
from filemq.mqtt.properties import encode_message_headers
from tests.broker_harness import Client, FakeQueue, Harness

# ---- MQTT 5 clients ---------------------------------------------------------------------------


class Client5(Client):
    """A fake MQTT 5 client: encodes with encode5, decodes the broker's MQTT 5 packets."""

    def __init__(self, h: Any, peer: str) -> None:
        super().__init__(h, peer)
        self._decoder = Decoder(server=False, protocol_level=5)

    def send(self, *packets: Any) -> None:
        self.feed(b"".join(encode5(p) for p in packets))
        self.h.core.flush()

    def connect(self, client_id: str, clean: bool = True, **kw: Any) -> Connack:
        kw.setdefault("protocol_level", 5)
        return super().connect(client_id, clean, **kw)


def client5(h: Harness) -> Client5:
    h._n += 1
    return Client5(h, f"{h.peer_prefix}{1000 + h._n}")


# ---- a queue that keeps the headers, and its harness ------------------------------------------


class FakeQueue5(FakeQueue):
    """:class:`FakeQueue` that stores headers and can refuse the next append."""

    def __init__(self, groups_dir: Path) -> None:
        super().__init__(groups_dir)
        self.refuse_next: OSError | None = None

    def publish_nowait(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                       timestamp_us: int | None = None, *, validated: bool = False,
                       headers: bytes = b"") -> tuple[int, asyncio.Future[None]]:
        if self.refuse_next is not None:
            exc, self.refuse_next = self.refuse_next, None
            raise exc
        offset, fut = super().publish_nowait(topic, payload, qos, retain, timestamp_us)
        self.log.records[offset] = self.log.records[offset]._replace(headers=headers)
        return offset, fut


class Harness5(Harness):
    queue: FakeQueue5

    def __init__(self, tmp: Path, **broker: Any) -> None:
        super().__init__(tmp, **broker)
        self.queue = FakeQueue5(tmp / "groups")
        self.core = self.make_core()

    def sub5(self, client_id: str, *topics: tuple[str, int], props: Properties | None = None,
             clean: bool = True, **kw: Any) -> Client5:
        c = client5(self)
        c.connect(client_id, clean, **kw)
        c.send(Subscribe(1, list(topics), props))
        out = c.received()
        assert isinstance(out[0], Suback), out
        c._left = out[1:]
        return c


def publishes(c: Any) -> list[Publish]:
    return [p for p in c.received() if isinstance(p, Publish)]


def append_old_record(h: Harness5, topic: str, payload: bytes, qos: int, age_s: float, expiry: int,
                      retain: bool = False) -> None:
    """Append (through the queue, as another writer would) a record ``age_s`` old."""
    ts = time.time_ns() // 1000 - int(age_s * 1_000_000)
    h.queue.publish_nowait(topic, payload, qos, retain, ts,
                           headers=encode_message_headers(Properties(message_expiry_interval=expiry)))
