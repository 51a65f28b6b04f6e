"""Offline views of a data directory for ``filemq inspect``, ``filemq verify`` and ``filemq status``.

What a caller may rely on:

* :func:`inspect_log`, :func:`data_dir_status` and :func:`verify_data_dir` without
  ``repair`` never change a byte on disk. They open the log through :class:`DryRunFileIO`,
  which runs the log's real recovery code (the same code ``Log.open`` runs at start-up) but
  records each change it would make instead of making it; so what verify reports is exactly
  what start-up (or ``--repair``) would do.
* ``verify_data_dir(..., repair=True)`` repairs what start-up would (torn tails cut by
  ``Log.open``) and rewrites broken offset files with the safe value (re-deliver, never
  skip); corrupt records inside sealed segments are left in place and reported.
* A path may be a data directory (holding ``log/`` and ``groups/``) or its ``log/``
  directory; anything else raises :class:`NotADataDir`.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from filemq.queue.groups import (
    DOING_FILE,
    DROPPED_SUFFIX,
    GROUP_FILE,
    GROUP_FORMAT,
    PENDING_FILE,
    escape_group_name,
    group_directories,
    read_group_file,
    unescape_group_name,
)
from filemq.queue.offsets import OffsetFile, OffsetReading
from segments import Log, LogConfig, ScannedRecord
from segments.fileio import OS_FILE_IO, FileHandle, atomic_write
from segments.segment import parse_segment_name

LOG_DIR = "log"
GROUPS_DIR = "groups"


class NotADataDir(ValueError):
    """The path is neither a filemq data directory nor a log directory; ``path`` says which."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the log and the groups of a data directory are (groups_dir None: none known)."""

    log_dir: Path
    groups_dir: Path | None


def locate(path: str | os.PathLike[str]) -> Layout:
    """The layout for ``path`` (a data directory or its ``log/``); raises :class:`NotADataDir`."""
    root = Path(path)
    if not root.is_dir():
        raise NotADataDir(str(root), "not a directory")
    if (root / LOG_DIR).is_dir():
        return Layout(root / LOG_DIR, root / GROUPS_DIR)
    if any(parse_segment_name(n) is not None for n in os.listdir(root)):
        groups = root.parent / GROUPS_DIR if root.name == LOG_DIR else None
        return Layout(root, groups)
    raise NotADataDir(str(root), f"no '{LOG_DIR}/' directory and no segment files (<20 digits>.log)")


# ---- a file layer that only pretends to write --------------------------------------------


class _DryRunHandle:
    """Reads the real file (or an in-memory one made during the dry run); records changes."""

    def __init__(self, path: str, io: DryRunFileIO, fd: int | None, memory: bytearray | None) -> None:
        self.path = path
        self._io = io
        self._fd = fd
        self._memory = memory
        self._size = os.fstat(fd).st_size if fd is not None else 0

    def pwrite(self, data: bytes | bytearray | memoryview, position: int) -> None:
        if self._memory is not None:
            end = position + len(data)
            if len(self._memory) < end:
                self._memory.extend(b"\0" * (end - len(self._memory)))
            self._memory[position:end] = data
        else:
            self._io.record("write", self.path, f"{len(data)} bytes at byte {position}")
            self._size = max(self._size, position + len(data))

    def pread(self, size: int, position: int) -> bytes:
        if self._memory is not None:
            return bytes(self._memory[position : position + size])
        assert self._fd is not None
        size = max(0, min(size, self._size - position))
        return os.pread(self._fd, size, position) if size else b""

    def size(self) -> int:
        return len(self._memory) if self._memory is not None else self._size

    def truncate(self, size: int) -> None:
        if self._memory is not None:
            del self._memory[size:]
            return
        if size < self._size:
            self._io.record("truncate", self.path, f"cut {self._size - size} bytes (from {self._size} to {size})")
        self._size = size

    def datasync(self) -> None:
        pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True, slots=True)
class Change:
    """One change the dry run would have made: kind is truncate, write, create, rename or unlink."""

    kind: str
    path: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.path}" + (f": {self.detail}" if self.detail else "")


