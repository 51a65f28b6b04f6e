"""A paho-mqtt 2.x MQTT 5 client for the tests (an independent MQTT 5 implementation), on its
own network thread: messages, PUBACK reason codes and SUBACKs into queues, every wait bounded.
The test is skipped where paho-mqtt is not installed."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

paho = pytest.importorskip("paho.mqtt.client", reason="paho-mqtt is not installed")
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties as PahoProperties  # noqa: E402
from paho.mqtt.subscribeoptions import SubscribeOptions  # noqa: E402


def paho_props(packet_type: int) -> PahoProperties:
    return PahoProperties(packet_type)


class Paho5:
    """A paho MQTT 5 client in its own network thread; messages and PUBACK reason codes into queues."""

    def __init__(self, port: int, client_id: str, *, clean: bool = True, expiry: int | None = None) -> None:
        self.messages: queue.Queue[Any] = queue.Queue()
        self.acks: queue.Queue[tuple[int, int]] = queue.Queue()
        self.subacks: queue.Queue[list[int]] = queue.Queue()
        self.connected = threading.Event()
        c = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id,
                        protocol=paho.MQTTv5)
        c.on_message = lambda _c, _u, m: self.messages.put(m)
        c.on_connect = lambda *a: self.connected.set()
        c.on_publish = lambda _c, _u, mid, rc, _p: self.acks.put((mid, rc.value))
        c.on_subscribe = lambda _c, _u, _mid, rcs, _p: self.subacks.put([rc.value for rc in rcs])
        props = None
        if expiry is not None:
            props = paho_props(PacketTypes.CONNECT)
            props.SessionExpiryInterval = expiry
        c.connect("127.0.0.1", port, clean_start=clean, properties=props)
        c.loop_start()
        assert self.connected.wait(10), "paho did not connect"
        self.c = c

    def subscribe(self, topic: str, options: SubscribeOptions, identifier: int | None = None) -> list[int]:
        props = None
        if identifier is not None:
            props = paho_props(PacketTypes.SUBSCRIBE)
            props.SubscriptionIdentifier = identifier
        self.c.subscribe(topic, options=options, properties=props)
        return self.subacks.get(timeout=10)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                props: PahoProperties | None = None) -> int:
        """Publish and return the PUBACK reason code (QoS 1) once it arrived."""
        info = self.c.publish(topic, payload, qos, retain, properties=props)
        mid, rc = self.acks.get(timeout=10)
        assert mid == info.mid
        return rc

    def get(self, timeout: float = 10) -> Any:
        return self.messages.get(timeout=timeout)

    def none_within(self, seconds: float) -> bool:
        try:
            self.messages.get(timeout=seconds)
        except queue.Empty:
            return True
        return False

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()
