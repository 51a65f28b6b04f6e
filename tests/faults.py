"""A fault-injecting :class:`segments.fileio.FileIO` that simulates power loss, like SQLite's test VFS.

Every write really happens on the real files under ``root`` (so code that reads with plain
``open``/``os.listdir`` sees what a running system sees), while this layer keeps, per file
(per inode, so renames and unlinks of open files behave), two images:

* the *volatile* image: what the OS page cache holds now (equal to the real file);
* the *durable* image: what the last ``datasync`` made durable.

Namespace changes (creating a file, ``rename``, ``unlink``) are volatile too until
``fsync_dir`` of the directory they touch.  :meth:`FaultyFileIO.crash` then rewrites the real
files to what a power cut could leave:

``"drop"``
    every unsynced byte is lost; files keep their durable image.
``"tear"``
    per file, a random prefix of the unsynced writes/truncates survives, the last surviving
    write cut at a random byte; the torn part is cut off, zero-filled or filled with garbage
    (chosen at random; a file system may extend the size before the data blocks land).
``"flip"``
    like ``"drop"``, then one random bit is flipped in the durable bytes of one random file
    accepted by ``flip_filter`` (default: segment ``.log`` files and ``doing``/``pending``
    offset files) -- media corruption, against which the promise is weaker (see
    docs/DURABILITY.md).

For each namespace change not yet made durable by ``fsync_dir``, the crash decides at random
(from the given ``random.Random``, so Hypothesis can replay and shrink it) whether it happened.

Other faults: :attr:`FaultyFileIO.disk_full` (every ``pwrite``/``datasync`` raises DiskFull),
:meth:`FaultyFileIO.fail_writes_after` (ENOSPC once a byte budget is used up; the write that
crosses it is partly written first, as a real short write is), :attr:`free_bytes_value`, and
:meth:`FaultyFileIO.power_cut_after` (the N-th mutating call raises :class:`PowerCut`, and every
call after it too, until :meth:`crash`): a crash in the middle of a roll, a seal or an
atomic_write, at every step.

Limits, on purpose: directories (``os.makedirs``) are not modelled and always survive; a real
``fdatasync`` is never issued (the durable image is the model), which keeps tests fast.
Any file created or changed under ``root`` without going through this layer is reported as
:class:`BypassError` -- the log promises that *all* writes go through its FileIO.
"""

from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from segments.fileio import DiskFull

CrashMode = Literal["drop", "tear", "flip"]
CRASH_MODES: tuple[CrashMode, ...] = ("drop", "tear", "flip")


