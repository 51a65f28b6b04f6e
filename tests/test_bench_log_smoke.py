"""Tiny runs of `filemq bench append|recover|consume` so they keep working (no timing thresholds:
performance lives in the benches themselves), and a user's --data-dir is never removed."""

from __future__ import annotations

from pathlib import Path

from bench.append import run_append_bench
from bench.consume import run_consume_bench
from bench.recover import run_recover_bench


def test_append_bench_reports_every_implementation_and_keeps_the_users_dir(tmp_path: Path) -> None:
    (tmp_path / "mine").write_text("user data")
    lines: list[str] = []
    results, ratios = run_append_bench(str(tmp_path), 3000, 100, 2, 10, "always", False, lines.append,
                                       baseline_seconds=0.1)
    assert [r.impl for r in results][0] == "filemq" and len(results) == 3
    ours = results[0]
    assert ours.records == 3000 and ours.fsyncs >= 1 and all(r.rate > 0 for r in results)
    assert set(ratios) == {"vs_fdatasync_per_record", "vs_sqlite_ack_queue"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # only the run's own dir went
    assert lines  # progress for a person


def test_recover_bench_cuts_the_tail_and_times_both(tmp_path: Path) -> None:
    r = run_recover_bench(str(tmp_path), 2, 100, 1 << 20, False, lambda _: None, seed=7)
    assert r.segments >= 2 and r.records > 0 and r.log_bytes >= 2 << 20
    assert r.open_seconds > 0 and r.full_scan_seconds > 0
    assert 0 < r.full_scan_records <= r.records
    assert list(tmp_path.iterdir()) == []


def test_consume_bench_acks_every_record_and_keep_keeps(tmp_path: Path) -> None:
    (tmp_path / "mine").write_text("user data")
    results, ratio = run_consume_bench(str(tmp_path), 2000, 50, 1, True, lambda _: None, rounds=1)
    group = next(r for r in results if "ConsumerGroup" in r.impl)
    assert group.records == 2000 and group.offset_writes >= 1 and ratio > 0
    kept = [p for p in tmp_path.iterdir() if p.name != "mine"]
    assert len(kept) == 1 and (kept[0] / "log").is_dir() and (tmp_path / "mine").exists()


def test_compare_log_runs_each_tree_and_summarises() -> None:
    """`python -m bench.compare_log`: every phase measured for every tree, with headers too."""
    from bench.compare_log import PHASES, compare

    tree = Path(__file__).resolve().parent.parent
    for headers in (False, True):
        lines = compare(1, {"a": tree, "b": tree}, 2000, headers)
        summary = [line for line in lines if line.startswith("SUMMARY")]
        assert len(summary) == 2 and all(f"{p} " in summary[1] for p in PHASES)
        assert "(1.000x a)" in summary[0]
