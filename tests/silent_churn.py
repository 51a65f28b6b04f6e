"""An attacker for tests/test_admission.py: ``python -m tests.silent_churn PORT N SECONDS [HOST]``
keeps N TCP connections to PORT open that never send a byte, and re-opens each one as soon
as the server closes it (finding 2 of issue 30).  Prints how many sockets it opened.
Bounded: it stops after SECONDS."""

from __future__ import annotations

import errno
import selectors
import socket
import sys
import time


def churn(port: int, n: int, seconds: float, host: str = "127.0.0.1") -> int:
    sel = selectors.DefaultSelector()
    opened = 0

    def open_one() -> None:
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        err = s.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return
        opened += 1
        sel.register(s, selectors.EVENT_READ)

    for _ in range(n):
        open_one()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, _ in sel.select(0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # closed (or reset) by the server: at once a new one
                sel.unregister(s)
                s.close()
                open_one()
        missing = n - len(sel.get_map())
        for _ in range(missing):
            open_one()
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return opened


if __name__ == "__main__":
    host = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
    print(churn(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), host), flush=True)
