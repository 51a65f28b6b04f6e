"""A flooding client for tests/test_fairness.py (issue 30 findings 3 and 4), run as its own
process: ``python -m tests.flood MODE PORT SECONDS``.  Bounded: it stops after SECONDS.

* ``publish``: pipelines 1 MB QoS 0 PUBLISHes as fast as the socket takes them, never
  waiting (finding 3);
* ``qos1``: the same at QoS 1, reading (and dropping) the PUBACKs without waiting for them;
* ``pingreq``: streams PINGREQs in 64 KiB writes and reads the PINGRESPs (finding 4).

Prints the bytes it sent."""

from __future__ import annotations

import socket
import sys
import threading
import time

from filemq.mqtt.codec import encode
from filemq.mqtt.packets import Connect, Pingreq, Publish


def flood(mode: str, port: int, seconds: float) -> int:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(encode(Connect(client_id=f"flood-{mode}", keepalive=0)))
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
