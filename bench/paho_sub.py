"""A fanout subscriber built on paho-mqtt 2.x: an ordinary client, not our bulk one.

``filemq bench broker --subscriber-client paho`` (issue 16): the held-out clients that judge
the broker's CPU per delivery are ordinary clients, not :mod:`bench.loadgen`'s bulk subscriber
(one ``recv``, all PUBACKs in one ``sendall``).  A paho client answers each QoS 1 PUBLISH with
its own PUBACK after ``on_message``, so the broker sees many small reads, one PUBACK each.

:func:`paho_subscriber_main` is a drop-in process body for :func:`bench.loadgen.run_load`
(``SubscriberSpec(client="paho")``): persistent session (clean session 0), QoS 1 on the spec's
filter, ``loop_start`` (paho's network thread), ``on_message`` counts.  It stops like the
loadgen subscriber: once it has the publishers' acked total, or ``idle_seconds`` without a
message once that total is known, or at ``max_seconds``; it always reports one
:class:`bench.loadspec.SubscriberResult`.

paho-mqtt is a dev extra: :func:`require_paho` raises :class:`PahoMissing` (naming
``pip install paho-mqtt``) when it is not importable.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as MpEvent
from typing import TYPE_CHECKING, Any

from bench.loadspec import SubscriberResult, SubscriberSpec
from filemq.mqtt.packets import PROTOCOL_LEVEL

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt

_POLL_S = 0.05  # how often the main thread looks at the shared expected count
_SUBSCRIBE_TIMEOUT_S = 30.0


class PahoMissing(RuntimeError):
    """paho-mqtt is not importable in this interpreter."""


def require_paho() -> None:
    """Raise :class:`PahoMissing` unless ``paho.mqtt.client`` (2.x) imports."""
    try:
        import paho.mqtt.client  # noqa: F401
    except ImportError as exc:
        raise PahoMissing("--subscriber-client paho needs paho-mqtt 2.x (a dev extra): "
                          "pip install paho-mqtt") from exc
    try:
        import paho.mqtt.enums  # noqa: F401  (2.x only)
    except ImportError as exc:
        raise PahoMissing("--subscriber-client paho needs paho-mqtt 2.x, found an older one: "
                          "pip install -U paho-mqtt") from exc


class _Counter:
    """What paho's network thread reports to the process's main thread."""

    def __init__(self, topic_filter: str, qos: int) -> None:
        self.filter = topic_filter
        self.qos = qos
        self.received = 0
        self.first = 0.0
        self.last = 0.0
        self.error: str | None = None
        self.connack_code: int | None = None
        self.subscribed = threading.Event()

    def on_connect(self, client: mqtt.Client, _userdata: Any, _flags: Any, reason: Any, _props: Any) -> None:
        if reason.is_failure:
            self.error = f"CONNECT refused: {reason}"
            self.connack_code = int(reason.value)
            self.subscribed.set()
            return
        client.subscribe(self.filter, self.qos)

    def on_subscribe(self, _client: mqtt.Client, _userdata: Any, _mid: int, reasons: list[Any],
                     _props: Any) -> None:
        if not reasons or reasons[0].is_failure:
            self.error = f"subscription to {self.filter!r} refused ({reasons[0] if reasons else 'no code'})"
        self.subscribed.set()

    def on_message(self, _client: mqtt.Client, _userdata: Any, _message: Any) -> None:
        now = time.monotonic()
        self.first = self.first or now
        self.last = now
        self.received += 1


def paho_subscriber_main(spec: SubscriberSpec, ready: MpEvent, expected: Synchronized[int], out: Any) -> None:
    """Process body (the paho twin of :func:`bench.loadgen.subscriber_main`)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    result = SubscriberResult(spec.client_id)
    counter = _Counter(spec.topic_filter, spec.qos)
    if spec.protocol != PROTOCOL_LEVEL:
        result.error = "the paho subscriber speaks MQTT 3.1.1 only"
        out.put(result)
        ready.set()
        return
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=spec.client_id,
                         clean_session=spec.clean_session, protocol=mqtt.MQTTv311)
    client.on_connect = counter.on_connect
    client.on_subscribe = counter.on_subscribe
    client.on_message = counter.on_message
    started = False
    try:
        client.connect(spec.host, spec.port, keepalive=600)
        client.loop_start()
        started = True
        if not counter.subscribed.wait(_SUBSCRIBE_TIMEOUT_S):
            counter.error = f"not subscribed within {_SUBSCRIBE_TIMEOUT_S:.0f} s"
        ready.set()
        if counter.error is None:
            _wait_until_done(spec, expected, counter)
    except OSError as exc:
        counter.error = f"{type(exc).__name__}: {exc}"
    finally:
        ready.set()
        if started:
            client.disconnect()
            client.loop_stop()
        result.received, result.first, result.last = counter.received, counter.first, counter.last
        result.error, result.connack_code = counter.error, counter.connack_code
        out.put(result)


def _wait_until_done(spec: SubscriberSpec, expected: Synchronized[int], counter: _Counter) -> None:
    """The loadgen subscriber's stop rules: the acked total, an idle spell once it is known,
    or ``max_seconds``."""
    deadline = time.monotonic() + spec.max_seconds
    seen = counter.received
    last_change = time.monotonic()
    while True:
        now = time.monotonic()
        want = expected.value
        if 0 <= want <= counter.received or now > deadline:
            return
        if counter.received != seen:
            seen, last_change = counter.received, now
        elif want >= 0 and now - last_change > spec.idle_seconds:
            return
        time.sleep(_POLL_S)  # `expected` is a shared counter: nothing to wait on but time