class PowerCut(OSError):
    """Raised by every file operation after the simulated power cut (EIO, as a dying disk would)."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.EIO, f"simulated power cut (at {path})")
        self.path = path


class Crashed(RuntimeError):
    """A handle opened before :meth:`FaultyFileIO.crash` was used after it (a stray writer)."""


class BypassError(AssertionError):
    """A file under the root was created or changed without going through the FileIO."""


def default_flip_filter(path: str) -> bool:
    """Segment ``.log`` files and consumer-group ``doing``/``pending`` offset files."""
    name = os.path.basename(path)
    return name.endswith(".log") or name in ("doing", "pending")


class _Inode:
    __slots__ = ("ident", "durable", "volatile", "pending")

    def __init__(self, ident: int, content: bytes = b"") -> None:
        self.ident = ident
        self.durable = bytearray(content)
        self.volatile = bytearray(content)
        # Unsynced changes in order: ("w", position, bytes) or ("t", size, b"").
        self.pending: list[tuple[str, int, bytes]] = []


def _apply(image: bytearray, op: tuple[str, int, bytes]) -> None:
    kind, pos, data = op
    if kind == "w":
        if pos > len(image):
            image.extend(bytes(pos - len(image)))
        image[pos : pos + len(data)] = data
    else:
        if pos < len(image):
            del image[pos:]
        else:
            image.extend(bytes(pos - len(image)))


@dataclass
class CrashReport:
    """What :meth:`FaultyFileIO.crash` did, for test diagnostics and for the flip invariant."""

    mode: str
    files: int = 0
    lost_bytes: int = 0  # unsynced bytes that did not survive (approximate for overwrites)
    dir_ops_applied: list[str] = field(default_factory=list)
    dir_ops_lost: list[str] = field(default_factory=list)
    torn: list[tuple[str, int, str]] = field(default_factory=list)  # path, kept bytes of last write, fill
    flipped: tuple[str, int, int] | None = None  # path, byte position, bit


class FaultyFileHandle:
    """A real file descriptor whose writes are also recorded in the inode's volatile image."""

    __slots__ = ("path", "_fd", "_inode", "_io", "_generation")

    def __init__(self, path: str, fd: int, inode: _Inode, io: FaultyFileIO) -> None:
        self.path = path
        self._fd = fd
        self._inode = inode
        self._io = io
        self._generation = io.generation

    def _check(self) -> None:
        if self._generation != self._io.generation:
            raise Crashed(f"{self.path}: handle opened before a simulated crash was used after it")
        if self._fd < 0:
            raise ValueError(f"{self.path}: handle is closed")

    def pwrite(self, data: bytes | bytearray | memoryview, position: int) -> None:
        io = self._io
        with io.lock:
            self._check()
            io._tick(self.path)
            data = bytes(data)
            if io.disk_full:
                raise DiskFull(self.path, "injected: disk full")
            allowed = len(data)
            if io._write_budget is not None:
                allowed = min(allowed, io._write_budget)
            part = data[:allowed]
            view = memoryview(part)
            pos = position
            while view:
                n = os.pwrite(self._fd, view, pos)
                view = view[n:]
                pos += n
            if part:
                op = ("w", position, part)
                _apply(self._inode.volatile, op)
                self._inode.pending.append(op)
            io.bytes_written += len(part)
            if io._write_budget is not None:
                io._write_budget -= len(part)
            if allowed < len(data):
                raise DiskFull(self.path, f"injected ENOSPC after {allowed} of {len(data)} bytes")

    def pread(self, size: int, position: int) -> bytes:
        with self._io.lock:
            self._check()
            if self._io._cut:
                raise PowerCut(self.path)
            return os.pread(self._fd, size, position)

    def size(self) -> int:
        with self._io.lock:
            self._check()
            return os.fstat(self._fd).st_size

    def truncate(self, size: int) -> None:
        io = self._io
        with io.lock:
            self._check()
            io._tick(self.path)
            os.ftruncate(self._fd, size)
            op = ("t", size, b"")
            _apply(self._inode.volatile, op)
            self._inode.pending.append(op)

    def datasync(self) -> None:
        io = self._io
        with io.lock:
            self._check()
            io._tick(self.path)
            if io.disk_full:
                raise DiskFull(self.path, "injected: disk full at fdatasync")
            inode = self._inode
            inode.durable = bytearray(inode.volatile)
            inode.pending.clear()
            io.datasyncs += 1

    def close(self) -> None:
        with self._io.lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
                self._io._handles.discard(self)