class DryRunFileIO:
    """A :class:`segments.fileio.FileIO` that reads real files and records every change instead
    of making it. Files created during the run live in memory, so code that writes a file
    and reads it back still works."""

    def __init__(self) -> None:
        self.changes: list[Change] = []
        self._memory: dict[str, bytearray] = {}
        self._removed: set[str] = set()

    def record(self, kind: str, path: str | os.PathLike[str], detail: str = "") -> None:
        self.changes.append(Change(kind, os.fspath(path), detail))

    def open(self, path: str | os.PathLike[str], *, create: bool = False) -> FileHandle:
        key = os.fspath(path)
        if key in self._memory:
            return _DryRunHandle(key, self, None, self._memory[key])
        if key not in self._removed and os.path.exists(key):
            return _DryRunHandle(key, self, os.open(key, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), None)
        if not create:
            raise FileNotFoundError(2, "No such file or directory", key)
        self._memory[key] = bytearray()
        self._removed.discard(key)
        if not key.endswith(".tmp"):
            self.record("create", key)
        return _DryRunHandle(key, self, None, self._memory[key])

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        s, d = os.fspath(src), os.fspath(dst)
        if s in self._memory:
            self._memory[d] = self._memory.pop(s)
            self._removed.discard(d)
            self.record("write", d, f"{len(self._memory[d])} bytes, atomically")
        else:
            self.record("rename", s, f"to {d}")

    def unlink(self, path: str | os.PathLike[str]) -> None:
        key = os.fspath(path)
        self._memory.pop(key, None)
        self._removed.add(key)
        self.record("unlink", key)

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        pass

    def free_bytes(self, path: str | os.PathLike[str]) -> int:
        return OS_FILE_IO.free_bytes(path)


def open_log_readonly(log_dir: Path) -> tuple[Log, DryRunFileIO]:
    """The log in ``log_dir`` as start-up would see it, without changing anything on disk."""
    io = DryRunFileIO()
    return Log.open(log_dir, LogConfig(), io), io


# ---- inspect ---------------------------------------------------------------------------


def inspect_log(path: str | os.PathLike[str], from_offset: int = 0, limit: int | None = None) -> Iterator[ScannedRecord]:
    """Every record from ``from_offset`` on, and every corrupt spot, read-only (at most ``limit``)."""
    layout = locate(path)
    lg, _ = open_log_readonly(layout.log_dir)
    try:
        yield from itertools.islice(lg.scan(from_offset), limit)
    finally:
        lg.close()


