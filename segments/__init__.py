"""filemq: the on-disk segment log (record -> segment -> log). Knows nothing of MQTT or networks.

Public API: :class:`Log` (open, append, flush, sync, read, scan, retention),
:class:`GroupCommitter` (asyncio group commit), :class:`Record`, and the error types.
"""

from segments.commit import FsyncPolicy, GroupCommitter
from segments.errors import CorruptRecord, DiskFull, SegmentError
from segments.fileio import FileIO, OsFileIO, atomic_write
from segments.log import (
    Log,
    LogConfig,
    LogStats,
    LogView,
    RecoveryReport,
    RetentionReport,
    ScannedRecord,
    SegmentInfo,
)
from segments.record import Record

__all__ = [
    "CorruptRecord",
    "DiskFull",
    "FileIO",
    "FsyncPolicy",
    "GroupCommitter",
    "Log",
    "LogConfig",
    "LogStats",
    "LogView",
    "OsFileIO",
    "RecoveryReport",
    "Record",
    "RetentionReport",
    "ScannedRecord",
    "SegmentError",
    "SegmentInfo",
    "atomic_write",
]
