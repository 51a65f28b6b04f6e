"""A flooding client for tests/test_fairness.py (issue 30 findings 3 and 4), run as its own
process: ``python -m tests.flood MODE PORT SECONDS``.  Bounded: it stops after SECONDS.

* ``publish``: pipelines 1 MB QoS 0 PUBLISHes as fast as the socket takes them, never
  waiting (finding 3);
* ``qos1``: the same at QoS 1, reading (and dropping) the PUBACKs without waiting for them;
* ``qos1-v5``: the same over MQTT 5, keeping at most the CONNACK's Receive Maximum of
  PUBLISHes unacknowledged (MQTT-3.3.4-7: a client must not send more);
* ``pingreq``: streams PINGREQs in 64 KiB writes and reads the PINGRESPs (finding 4);
* ``ws-pingreq``: the same over a WebSocket listener (wsproto's client handshake with the
  ``mqtt`` subprotocol, then masked binary frames of 64 KiB of PINGREQs each).

Prints the bytes it sent."""

from __future__ import annotations

import socket
import sys
import threading
import time

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Request

from filemq.mqtt.codec import Decoder, encode, encode5
from filemq.mqtt.packets import Connack, Connect, Pingreq, Puback, Publish


def ws_open(port: int) -> tuple[socket.socket, WSConnection]:
    """A WebSocket connection with the ``mqtt`` subprotocol (MQTT-6.0.0-3, -4), opened with
    wsproto (the library the broker's WebSocket listener uses), as a client."""
    s = socket.create_connection(("127.0.0.1", port))
    ws = WSConnection(ConnectionType.CLIENT)
    s.sendall(ws.send(Request(host=f"127.0.0.1:{port}", target="/mqtt", subprotocols=["mqtt"])))
    while True:
        data = s.recv(4096)
        if not data:
            raise ConnectionError("the WebSocket upgrade was refused (connection closed)")
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                return s, ws
            raise ConnectionError(f"the WebSocket upgrade was refused: {event!r}")


def flood(mode: str, port: int, seconds: float) -> int:
    ws: WSConnection | None = None
    if mode.startswith("ws-"):
        s, ws = ws_open(port)
    else:
        s = socket.create_connection(("127.0.0.1", port))
    v5 = mode.endswith("-v5")
    if v5:
        connect = encode5(Connect(client_id=f"flood-{mode}", keepalive=0, protocol_level=5))
    else:
        connect = encode(Connect(client_id=f"flood-{mode}", keepalive=0))
    s.sendall(connect if ws is None else ws.send(BytesMessage(data=connect)))
    stop = threading.Event()
    window = threading.Semaphore(0)  # qos1-v5: PUBLISHes we may still send unacknowledged
    connacked = threading.Event()
    decoder = Decoder(1 << 20, server=False, protocol_level=5)

    def drain() -> None:  # read every answer, so only our input can back up
        s.settimeout(0.5)
        while not stop.is_set():
            try:
                data = s.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            if v5:
                decoder.feed(data)
                for p in decoder.packets():
                    if isinstance(p, Connack):
                        rm = p.properties.receive_maximum if p.properties is not None else None
                        window.release(65535 if rm is None else rm)  # 3.2.2.3.3: absent = 65535
                        connacked.set()
                    elif isinstance(p, Puback):
                        window.release()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    if mode == "pingreq":
        chunk = encode(Pingreq()) * 32768
    elif mode == "ws-pingreq":
        assert ws is not None  # one masked frame, sent again and again (the broker unmasks each)
        chunk = ws.send(BytesMessage(data=encode(Pingreq()) * 32768))
    elif mode == "publish":
        chunk = encode(Publish(topic="flood/big", payload=b"x" * 1_000_000, qos=0))
    else:
        chunk = b""
    sent = 0
    pid = 0
    end = time.monotonic() + seconds
    s.settimeout(1.0)
    try:
        while time.monotonic() < end:
            if mode == "qos1":
                pid = pid % 65535 + 1
                chunk = encode(Publish(topic="flood/big", payload=b"x" * 1_000_000, qos=1, packet_id=pid))
            elif mode == "qos1-v5":
                if not window.acquire(timeout=0.5):
                    continue
                pid = pid % 65535 + 1
                chunk = encode5(Publish(topic="flood/big", payload=b"x" * 1_000_000, qos=1, packet_id=pid))
            try:
                s.sendall(chunk)
            except TimeoutError:
                continue
            sent += len(chunk)
    except OSError:
        pass
    stop.set()
    s.close()
    return sent


if __name__ == "__main__":
    print(flood(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])), flush=True)