def _iso(timestamp_us: int) -> str:
    try:
        return datetime.fromtimestamp(timestamp_us / 1e6, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return str(timestamp_us)


# The message properties a record's headers may hold (filemq.mqtt.properties.MESSAGE_PROPERTY_IDS),
# in the order inspect shows them.
_MESSAGE_PROPERTIES = (
    "payload_format_indicator", "message_expiry_interval", "content_type", "response_topic",
    "correlation_data", "user_properties",
)


def _properties(headers: bytes) -> tuple[list[tuple[str, Any]], str | None]:
    """The message properties in a record's headers as (name, value) pairs (absent ones left
    out), or an error message when they are not a valid property section."""
    from filemq.mqtt.properties import decode_message_headers
    from filemq.mqtt.wire import ProtocolError

    try:
        props = decode_message_headers(headers)
    except ProtocolError as exc:
        return [], str(exc)
    if props is None:
        return [], None
    pairs = [(name, getattr(props, name)) for name in _MESSAGE_PROPERTIES]
    return [(name, value) for name, value in pairs if value is not None and value != []], None


def headers_text(headers: bytes) -> str:
    """``headers: content_type='x' user_properties=[('k', 'v')]`` for ``filemq inspect``."""
    pairs, error = _properties(headers)
    if error is not None:
        return f"headers: undecodable ({len(headers)} bytes: {error})"
    return "headers: " + " ".join(f"{name}={list(value) if name == 'user_properties' else value!r}"
                                  for name, value in pairs)


def record_json(scanned: ScannedRecord, with_payload: bool = False) -> dict[str, Any]:
    """The ``--json`` object for one scanned record (offset etc. are null for a corrupt spot).

    ``properties`` holds the MQTT 5 message properties of a format 2 record (null when it has
    none; correlation data base64), ``headers_error`` why its headers do not decode, if so."""
    r = scanned.record
    out: dict[str, Any] = {
        "offset": r.offset if r else None,
        "segment": scanned.segment,
        "position": scanned.position,
        "length": scanned.length,
        "timestamp": _iso(r.timestamp_us) if r else None,
        "timestamp_us": r.timestamp_us if r else None,
        "topic": r.topic if r else None,
        "qos": r.qos if r else None,
        "retain": r.retain if r else None,
        "payload_len": len(r.payload) if r else None,
        "headers_len": len(r.headers) if r else None,
        "properties": None,
        "crc_ok": scanned.crc_ok,
    }
    if r is not None and r.headers:
        pairs, error = _properties(r.headers)
        if error is not None:
            out["headers_error"] = error
        else:
            out["properties"] = {
                name: base64.b64encode(value).decode("ascii") if isinstance(value, bytes)
                else [list(p) for p in value] if name == "user_properties" else value
                for name, value in pairs
            }
    if with_payload:
        out["payload"] = base64.b64encode(r.payload).decode("ascii") if r else None
    return out


def record_text(scanned: ScannedRecord, with_payload: bool = False) -> str:
    """One human-readable line for a scanned record or corrupt spot."""
    r = scanned.record
    where = f"{scanned.segment} @{scanned.position} len={scanned.length}"
    if r is None:
        return f"CORRUPT {where} crc_ok=false"
    line = (
        f"offset={r.offset} {where} ts={_iso(r.timestamp_us)} qos={r.qos} "
        f"retain={int(r.retain)} topic={r.topic!r} payload_len={len(r.payload)}"
    )
    if with_payload:
        line += f" payload={r.payload!r}"
    if r.headers:
        line += " " + headers_text(r.headers)
    return line


# ---- status ----------------------------------------------------------------------------


def _journaled(groups_dir: Path) -> dict[str, tuple[int, int]]:
    """The progress journal's replay (read-only): per group directory, (Pending, Doing)
    acked after the offset files were last written (see filemq.queue.offsets.ProgressJournal)."""
    from filemq.queue.api import JOURNAL_FILE
    from filemq.queue.offsets import decode_journal

    try:
        return decode_journal((groups_dir / JOURNAL_FILE).read_bytes())[0]
    except OSError:
        return {}


def _group_status(directory: Path, first: int, committed: int,
                  journaled: tuple[int, int] | None = None) -> dict[str, Any]:
    info = read_group_file(directory)
    name = info[0] if info else unescape_group_name(directory.name)
    pending = OffsetFile(directory / PENDING_FILE).inspect()
    doing = OffsetFile(directory / DOING_FILE).inspect()
    problems = [f"{p.path}: {p.problem}" for p in (pending, doing) if p.problem]
    if info is None:
        problems.append(f"{directory / GROUP_FILE}: missing or damaged")
    # What the broker would resume from: Pending, or the safe fallback (see ConsumerGroup.load).
    effective = pending.value if pending.value is not None else first
    if journaled is not None:
        effective = max(effective, journaled[0])  # as ConsumerGroup.load takes it
    effective = min(max(effective, first), committed)
    return {
        "name": name,
        "directory": directory.name,
        "filters": list(info[1]) if info else None,
        "created": info[2] if info else None,
        "doing": doing.value,
        "pending": pending.value,
        "journaled_pending": journaled[0] if journaled is not None else None,
        "lag": committed - effective,
        "problems": problems,
    }


def data_dir_status(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Log size, segments, first/next offset and per-group doing/pending/lag, read-only."""
    layout = locate(path)
    lg, io = open_log_readonly(layout.log_dir)
    try:
        segments = lg.segments()
        first, nxt, committed = lg.first_offset, lg.next_offset, lg.committed_offset
        log_info: dict[str, Any] = {
            "directory": str(layout.log_dir),
            "size_bytes": lg.size_bytes(),
            "segments": len(segments),
            "sealed_segments": sum(1 for s in segments if s.sealed),
            "first_offset": first,
            "next_offset": nxt,
            "records": nxt - first,
            "recovery_pending": [str(c) for c in io.changes if c.kind != "create"],
        }
    finally:
        lg.close()
    groups: list[dict[str, Any]] = []
    if layout.groups_dir is not None:
        journal = _journaled(layout.groups_dir)
        groups = [_group_status(d, first, committed, journal.get(d.name))
                  for d in group_directories(layout.groups_dir)]
    status: dict[str, Any] = {"log": log_info, "groups": groups}
    exports = _exports_status(layout.log_dir.parent / EXPORTS_FILE)
    if exports is not None:
        status["exports"] = exports
    return status


EXPORTS_FILE = "exports.json"  # written by a running agent every second (worker_agent.exports)


def _exports_status(path: Path) -> list[dict[str, Any]] | None:
    """The agent's exports as it last wrote them, each with ``as_of_age_s`` (None: no agent file)."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        entries = [dict(e) for e in body["exports"]]
        written = float(body["written_unix"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [{"name": None, "problem": f"{path}: unreadable ({exc})"}]
    age = max(0.0, datetime.now(UTC).timestamp() - written)
    for entry in entries:
        entry["as_of_age_s"] = round(age, 3)
    return entries


def _export_line(e: dict[str, Any]) -> list[str]:
    if e.get("name") is None:
        return [f"exports: PROBLEM {e.get('problem')}"]
    state = e.get("state")
    head = f"export {e['name']!r} -> {e.get('url')} (priority {e.get('priority', 0)}): {state}"
    if state == "backoff" and e.get("last_error"):
        head += f", backing off: {e['last_error']}"
    elif state == "stopped" and e.get("last_error"):
        head += f", last error: {e['last_error']}"
    lines = [head]
    if "lag_records" in e:
        age = e.get("oldest_unsent_age_s")
        last_ack = e.get("last_ack_unix")
        ack = datetime.fromtimestamp(last_ack, UTC).isoformat(timespec="seconds") if last_ack else "never"
        lines.append(
            f"  lag {e['lag_records']:,} records (~{e.get('lag_bytes', 0):,} bytes), oldest unsent "
            f"{'-' if age is None else f'{age:.1f} s'}, last ack {ack}, lost to retention "
            f"{e.get('lost_records', 0):,} (as of {e.get('as_of_age_s', 0):.0f} s ago)")
    return lines


def status_text(status: dict[str, Any]) -> list[str]:
    """Short human-readable lines for :func:`data_dir_status`."""
    lg = status["log"]
    lines = [
        f"log {lg['directory']}: {lg['size_bytes']:,} bytes in {lg['segments']} segments "
        f"({lg['sealed_segments']} sealed), offsets [{lg['first_offset']}, {lg['next_offset']}), "
        f"{lg['records']:,} records"
    ]
    for change in lg["recovery_pending"]:
        lines.append(f"  at next start-up: {change}")
    if not status["groups"]:
        lines.append("no consumer groups")
    for g in status["groups"]:
        name = g["name"] if g["name"] is not None else f"<unknown: {g['directory']}>"
        lines.append(
            f"group {name!r}: doing={g['doing']} pending={g['pending']} lag={g['lag']:,} "
            f"filters={g['filters']}"
            + (f" (journaled pending={g['journaled_pending']})" if g.get("journaled_pending") is not None else "")
        )
        for problem in g["problems"]:
            lines.append(f"  PROBLEM {problem}")
    for e in status.get("exports", []):
        lines.extend(_export_line(e))
    return lines


# ---- verify ----------------------------------------------------------------------------

EXIT_CLEAN = 0
EXIT_PROBLEMS = 1
EXIT_UNUSABLE = 2


@dataclass
class VerifyReport:
    """What :func:`verify_data_dir` found; ``problems`` is empty for a clean directory."""

    path: str
    records: int = 0
    segments: int = 0
    corrupt_records: int = 0
    torn_tail_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unusable: str | None = None

    @property
    def exit_code(self) -> int:
        if self.unusable is not None:
            return EXIT_UNUSABLE
        return EXIT_PROBLEMS if self.problems else EXIT_CLEAN

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.exit_code == EXIT_CLEAN,
            "exit_code": self.exit_code,
            "records": self.records,
            "segments": self.segments,
            "corrupt_records": self.corrupt_records,
            "torn_tail_bytes": self.torn_tail_bytes,
            "problems": self.problems,
            "repaired": self.repaired,
            "notes": self.notes,
            "unusable": self.unusable,
        }

    def text(self) -> list[str]:
        if self.unusable is not None:
            return [f"UNUSABLE {self.unusable}"]
        lines = [f"PROBLEM {p}" for p in self.problems]
        lines += [f"REPAIRED {r}" for r in self.repaired]
        lines += [f"note: {n}" for n in self.notes]
        verdict = "clean" if not self.problems else f"{len(self.problems)} problem(s)"
        lines.append(
            f"{self.path}: {self.segments} segments, {self.records:,} records, "
            f"{self.corrupt_records} corrupt, {self.torn_tail_bytes} torn tail bytes: {verdict}"
        )
        return lines


def _check_log(log_dir: Path, report: VerifyReport, repair: bool) -> tuple[int, int]:
    """Check the log; returns (first_offset, next_offset) as start-up would see them."""
    lg, io = open_log_readonly(log_dir)
    try:
        report.torn_tail_bytes = lg.recovery.tail_bytes_truncated
        for change in io.changes:
            if change.kind == "create" and change.path.endswith(".log"):
                continue  # start-up creating the next empty segment is routine
            (report.repaired if repair else report.problems).append(
                f"log: {change}" if repair else f"log: start-up would {change}"
            )
        if repair:
            # The dry run above is exactly what this real open does; report it as repaired.
            lg.close()
            lg = Log.open(log_dir, LogConfig())
        segments = lg.segments()
        report.segments = len(segments)
        last_offset: int | None = None
        records = 0
        for scanned in lg.scan(0):
            if scanned.record is not None:
                last_offset = scanned.record.offset
                records += 1
                continue
            report.corrupt_records += 1
            after = f"after offset {last_offset}" if last_offset is not None else "before the first valid record"
            report.problems.append(
                f"log: corrupt record in {scanned.segment} at byte {scanned.position} "
                f"(framed length {scanned.length}, {after}); skipped on read"
                + ("; left in place (sealed segment)" if repair else "")
            )
        report.records = records
        return lg.first_offset, lg.next_offset
    finally:
        lg.close()


def _check_group(directory: Path, first: int, end: int, report: VerifyReport, repair: bool) -> None:
    label = f"group {directory.name}"
    info = read_group_file(directory)
    if info is None:
        name = unescape_group_name(directory.name)
        what = f"{directory / GROUP_FILE}: missing or damaged"
        if name is None:
            report.problems.append(f"{what}; the group name cannot be recovered (not repairable)")
        elif repair:
            body = {"format": GROUP_FORMAT, "name": name, "filters": ["#"],
                    "created": datetime.now(UTC).isoformat(timespec="seconds")}
            atomic_write(directory / GROUP_FILE, json.dumps(body, ensure_ascii=True, indent=1).encode() + b"\n")
            report.problems.append(what)
            report.repaired.append(f"{directory / GROUP_FILE}: rewritten for {name!r} with filters ['#'] (set them again)")
        else:
            report.problems.append(f"{what} (name {name!r} recoverable from the directory name)")
    else:
        label = f"group {info[0]!r}"
    pending_file = OffsetFile(directory / PENDING_FILE)
    doing_file = OffsetFile(directory / DOING_FILE)
    pending = pending_file.inspect()
    doing = doing_file.inspect()
    safe_pending = pending.value
    if pending.problem is not None:
        report.problems.append(f"{label}: Pending {pending.path}: {pending.problem}")
        safe_pending = first  # re-deliver everything still in the log, never skip
        if repair:
            pending_file.write(safe_pending)
            report.repaired.append(f"{label}: Pending rewritten as {safe_pending} (the log's first offset: re-deliver)")
    assert safe_pending is not None
    _check_doing(label, doing_file, doing, safe_pending, report, repair)
    if safe_pending < first:
        report.notes.append(
            f"{label}: Pending {safe_pending} is below the log's first offset {first}: "
            f"{first - safe_pending} records were dropped by retention before this group acked them"
        )
    elif safe_pending > end:
        report.notes.append(f"{label}: Pending {safe_pending} is beyond the log's end {end}; it will resume at {end}")
    for leftover in sorted(directory.glob("*.tmp")):
        report.notes.append(f"{label}: leftover {leftover.name} from an interrupted write (ignored)")


def _check_doing(
    label: str, doing_file: OffsetFile, doing: OffsetReading, pending: int, report: VerifyReport, repair: bool,
) -> None:
    if doing.problem is None and doing.value is not None and doing.value >= pending:
        return
    if doing.problem is not None:
        report.problems.append(f"{label}: Doing {doing.path}: {doing.problem}")
    else:
        report.problems.append(f"{label}: Doing {doing.value} is below Pending {pending}")
    if repair:
        # Doing only marks redeliveries (DUP) after a restart; Pending is a safe value.
        doing_file.write(pending)
        report.repaired.append(f"{label}: Doing rewritten as {pending} (= Pending)")


def verify_data_dir(path: str | os.PathLike[str], repair: bool = False) -> VerifyReport:
    """Check every segment and offset file; with ``repair`` fix what can be fixed safely."""
    report = VerifyReport(str(path))
    try:
        layout = locate(path)
    except NotADataDir as exc:
        report.unusable = str(exc)
        return report
    try:
        first, end = _check_log(layout.log_dir, report, repair)
    except OSError as exc:
        report.unusable = f"cannot read the log in {layout.log_dir}: {exc}"
        return report
    if layout.groups_dir is None:
        report.notes.append("a log directory was given without its data directory: offset files not checked")
        return report
    if layout.groups_dir.is_dir():
        for leftover in sorted(layout.groups_dir.glob("*" + DROPPED_SUFFIX)):
            report.notes.append(f"{leftover.name}: a dropped group not fully deleted (removed at next start-up)")
    for directory in group_directories(layout.groups_dir):
        _check_group(directory, first, end, report, repair)
    _check_session_groups(layout.groups_dir, report)
    return report


def _check_session_groups(groups_dir: Path, report: VerifyReport) -> None:
    """A broker data dir: every stored session with subscriptions has its group directory,
    and every MQTT group directory has an owner (a stray one pins retention for ever)."""
    from filemq.broker.core import SESSION_GROUP_PREFIX, SHARE_GROUP_PREFIX, parse_share_key
    from filemq.broker.session_store import SESSIONS_DIR, CorruptSession, StoredSession

    sessions_dir = groups_dir.parent / SESSIONS_DIR
    if not sessions_dir.is_dir():
        return  # not a broker's data dir (an agent's or a collector's): no MQTT owners
    wanted: dict[str, str] = {}  # group name -> who needs it
    for path in sorted(sessions_dir.glob("*.json")):
        try:
            session = StoredSession.from_json(path.read_bytes(), str(path))
        except (OSError, CorruptSession):
            continue
        for f in session.subscriptions:
            share, _plain = parse_share_key(f)
            if share is None:
                wanted[SESSION_GROUP_PREFIX + session.client_id] = f"session {session.client_id!r}"
            else:
                wanted.setdefault(SHARE_GROUP_PREFIX + share, f"session {session.client_id!r} ({f})")
    present: dict[str, Path] = {}
    for directory in group_directories(groups_dir):
        info = read_group_file(directory)
        name = info[0] if info is not None else unescape_group_name(directory.name)
        if name is not None:
            present[name] = directory
    for name, owner in sorted(wanted.items()):
        if name not in present:
            report.problems.append(
                f"{owner}: its consumer group directory {groups_dir / escape_group_name(name)} is missing; "
                f"the broker re-creates it at the log's first offset (re-delivers every retained message)")
    for name, directory in sorted(present.items()):
        if name.startswith((SESSION_GROUP_PREFIX, SHARE_GROUP_PREFIX)) and name not in wanted:
            pending = OffsetFile(directory / PENDING_FILE).inspect().value
            report.problems.append(
                f"stray group directory {directory}: no stored session owns group {name!r}, yet its "
                f"Pending {pending} holds back retention; delete the directory if the session is gone")