class FaultyFileIO:
    """A :class:`segments.fileio.FileIO` for everything under ``root`` with simulated power loss.

    Thread-safe (one lock), so a group committer's worker thread can use it.  Pre-existing
    files under ``root`` are taken as durable.  Paths outside ``root`` are refused.
    """

    def __init__(self, root: str | os.PathLike[str], *, strict: bool = True) -> None:
        self.root = os.path.realpath(os.fspath(root))
        self.strict = strict
        self.lock = threading.RLock()
        self.generation = 0
        self.disk_full = False
        self.free_bytes_value: int | None = None
        self.bytes_written = 0
        self.datasyncs = 0
        self.dir_fsyncs = 0
        self._write_budget: int | None = None
        self._ops_left: int | None = None
        self._cut = False
        self._next_ident = 0
        self._volatile: dict[str, _Inode] = {}
        self._durable: dict[str, _Inode] = {}
        # Namespace changes not yet made durable, in order: (description, dirs, apply-to-namespace).
        self._dir_ops: list[tuple[str, tuple[str, ...], Callable[[dict[str, _Inode]], None]]] = []
        self._handles: set[FaultyFileHandle] = set()
        os.makedirs(self.root, exist_ok=True)
        self._adopt_tree()

    # -- bookkeeping ----------------------------------------------------------------------

    def _new_inode(self, content: bytes = b"") -> _Inode:
        self._next_ident += 1
        return _Inode(self._next_ident, content)

    def _adopt_tree(self) -> None:
        self._volatile.clear()
        for path in self._real_files():
            with open(path, "rb") as f:
                inode = self._new_inode(f.read())
            self._volatile[path] = inode
        self._durable = dict(self._volatile)

    def _real_files(self) -> list[str]:
        found = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                found.append(os.path.join(dirpath, name))
        return sorted(found)

    def _norm(self, path: str | os.PathLike[str]) -> str:
        p = os.fspath(path)
        full = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(p))), os.path.basename(p))
        if not (full == self.root or full.startswith(self.root + os.sep)):
            raise ValueError(f"{full} is outside the faulty file system root {self.root}")
        return full

    def _tick(self, path: str) -> None:
        """Count one mutating operation; the power-cut countdown fires here."""
        if self._cut:
            raise PowerCut(path)
        if self._ops_left is not None:
            if self._ops_left <= 0:
                self._cut = True
                raise PowerCut(path)
            self._ops_left -= 1

    # -- fault controls -------------------------------------------------------------------

    def fail_writes_after(self, n_bytes: int | None) -> None:
        """ENOSPC once ``n_bytes`` more bytes were written (None: no limit)."""
        with self.lock:
            self._write_budget = n_bytes

    def power_cut_after(self, n_ops: int | None) -> None:
        """The ``n_ops``-th next mutating call (open-create, pwrite, truncate, datasync, rename,
        unlink, fsync_dir; counting from 0) and every call after it raise :class:`PowerCut`."""
        with self.lock:
            self._ops_left = n_ops
            self._cut = False

    @property
    def power_is_cut(self) -> bool:
        return self._cut

    def unsynced(self) -> dict[str, int]:
        """Paths with unsynced data changes -> number of pending changes (for diagnostics)."""
        with self.lock:
            return {p: len(i.pending) for p, i in self._volatile.items() if i.pending}

    # -- FileIO ---------------------------------------------------------------------------

    def open(self, path: str | os.PathLike[str], *, create: bool = False) -> FaultyFileHandle:
        full = self._norm(path)
        with self.lock:
            if self._cut:
                raise PowerCut(full)
            inode = self._volatile.get(full)
            if inode is None:
                if os.path.isdir(full):
                    raise IsADirectoryError(errno.EISDIR, "Is a directory", full)
                if os.path.exists(full):
                    if self.strict:
                        raise BypassError(f"{full} exists but was not created through the FileIO")
                    with open(full, "rb") as f:
                        inode = self._new_inode(f.read())
                    self._volatile[full] = inode
                    self._durable[full] = inode
                elif not create:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory", full)
                else:
                    self._tick(full)
                    inode = self._new_inode()
                    self._volatile[full] = inode
                    created = inode

                    def link(ns: dict[str, _Inode], p: str = full, i: _Inode = created) -> None:
                        ns[p] = i

                    self._dir_ops.append((f"create {full}", (os.path.dirname(full),), link))
            flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(full, flags | (os.O_CREAT if create else 0), 0o644)
            handle = FaultyFileHandle(full, fd, inode, self)
            self._handles.add(handle)
            return handle

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        s, d = self._norm(src), self._norm(dst)
        with self.lock:
            self._tick(s)
            if os.path.isdir(s):
                self._rename_dir(s, d)
                return
            inode = self._volatile.get(s)
            if inode is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory (in the model)", s)
            os.replace(s, d)
            del self._volatile[s]
            self._volatile[d] = inode

            def move(ns: dict[str, _Inode], s: str = s, d: str = d, i: _Inode = inode) -> None:
                ns.pop(s, None)
                ns[d] = i

            dirs = tuple(sorted({os.path.dirname(s), os.path.dirname(d)}))
            self._dir_ops.append((f"rename {s} -> {d}", dirs, move))

    def _rename_dir(self, s: str, d: str) -> None:
        """A directory rename moves every file below it (one namespace change in the parent)."""
        os.replace(s, d)

        def move_tree(ns: dict[str, _Inode], s: str = s, d: str = d) -> None:
            for p in [p for p in ns if p.startswith(s + os.sep)]:
                ns[d + p[len(s):]] = ns.pop(p)

        move_tree(self._volatile)
        dirs = tuple(sorted({os.path.dirname(s), os.path.dirname(d)}))
        self._dir_ops.append((f"rename directory {s} -> {d}", dirs, move_tree))

    def unlink(self, path: str | os.PathLike[str]) -> None:
        full = self._norm(path)
        with self.lock:
            self._tick(full)
            if full not in self._volatile:
                if os.path.exists(full) and self.strict:
                    raise BypassError(f"{full} exists but was not created through the FileIO")
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", full)
            os.unlink(full)
            del self._volatile[full]

            def remove(ns: dict[str, _Inode], p: str = full) -> None:
                ns.pop(p, None)

            self._dir_ops.append((f"unlink {full}", (os.path.dirname(full),), remove))

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        full = self._norm(os.path.join(os.fspath(path), "x"))
        directory = os.path.dirname(full)
        with self.lock:
            self._tick(directory)
            keep = []
            for op in self._dir_ops:
                if directory in op[1]:
                    op[2](self._durable)
                else:
                    keep.append(op)
            self._dir_ops = keep
            self.dir_fsyncs += 1

    def free_bytes(self, path: str | os.PathLike[str]) -> int:
        with self.lock:
            if self.disk_full:
                return 0
            if self.free_bytes_value is not None:
                return self.free_bytes_value
            st = os.statvfs(path)
            real = st.f_bavail * st.f_frsize
            return real if self._write_budget is None else min(real, self._write_budget)

    # -- the crash ------------------------------------------------------------------------

    def check_no_bypass(self) -> None:
        """Raise :class:`BypassError` if the real files differ from the model's volatile view."""
        with self.lock:
            real = set(self._real_files())
            modelled = set(self._volatile)
            problems = [f"not created through the FileIO: {p}" for p in sorted(real - modelled)]
            problems += [f"deleted without the FileIO: {p}" for p in sorted(modelled - real)]
            for p in sorted(real & modelled):
                with open(p, "rb") as f:
                    if f.read() != bytes(self._volatile[p].volatile):
                        problems.append(f"changed without the FileIO: {p}")
            if problems:
                raise BypassError("; ".join(problems))

    def crash(
        self,
        mode: CrashMode = "drop",
        rng: random.Random | None = None,
        *,
        flip_filter: Callable[[str], bool] = default_flip_filter,
        flip_position: Callable[[str, bytes, random.Random], int] | None = None,
    ) -> CrashReport:
        """Simulate a power cut now and rewrite the real files to what survives it.

        ``flip_position(path, image, rng)`` may choose the byte to flip (default: uniform), so
        a test can aim at the bytes that matter most (length fields, headers).
        Every handle opened before is dead afterwards (using it raises :class:`Crashed`);
        power-cut and write-budget faults are cleared; ``disk_full`` is left as set.
        """
        if mode not in CRASH_MODES:
            raise ValueError(f"crash mode must be one of {CRASH_MODES}, not {mode!r}")
        rng = rng if rng is not None else random.Random()
        with self.lock:
            if self.strict:
                self.check_no_bypass()
            report = CrashReport(mode)
            namespace = dict(self._durable)
            for description, _dirs, apply in self._dir_ops:
                if rng.random() < 0.5:
                    apply(namespace)
                    report.dir_ops_applied.append(description)
                else:
                    report.dir_ops_lost.append(description)
            contents: dict[str, bytearray] = {}
            survived: dict[int, bytearray] = {}  # one image per inode (hard links after renames)
            for path in sorted(namespace):
                inode = namespace[path]
                image = survived.get(inode.ident)
                if image is None:
                    image = self._surviving_image(inode, mode, rng, path, report)
                    survived[inode.ident] = image
                contents[path] = image
            if mode == "flip":
                candidates = [p for p in sorted(contents) if contents[p] and flip_filter(p)]
                if candidates:
                    path = rng.choice(candidates)
                    image = contents[path]
                    if flip_position is None:
                        pos = rng.randrange(len(image))
                    else:
                        pos = flip_position(path, bytes(image), rng)
                        if not 0 <= pos < len(image):
                            raise ValueError(f"flip_position gave byte {pos} of a {len(image)}-byte file")
                    bit = rng.randrange(8)
                    image[pos] ^= 1 << bit
                    report.flipped = (path, pos, bit)
            for handle in list(self._handles):
                if handle._fd >= 0:
                    os.close(handle._fd)
                    handle._fd = -1
            self._handles.clear()
            for p in self._real_files():
                os.unlink(p)
            for p, image in contents.items():
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p, "wb") as f:
                    f.write(image)
            report.files = len(contents)
            self.generation += 1
            self._cut = False
            self._ops_left = None
            self._write_budget = None
            self._dir_ops = []
            self._adopt_tree()
            return report

    def _surviving_image(
        self, inode: _Inode, mode: CrashMode, rng: random.Random, path: str, report: CrashReport
    ) -> bytearray:
        image = bytearray(inode.durable)
        pending = inode.pending
        unsynced = sum(len(op[2]) for op in pending)
        if mode != "tear" or not pending:
            report.lost_bytes += unsynced
            return image
        keep = rng.randint(0, len(pending))
        for op in pending[: max(keep - 1, 0)]:
            _apply(image, op)
        if keep:
            kind, pos, data = pending[keep - 1]
            if kind == "t":
                _apply(image, (kind, pos, data))
            else:
                cut = rng.randint(0, len(data))
                fill = rng.choice(("cut", "zeros", "garbage"))
                if fill == "cut" or cut == len(data):
                    torn = data[:cut]
                elif fill == "zeros":
                    torn = data[:cut] + bytes(len(data) - cut)
                else:
                    torn = data[:cut] + rng.randbytes(len(data) - cut)
                _apply(image, ("w", pos, torn))
                report.torn.append((path, cut, fill))
        report.lost_bytes += sum(len(op[2]) for op in pending[keep:])
        return image
