"""CPU accounting for the benches: what a process (and its threads, helpers and reaped
children) used, read from /proc, and the per-message figures a result reports (the ratios
between contenders are :mod:`bench.throughput`'s).

With other load on a shared machine, CPU seconds per message say more about a broker's cost
than wall-clock rates; a result keeps every run's figure and reports the lowest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench.harness.summary import rnd
from bench.loadspec import LoadResult

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a running process has used, its threads included (not its
    children), from /proc; None where /proc cannot say (the process is gone, not Linux)."""
    try:
        fields = stat_fields(pid)
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """:func:`process_cpu_seconds`, 0.0 if unknown."""
    return process_cpu_seconds(pid) or 0.0


def cpu_user_system(pid: int) -> tuple[float, float]:
    """User and system CPU seconds a running process has used, its threads included (not its
    children), from /proc; zeros if unknown."""
    try:
        fields = stat_fields(pid)
        return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def stat_fields(pid: int) -> list[str]:
    """Fields 3.. of /proc/PID/stat (after the command name, which may hold spaces)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def proc_cpu_ticks_split(pid: int) -> tuple[int, int]:
    """(utime + cutime, stime + cstime) of ``pid`` (all threads, reaped children); 0s if gone."""
    try:
        fields = stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    return int(fields[11]) + int(fields[13]), int(fields[12]) + int(fields[14])


def descendants(pid: int) -> list[int]:
    """Live descendant processes of ``pid`` (children of any of its threads, recursively)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(stat_fields(int(entry.name))[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        parents.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def cpu_us(result: LoadResult, messages: int) -> float:
    """Broker CPU (user + system, all threads and helper processes) per message, in us, over
    the whole run; ``messages`` is PUBACKs for ingest, deliveries for fanout."""
    return 1e6 * (result.broker_cpu_seconds or 0.0) / messages if messages else float("inf")


def user_us(result: LoadResult, messages: int) -> float:
    """The user part of :func:`cpu_us` (the rest is system time: system calls)."""
    return 1e6 * (result.broker_user_seconds or 0.0) / messages if messages else float("inf")


def cpu_detail(result: LoadResult, messages: int, unit: str = "msg") -> str:
    """"4.8 us/msg: user 4.0, sys 0.8" for a progress line."""
    total, user = cpu_us(result, messages), user_us(result, messages)
    return f"{total:.1f} us/{unit}: user {user:.1f}, sys {total - user:.1f}"


def cpu_figures(out: dict[str, Any], name: str, results: list[LoadResult], counts: list[int]) -> None:
    """``{name}_cpu_us_per_msg`` (the lowest of the runs: like the best rate, the run least
    disturbed by foreign load) and every run's figure, and the user part of each run's
    (``{name}_runs_user_us_per_msg``; the rest of a run's figure is system time)."""
    per_run = [cpu_us(r, n) for r, n in zip(results, counts, strict=True)]
    out[f"{name}_runs_cpu_us_per_msg"] = [rnd(x, 2) for x in per_run]
    out[f"{name}_runs_user_us_per_msg"] = [rnd(user_us(r, n), 2) for r, n in zip(results, counts, strict=True)]
    out[f"{name}_cpu_us_per_msg"] = rnd(min(per_run), 2)
