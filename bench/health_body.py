"""The health report body the benches send for a simulated device (filemq.upstream.health).

Shaped as an agent's report with one export (docs/FORMAT.md "Health report"); ``seq`` moves
the counters, so consecutive reports differ as a device's do. Only the standard library: the
in-process instruction counts (bench/callgrind_health.py) copy it into the trees they measure.
"""

from __future__ import annotations

from typing import Any


def report_body(seq: int) -> dict[str, Any]:
    """The body of a simulated device's ``seq``-th report (about 400 bytes of JSON)."""
    return {"agent_version": "bench", "build": "pure", "uptime_s": 1.0 * seq, "interval_s": 30,
            "log_bytes": 10 << 20, "disk_free_bytes": 8 << 30, "clients_connected": 3,
            "messages_received": seq * 100, "messages_dropped": 0, "oversized_skipped": 0,
            "exports": [{"name": "collector", "kind": "filemq", "state": "connected", "lag_records": 1000 + seq,
                         "lag_bytes": 100_000, "oldest_unacked_age_s": 1.5, "records_acked": seq,
                         "lost_records": 0, "oversized_skipped": 0}]}
