"""A flooding client for tests/test_fairness.py (issue 30 findings 3 and 4), run as its own
process: ``python -m tests.flood MODE PORT SECONDS``.  Bounded: it stops after SECONDS.

* ``publish``: pipelines 1 MB QoS 0 PUBLISHes as fast as the socket takes them, never
  waiting (finding 3);
* ``qos1``: the same at QoS 1, reading (and dropping) the PUBACKs without waiting for them;
* ``pingreq``: streams PINGREQs in 64 KiB writes and reads the PINGRESPs (finding 4);
* ``ws-pingreq``: the same over a WebSocket listener (RFC 6455 handshake with the ``mqtt``
  subprotocol, then masked binary frames of 64 KiB of PINGREQs each).

Prints the bytes it sent."""

from __future__ import annotations

import base64
import os
import socket
import struct
import sys
import threading
import time

from filemq.mqtt.codec import encode
from filemq.mqtt.packets import Connect, Pingreq, Publish


def ws_frame(payload: bytes, mask: bytes) -> bytes:
    """One masked binary WebSocket frame (RFC 6455 5.2; a client must mask, 5.3)."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x82, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x82, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x82, 0x80 | 127, n)
    key = (mask * (n // 4 + 1))[:n]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")
    return head + mask + masked


def ws_open(port: int) -> socket.socket:
    """A WebSocket connection with the ``mqtt`` subprotocol (MQTT-6.0.0-3, -4)."""
    s = socket.create_connection(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
               "Sec-WebSocket-Protocol: mqtt\r\n\r\n").encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = s.recv(4096)
        if not data:
            raise ConnectionError("the WebSocket upgrade was refused")
        answer += data
    if not answer.startswith(b"HTTP/1.1 101"):
        raise ConnectionError(f"the WebSocket upgrade was refused: {answer[:80]!r}")
    return s


def flood(mode: str, port: int, seconds: float) -> int:
    websocket = mode.startswith("ws-")
    mask = b"\x12\x34\x56\x78"
    s = ws_open(port) if websocket else socket.create_connection(("127.0.0.1", port))
    connect = encode(Connect(client_id=f"flood-{mode}", keepalive=0))
    s.sendall(ws_frame(connect, mask) if websocket else connect)
    stop = threading.Event()

    def drain() -> None:  # read every answer, so only our input can back up
        s.settimeout(0.5)
        while not stop.is_set():
            try:
                if not s.recv(1 << 20):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    if mode == "pingreq":
        chunk = encode(Pingreq()) * 32768
    elif mode == "ws-pingreq":
        chunk = ws_frame(encode(Pingreq()) * 32768, mask)
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
