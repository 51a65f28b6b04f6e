"""Storage faults for the segments and broker tests: a FileIO that fails on demand, and a real
full file system.

:class:`InjectingFileIO` is the real :class:`~segments.fileio.OsFileIO` whose writes and
syncs fail with ENOSPC while ``full`` is set (and truncates with EIO while ``fail_truncate``
is), that reports ``free`` as the free space, and records each sync; tests/faults.py's
FaultyFileIO simulates power loss instead. :func:`small_tmpfs` mounts a small tmpfs (root
only; the test is skipped otherwise) for a real ENOSPC.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from segments import DiskFull
from segments.fileio import FileHandle, OsFileIO


class InjectingHandle:
    """A real file handle whose writes/syncs fail with ENOSPC while ``io.full`` is set."""

    def __init__(self, inner: FileHandle, io: InjectingFileIO) -> None:
        self._inner, self._io, self.path = inner, io, inner.path

    def pwrite(self, data: bytes | bytearray | memoryview, position: int) -> None:
        if self._io.full:
            # A real ENOSPC may leave part of the write behind: emulate the worst case.
            self._inner.pwrite(bytes(data)[: len(data) // 2], position)
            raise DiskFull(self.path, "injected ENOSPC")
        self._inner.pwrite(data, position)

    def pread(self, size: int, position: int) -> bytes:
        return self._inner.pread(size, position)

    def size(self) -> int:
        return self._inner.size()

    def truncate(self, size: int) -> None:
        if self._io.fail_truncate:
            raise OSError(5, "injected EIO on truncate")
        self._inner.truncate(size)

    def datasync(self) -> None:
        self._inner.datasync()
        self._io.events.append(("datasync", self.path))
        self._io.synced_sizes.append(self._inner.size())

    def close(self) -> None:
        self._inner.close()


class InjectingFileIO(OsFileIO):
    """OsFileIO that records syncs and can simulate a full disk (ENOSPC or low free space)."""

    def __init__(self) -> None:
        self.full = False
        self.fail_truncate = False
        self.free: int | None = None
        self.events: list[tuple[str, str]] = []
        self.synced_sizes: list[int] = []  # file size at each completed datasync

    def open(self, path: str | os.PathLike[str], *, create: bool = False) -> FileHandle:
        return InjectingHandle(super().open(path, create=create), self)

    def free_bytes(self, path: str | os.PathLike[str]) -> int:
        return self.free if self.free is not None else super().free_bytes(path)

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        self.events.append(("fsync_dir", os.fspath(path)))
        super().fsync_dir(path)


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "2m") -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (euid is not 0)")
    where.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"mount -t tmpfs not permitted here: {result.stderr.strip() or result.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
