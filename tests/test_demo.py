"""`filemq demo`: the real end-to-end run (--quick) and the demo's own bookkeeping.

The real run needs every command and Java (Spark). The other tests drive the orchestration
with a stand-in `filemq` whose agent and collector are plain `filemq broker` processes, so
the sensors, the kill -9, the restarts and the failure reporting are exercised in seconds,
and a pipeline that loses everything must be reported as such.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

import cli
from demo import pipeline as demo_module
from demo.pipeline import DEVICE_ID, DemoError, DemoOptions, DemoResult, format_summary, run_demo

REPO = Path(__file__).resolve().parent.parent
FILEMQ = Path(sys.executable).parent / "filemq"

FAKE_FILEMQ = textwrap.dedent(
    """
    import json, os, sys
    args = sys.argv[1:]
    cmd = args[0]
    missing = set(filter(None, os.environ.get("FAKE_MISSING", "").split(",")))
    if "--help" in args:
        sys.exit(2 if cmd in missing else 0)
    if cmd == os.environ.get("FAKE_BROKEN"):
        print(f"fake {cmd}: refusing to start on purpose", flush=True)
        sys.exit(1)
    if cmd in ("agent", "collector"):
        flags = dict(zip(args[1::2], args[2::2]))
        os.execv(sys.executable, [sys.executable, "-m", "cli", "broker",
                                  "--data-dir", flags["--data-dir"], "--port", flags["--port"]])
    if cmd == "status":
        print(json.dumps({"groups": [{"name": "export.collector", "lag": 0}, {"name": "lander", "lag": 0}]}))
        sys.exit(0)
    sys.exit(2)
    """
)


@pytest.fixture
def fake_filemq(tmp_path: Path) -> list[str]:
    script = tmp_path / "fake_filemq.py"
    script.write_text(FAKE_FILEMQ)
    return [sys.executable, str(script)]


def _short(**overrides: object) -> DemoOptions:
    return DemoOptions.quick(online_s=1.0, uplink_down_s=1.0, power_off_s=0.5, agent_back_s=1.5,
                             drain_cut_after_s=0.5, flicker_off_s=0.3, uplink_back_s=1.0,
                             start_timeout_s=20.0, **overrides)


def test_a_pipeline_that_lands_nothing_is_reported_as_losing_every_acked_message(
    tmp_path: Path, fake_filemq: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stand-in agent is a real broker (it stores and acks); the stand-in collector lands
    # nothing and there is no ingest: every acknowledged message must count as lost.
    monkeypatch.setenv("FAKE_MISSING", "ingest")
    events: list[demo_module.DemoProgress] = []
    result = run_demo(_short(work_dir=tmp_path / "run", filemq_command=fake_filemq), events.append)

    assert result.acknowledged > 0
    assert result.published >= result.acknowledged
    assert result.lost == result.acknowledged
    assert result.failed_phase == "verify"
    assert not result.ok
    assert result.missing == ["ingest"]
    assert result.lost_sample and all(m.startswith("s") for m in result.lost_sample)
    statuses = {p.name: p.status for p in result.phases}
    assert statuses["power cut"] == "ok"
    assert statuses["ingest"] == "not yet available: filemq ingest"
    assert statuses["verify"] == "failed"
    assert statuses["power flicker"] == "ok"
    # The agent really was killed twice and started again on the same data dir.
    agent_log = (tmp_path / "run" / "logs" / "agent.log").read_text()
    assert agent_log.count("=== filemq demo: start #") == 3
    assert any(e.kind == "status" for e in events)
    assert (tmp_path / "run").exists()  # kept for a person to look at
    assert "FAILED in phase 'verify'" in format_summary(result)[0]


def test_a_service_that_does_not_start_names_the_phase_and_its_log(
    tmp_path: Path, fake_filemq: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_BROKEN", "agent")
    result = run_demo(_short(work_dir=tmp_path / "run", filemq_command=fake_filemq))

    assert result.failed_phase == "start"
    assert result.log_file == str(tmp_path / "run" / "logs" / "agent.log")
    assert "refusing to start on purpose" in Path(result.log_file).read_text()
    assert any("refusing to start on purpose" in line for line in format_summary(result))  # the log's tail
    assert "exited with code 1" in (result.error or "")
    assert not result.ok


def test_cli_exit_3_and_json_when_commands_are_not_yet_available(
    tmp_path: Path, fake_filemq: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MISSING", "collector,ingest")
    monkeypatch.setattr(demo_module, "default_filemq_command", lambda: fake_filemq)
    outcome = CliRunner().invoke(cli.main, ["demo", "--quick", "--json", "--work-dir", str(tmp_path / "run")])

    assert outcome.exit_code == 3, outcome.output
    summary = json.loads(outcome.stdout.splitlines()[0])
    assert summary["ok"] is False
    assert summary["missing"] == ["collector", "ingest"]
    assert summary["phases"] == [{"name": "start", "seconds": 0.0, "status": "not yet available: filemq collector"}]


def _landing_rows(offsets: list[int], ids: list[str]) -> dict[str, Sequence[object]]:
    now = datetime.now(UTC)
    return {
        "device_id": [DEVICE_ID] * len(offsets),
        "stream": ["main"] * len(offsets),
        "offset": offsets,
        "topic": ["sensors/s1/env"] * len(offsets),
        "qos": [1] * len(offsets),
        "publish_ts": [now] * len(offsets),
        "received_at": [now] * len(offsets),
        "collector_id": ["c1"] * len(offsets),
        "payload": [json.dumps({"id": i, "temperature": 1.0, "humidity": 2.0}).encode() for i in ids],
        "schema_version": [1] * len(offsets),
    }


def test_verify_counts_landed_duplicates_resends_and_lost_messages(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    # The rows below have the ten columns of landing schema version 1 (an older collector's files).
    from collector.landing import LANDING_SCHEMA_V1 as LANDING_SCHEMA

    part = tmp_path / "landing" / "incoming" / "dt=2026-01-01"
    part.mkdir(parents=True)
    # Offsets 0-3 landed, 2 and 3 twice (a re-landed roll); offset 3 is a QoS 1 resend of id a.
    pq.write_table(pa.table(_landing_rows([0, 1, 2], ["a", "b", "c"]), schema=LANDING_SCHEMA), part / "f1.parquet")
    pq.write_table(pa.table(_landing_rows([2, 3], ["c", "a"]), schema=LANDING_SCHEMA), part / "f2.parquet")
    (part / "_ignored.parquet").write_bytes(b"not parquet, and hidden")
    table_part = tmp_path / "table" / "dt=2026-01-01"
    table_part.mkdir(parents=True)
    # The curated table lost offset 1 (id b): the demo must say so.
    pq.write_table(pa.table(_landing_rows([0, 2, 3], ["a", "c", "a"]), schema=LANDING_SCHEMA),
                   table_part / "part-0.parquet")

    state = demo_module._Demo(DemoOptions(), tmp_path, lambda _e: None)
    with pytest.raises(DemoError) as caught:
        state._verify({"a", "b", "c"}, ingest_ran=True)
    result = state.result
    assert caught.value.phase == "verify"
    assert (result.landed_rows, result.landing_files, result.table_rows) == (5, 2, 3)
    assert result.duplicates_removed == 2
    assert result.resent_by_qos1 == 1
    assert result.duplicate_keys_in_table == 0
    assert (result.lost, result.lost_sample) == (1, ["b"])


def test_summary_and_exit_status_of_a_clean_result() -> None:
    result = DemoResult(work_dir="/tmp/x", published=10, acknowledged=9, landed_rows=12, landing_files=3,
                        table_rows=9, duplicates_removed=3, duplicate_keys_in_table=0, resent_by_qos1=0, lost=0)
    assert result.ok
    lines = format_summary(result)
    assert lines[0] == "filemq demo: OK, lost: 0 of 9 acknowledged messages"
    assert any(line.split()[:1] == ["lost"] and line.split()[1] == "0" for line in lines)
    result.lost = 1
    assert not result.ok


@pytest.mark.slow
def test_quick_demo_end_to_end_loses_nothing(tmp_path: Path) -> None:
    missing = [c for c in demo_module.REQUIRED_COMMANDS if c not in cli.main.commands]
    if missing:
        pytest.skip("not yet available: " + ", ".join(f"filemq {c}" for c in missing))
    if not demo_module.java_available():
        pytest.skip("Java is not installed (no java on PATH, no JAVA_HOME): Spark cannot run the ingest")
    if not FILEMQ.exists():
        pytest.skip(f"the filemq console script is not installed next to {sys.executable}")
    work = tmp_path / "demo"
    proc = subprocess.run([str(FILEMQ), "demo", "--quick", "--json", "--work-dir", str(work)],
                          capture_output=True, text=True, timeout=280, cwd=REPO)
    summary_lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert summary_lines, f"no JSON summary; exit {proc.returncode}\n{proc.stderr[-3000:]}"
    summary = json.loads(summary_lines[-1])
    assert proc.returncode == 0, f"{summary}\n{proc.stderr[-3000:]}"
    assert summary["ok"] is True
    assert summary["lost"] == 0
    assert summary["acknowledged"] > 0
    assert summary["table_rows"] >= summary["acknowledged"]
    assert summary["duplicate_keys_in_table"] == 0
    assert summary["landed_rows"] == summary["table_rows"] + summary["duplicates_removed"]
    assert [p["status"] for p in summary["phases"]] == ["ok"] * len(summary["phases"])


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("interrupt", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_demo_stops_every_process_it_started(tmp_path: Path, interrupt: signal.Signals) -> None:
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("needs /proc to find leftover processes")
    if "agent" not in cli.main.commands or "collector" not in cli.main.commands:
        pytest.skip("not yet available: filemq agent / filemq collector")
    work = tmp_path / "demo"
    # A shell starts a background job (`make test &`, CI runners) with SIGINT ignored, and a
    # child inherits that: the demo would rightly ignore Ctrl-C as a background job does.
    # Spawn it as from a terminal: SIGINT at its default (a Python handler becomes SIG_DFL
    # across exec; an ignored signal would stay ignored).
    inherited = signal.getsignal(signal.SIGINT)
    if inherited is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "demo", "--quick", "--json", "--work-dir", str(work)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    finally:
        if inherited is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        agent_log = work / "logs" / "agent.log"
        for _ in range(300):  # until the agent has started and the sensors publish
            if agent_log.exists() and "start #1" in agent_log.read_text() and _processes_mentioning(str(work)):
                break
            time.sleep(0.1)
        time.sleep(2.0)
        assert _processes_mentioning(str(work / "agent")), "the agent is not running"
        proc.send_signal(interrupt)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-2000:]
    summary = json.loads(out.splitlines()[0])
    assert summary["failed_phase"] in {"online", "uplink cut", "power cut", "uplink back", "power flicker"}
    assert "interrupted" in summary["error"]
    assert _processes_mentioning(str(work)) == []
