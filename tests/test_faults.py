"""The fault-injection file layer itself: what survives a simulated power cut."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from filemq.queue.offsets import OffsetFile
from segments.fileio import DiskFull
from tests.faults import BypassError, Crashed, FaultyFileIO, PowerCut


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


def _durable_file(io: FaultyFileIO, path: Path, data: bytes) -> None:
    h = io.open(path, create=True)
    h.pwrite(data, 0)
    h.datasync()
    h.close()
    io.fsync_dir(path.parent)


def test_synced_write_survives_drop_and_unsynced_does_not(tmp_path: Path) -> None:
    io = FaultyFileIO(tmp_path)
    f = tmp_path / "a.log"
    h = io.open(f, create=True)
    h.pwrite(b"synced", 0)
    h.datasync()
    io.fsync_dir(tmp_path)
    h.pwrite(b"-unsynced", 6)
    assert f.read_bytes() == b"synced-unsynced"  # the running system sees the page cache
    report = io.crash("drop", random.Random(1))
    assert f.read_bytes() == b"synced"
    assert report.lost_bytes == len(b"-unsynced")


def test_unsynced_truncate_is_undone_by_a_crash(tmp_path: Path) -> None:
    io = FaultyFileIO(tmp_path)
    f = tmp_path / "a.log"
    _durable_file(io, f, b"0123456789")
    h = io.open(f)
    h.truncate(3)
    assert f.read_bytes() == b"012"
    io.crash("drop", random.Random(0))
    assert f.read_bytes() == b"0123456789"


def test_handles_opened_before_a_crash_are_dead(tmp_path: Path) -> None:
    io = FaultyFileIO(tmp_path)
    h = io.open(tmp_path / "a.log", create=True)
    io.crash("drop", random.Random(0))
    with pytest.raises(Crashed):
        h.pwrite(b"x", 0)


def test_creation_without_dir_fsync_may_or_may_not_survive(tmp_path: Path) -> None:
    outcomes = set()
    for seed in range(40):
        root = tmp_path / str(seed)
        io = FaultyFileIO(root)
        h = io.open(root / "new.log", create=True)
        h.pwrite(b"data", 0)
        h.datasync()  # data durable, but the directory entry is not
        io.crash("drop", random.Random(seed))
        outcomes.add(_read(root / "new.log"))
    assert outcomes == {None, b"data"}


def test_creation_with_dir_fsync_always_survives(tmp_path: Path) -> None:
    for seed in range(20):
        root = tmp_path / str(seed)
        io = FaultyFileIO(root)
        _durable_file(io, root / "new.log", b"data")
        io.crash("drop", random.Random(seed))
        assert _read(root / "new.log") == b"data"


def test_rename_and_unlink_are_volatile_until_dir_fsync(tmp_path: Path) -> None:
    renamed, unlinked = set(), set()
    for seed in range(40):
        root = tmp_path / str(seed)
        io = FaultyFileIO(root)
        _durable_file(io, root / "target", b"old")
        _durable_file(io, root / "victim", b"v")
        h = io.open(root / "target.tmp", create=True)
        h.pwrite(b"new", 0)
        h.datasync()
        h.close()
        io.rename(root / "target.tmp", root / "target")
        io.unlink(root / "victim")
        io.crash("drop", random.Random(seed))
        renamed.add(_read(root / "target"))
        unlinked.add(_read(root / "victim"))
    assert renamed == {b"old", b"new"}
    assert unlinked == {None, b"v"}


def test_unsynced_data_of_a_renamed_file_is_still_lost(tmp_path: Path) -> None:
    io = FaultyFileIO(tmp_path)
    h = io.open(tmp_path / "a.tmp", create=True)
    h.pwrite(b"never synced", 0)
    io.rename(tmp_path / "a.tmp", tmp_path / "a")
    io.fsync_dir(tmp_path)
    io.crash("drop", random.Random(3))
    assert (tmp_path / "a").read_bytes() == b""


def test_tear_keeps_a_prefix_of_the_unsynced_writes(tmp_path: Path) -> None:
    first, second = b"A" * 50, b"B" * 50
    fills = set()
    lengths = set()
    for seed in range(60):
        root = tmp_path / str(seed)
        io = FaultyFileIO(root)
        f = root / "s.log"
        _durable_file(io, f, b"S" * 10)
        h = io.open(f)
        h.pwrite(first, 10)
        h.pwrite(second, 60)
        report = io.crash("tear", random.Random(seed))
        data = f.read_bytes()
        written = b"S" * 10 + first + second
        assert data[:10] == b"S" * 10  # synced bytes never change
        kept = 0
        while kept < len(data) and data[kept] == written[kept]:
            kept += 1
        # Past the surviving prefix there is only filler: zeros or garbage, never later data.
        assert len(data) <= len(written)
        if kept < len(data):
            assert report.torn and report.torn[0][2] in ("zeros", "garbage")
            fills.add(report.torn[0][2])
        lengths.add(kept)
    assert fills == {"zeros", "garbage"}
    assert min(lengths) == 10 and max(lengths) > 60 and len(lengths) > 10  # both writes torn somewhere


def test_flip_changes_exactly_one_synced_bit_of_a_log_file(tmp_path: Path) -> None:
    for seed in range(20):
        root = tmp_path / str(seed)
        io = FaultyFileIO(root)
        data = bytes(range(64))
        _durable_file(io, root / "00.log", data)
        _durable_file(io, root / "00.index", b"index")
        h = io.open(root / "00.log")
        h.pwrite(b"unsynced", 64)
        report = io.crash("flip", random.Random(seed))
        assert report.flipped is not None
        path, pos, bit = report.flipped
        assert path == str(root / "00.log")
        after = (root / "00.log").read_bytes()
        assert len(after) == len(data)
        diff = [i for i in range(len(data)) if after[i] != data[i]]
        assert diff == [pos] and after[pos] ^ data[pos] == 1 << bit
        assert (root / "00.index").read_bytes() == b"index"


def test_disk_full_and_write_budget(tmp_path: Path) -> None:
    io = FaultyFileIO(tmp_path)
    h = io.open(tmp_path / "a.log", create=True)
    io.disk_full = True
    with pytest.raises(DiskFull):
        h.pwrite(b"x", 0)
    with pytest.raises(DiskFull):
        h.datasync()
    assert io.free_bytes(tmp_path) == 0
    io.disk_full = False
    io.fail_writes_after(5)
    assert io.free_bytes(tmp_path) == 5
    with pytest.raises(DiskFull):
        h.pwrite(b"0123456789", 0)
    assert (tmp_path / "a.log").read_bytes() == b"01234"  # a short write, as ENOSPC leaves it
    with pytest.raises(DiskFull):
        h.pwrite(b"more", 5)
    io.fail_writes_after(None)
    h.pwrite(b"more", 5)
    assert (tmp_path / "a.log").read_bytes() == b"01234more"


def test_power_cut_stops_every_later_operation(tmp_path: Path) -> None:
    io = FaultyFileIO(tmp_path)
    h = io.open(tmp_path / "a.log", create=True)
    io.power_cut_after(1)
    h.pwrite(b"ok", 0)
    with pytest.raises(PowerCut):
        h.datasync()
    with pytest.raises(PowerCut):
        h.pwrite(b"no", 2)
    with pytest.raises(PowerCut):
        io.fsync_dir(tmp_path)
    assert io.power_is_cut
    io.crash("drop", random.Random(0))
    assert not (tmp_path / "a.log").exists() or (tmp_path / "a.log").read_bytes() == b""
    io.open(tmp_path / "b.log", create=True).close()  # power is back after the crash


def test_writes_that_bypass_the_fileio_are_reported(tmp_path: Path) -> None:
    io = FaultyFileIO(tmp_path)
    (tmp_path / "sneaky.log").write_bytes(b"x")
    with pytest.raises(BypassError, match="sneaky"):
        io.crash("drop", random.Random(0))
    with pytest.raises(BypassError):
        io.open(tmp_path / "sneaky.log")


def test_paths_outside_the_root_are_refused(tmp_path: Path) -> None:
    io = FaultyFileIO(tmp_path / "root")
    with pytest.raises(ValueError, match="outside"):
        io.open(tmp_path / "elsewhere.log", create=True)


@pytest.mark.parametrize("mode", ["drop", "tear"])
def test_atomic_write_gives_old_or_new_after_a_power_cut_at_every_step(tmp_path: Path, mode: str) -> None:
    """atomic_write via OffsetFile: whatever step the power dies at, a reader finds the old value or the new."""
    seen = set()
    steps = 0
    finished = False
    while not finished:
        for seed in range(6):
            root = tmp_path / f"{steps}-{seed}"
            io = FaultyFileIO(root)
            OffsetFile(root / "pending", io).write(41)
            io.power_cut_after(steps)
            try:
                OffsetFile(root / "pending", io).write(42)
                finished = True
            except PowerCut:
                finished = False
            io.crash(mode, random.Random(seed))  # type: ignore[arg-type]
            value = OffsetFile(root / "pending", io).read()
            assert value in (41, 42), (steps, seed, value)
            if finished:
                assert value == 42  # returned normally: rename and directory fsync are durable
            seen.add(value)
        steps += 1
    # open-create, truncate, pwrite, datasync, rename, fsync_dir: six cut points before success.
    assert steps == 7
    assert seen == {41, 42}


def test_directory_rename_moves_its_files_and_is_volatile_until_dir_fsync(tmp_path: Path) -> None:
    outcomes = set()
    for seed in range(30):
        root = tmp_path / str(seed)
        (root / "g").mkdir(parents=True)
        io = FaultyFileIO(root)
        _durable_file(io, root / "g" / "pending", b"p")
        io.rename(root / "g", root / "g.dropped")
        assert (root / "g.dropped" / "pending").read_bytes() == b"p"
        io.unlink(root / "g.dropped" / "pending")
        io.crash("drop", random.Random(seed))
        outcomes.add((_read(root / "g" / "pending"), _read(root / "g.dropped" / "pending")))
    assert (b"p", None) in outcomes and (None, b"p") in outcomes
    assert all(a is None or b is None for a, b in outcomes)  # never in both places
