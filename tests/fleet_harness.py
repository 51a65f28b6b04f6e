"""Inputs of the collector's fleet registry in the tests: a fake device connection, an agent's
health report and a small batch (tests/test_fleet_*.py)."""

from __future__ import annotations

from typing import Any

from filemq.upstream.batch import BatchRecord, encode_batch


class Conn:
    """A device's connection as the registry sees it: its peer, closed or not and why."""

    def __init__(self, peer: str = "10.9.9.9:1") -> None:
        self.closed = False
        self.close_reason = ""
        self.peer = peer


def health(lag: int = 5, age: float = 1.0, free: int = 10**10, interval: int = 30) -> dict[str, Any]:
    """An agent's health report: one export ``collector`` with ``lag`` records behind."""
    return {"interval_s": interval, "disk_free_bytes": free, "agent_version": "0.1.0",
            "exports": [{"name": "collector", "state": "connected", "lag_records": lag, "lag_bytes": lag * 100,
                         "oldest_unacked_age_s": age}]}


def batch(first: int, n: int, device: str = "dev-1") -> bytes:
    """A batch of ``n`` one-byte records of ``device`` from offset ``first``."""
    return encode_batch(device, "main", [BatchRecord(first + i, 1, "t", b"x", 1) for i in range(n)])
