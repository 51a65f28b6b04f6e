"""The file layer every on-disk write in filemq goes through.

The log, its index and the consumer-group offset files never call ``os`` directly for
writes: they use a :class:`FileIO`.  Production uses :class:`OsFileIO`; the tests swap in a
layer that loses unsynced bytes, tears the last write or flips bits on a simulated power
cut (``tests/faults.py``), so recovery is tested through the very code that runs in
production.

:func:`atomic_write` is the one way to replace a small file atomically
(temp name, fsync, rename, directory fsync): a reader sees the old or the new content,
never a mix.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Protocol


class DiskFull(OSError):
    """No space for a write: ENOSPC from the OS, or the configured free-space floor reached.

    Nothing partial from the failed write is visible to readers; the write can be retried
    once space is back.
    """

    def __init__(self, path: str | os.PathLike[str], detail: str) -> None:
        super().__init__(errno.ENOSPC, f"disk full at {os.fspath(path)}: {detail}")
        self.path = os.fspath(path)
        self.detail = detail


class FileHandle(Protocol):
    """An open file: positional writes and reads, truncation, and data sync."""

    path: str

    def pwrite(self, data: bytes | bytearray | memoryview, position: int) -> None:
        """Write all of ``data`` at ``position`` (loops over short writes)."""

    def pread(self, size: int, position: int) -> bytes:
        """Read up to ``size`` bytes at ``position``; shorter only at end of file."""

    def size(self) -> int:
        """Current size of the file in bytes."""

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes."""

    def datasync(self) -> None:
        """fdatasync: make every byte written so far durable."""

    def close(self) -> None:
        """Close the handle (does not sync)."""


class FileIO(Protocol):
    """Directory-level operations plus opening files; the seam for fault injection."""

    def open(self, path: str | os.PathLike[str], *, create: bool = False) -> FileHandle:
        """Open ``path`` read-write; with ``create`` make it if missing."""

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """Atomically rename ``src`` over ``dst`` (not durable until :meth:`fsync_dir`)."""

    def unlink(self, path: str | os.PathLike[str]) -> None:
        """Remove a file (not durable until :meth:`fsync_dir`)."""

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        """Make creations, renames and deletions in directory ``path`` durable."""

    def free_bytes(self, path: str | os.PathLike[str]) -> int:
        """Bytes available to this process on the file system holding ``path``."""


class OsFileHandle:
    """A :class:`FileHandle` on a real file descriptor."""

    __slots__ = ("path", "_fd")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    def pwrite(self, data: bytes | bytearray | memoryview, position: int) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.pwrite(self._fd, view, position)
                view = view[written:]
                position += written
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(self.path, os.strerror(exc.errno)) from exc
            raise

    def pread(self, size: int, position: int) -> bytes:
        return os.pread(self._fd, size, position)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)

    def datasync(self) -> None:
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(self.path, os.strerror(exc.errno)) from exc
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class OsFileIO:
    """The production :class:`FileIO`: plain POSIX calls."""

    def open(self, path: str | os.PathLike[str], *, create: bool = False) -> FileHandle:
        flags = os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_CLOEXEC", 0)
        return OsFileHandle(os.fspath(path), os.open(path, flags, 0o644))

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        os.replace(src, dst)

    def unlink(self, path: str | os.PathLike[str]) -> None:
        os.unlink(path)

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def free_bytes(self, path: str | os.PathLike[str]) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize


OS_FILE_IO: FileIO = OsFileIO()


def atomic_write(
    path: str | os.PathLike[str], data: bytes, fileio: FileIO = OS_FILE_IO
) -> None:
    """Replace ``path`` with ``data`` atomically and durably.

    Writes ``<path>.tmp``, fdatasyncs it, renames it over ``path`` and fsyncs the directory.
    After a crash at any point a reader finds the old content or the new one, never a mix
    (a leftover ``.tmp`` is ignored and overwritten next time).
    """
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    handle = fileio.open(tmp, create=True)
    try:
        handle.truncate(0)
        handle.pwrite(data, 0)
        handle.datasync()
    finally:
        handle.close()
    fileio.rename(tmp, target)
    fileio.fsync_dir(target.parent)
