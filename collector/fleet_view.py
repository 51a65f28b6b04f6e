"""What ``filemq fleet`` prints: a collector's ``/api/fleet`` fetched (:func:`fetch_fleet`) and
laid out as a table (:func:`fleet_table`), troubled devices first.

Only the standard library: it runs on an operator's machine without Arrow.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from collector.fleet import STATES


class FleetUnavailable(Exception):
    """The operations port could not be read (the message says why and where)."""


def fetch_fleet(url: str, *, username: str | None = None, password: str | None = None,
                cafile: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """GET ``<url>/api/fleet`` (``url`` the ops port's base, e.g. ``http://127.0.0.1:9100``)."""
    import base64
    import gzip
    import ssl
    import urllib.error
    import urllib.request

    target = url.rstrip("/") + "/api/fleet"
    req = urllib.request.Request(target, headers={"Accept": "application/json", "Accept-Encoding": "gzip"})
    if username is not None:
        token = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=cafile) if target.startswith("https:") else None
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            raw = resp.read()
            if resp.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            body = json.loads(raw)
    except urllib.error.HTTPError as exc:
        hint = " (give --username and --password-file)" if exc.code == 401 else ""
        raise FleetUnavailable(f"{target}: HTTP {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise FleetUnavailable(f"{target}: {getattr(exc, 'reason', exc)}") from None
    if not isinstance(body, dict) or not isinstance(body.get("devices"), list):
        raise FleetUnavailable(f"{target}: not a fleet answer")
    return body


def _age(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172_800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"  # pragma: no cover - the loop returns


def fleet_table(fleet: Mapping[str, Any], now: float | None = None) -> list[str]:
    """``/api/fleet`` as the lines ``filemq fleet`` prints: counts, then one row per device."""
    now = time.time() if now is None else now
    counts = fleet.get("counts") or {}
    head = ", ".join(f"{counts.get(s, 0)} {s}" for s in STATES)
    lines = [f"{counts.get('total', 0)} devices: {head}"]
    rows: list[tuple[str, ...]] = [("DEVICE", "STATE", "CONNECTED", "LAST SEEN", "LAG", "OLDEST", "DISK FREE",
                                    "REMOTE")]
    for d in sorted_devices(fleet.get("devices") or []):
        last = d.get("last_seen")
        ago = now - datetime.fromisoformat(last.replace("Z", "+00:00")).timestamp() if last else None
        lag = d.get("lag_records")
        rows.append((str(d.get("device_id")), str(d.get("state")), "yes" if d.get("connected") else "no",
                     _age(ago) + " ago" if ago is not None else "-", "-" if lag is None else str(lag),
                     _age(d.get("oldest_unacked_age_s")), _size(d.get("disk_free_bytes")), str(d.get("remote") or "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return lines


def sorted_devices(devices: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Offline and troubled devices first, then by id (the order ``filemq fleet`` prints)."""
    rank = {s: i for i, s in enumerate(("offline", "stale", "disk_low", "behind", "online"))}
    return sorted(devices, key=lambda d: (rank.get(str(d.get("state")), 9), str(d.get("device_id"))))
