"""The ingest on a real standalone Spark cluster (master + worker on 127.0.0.1) via spark-submit.

Uses only what the pyspark package ships (``bin/spark-class``, ``bin/spark-submit``), runs
``spark_ingest/job.py`` exactly as docs/INGEST.md tells an operator to, and checks the table
with pyarrow. Every process is started in its own process group and killed with bounded waits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from collector.landing import LandingWriter
from filemq.broker.server import free_port
from spark_ingest.package import build_zip

pytestmark = [pytest.mark.spark, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = 90.0
SUBMIT_TIMEOUT = 240.0


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def spark_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(spark_home()),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(tmp / "logs"),
        SPARK_WORKER_DIR=str(tmp / "work"),
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
    )
    return env


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, then SIGKILL it if it has not gone within 20 s."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_until(what: str, check: object, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except (OSError, ValueError):
            # Not up yet: refused, or (seen once) the master's web UI answering /json/ with
            # its HTML page while it starts; the timeout bounds it and reports the logs.
            pass
        time.sleep(0.5)
    tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    pytest.fail(f"{what} not ready within {timeout:.0f} s\n{tails}")


def alive_workers(webui: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{webui}/json/", timeout=5) as response:
        state = json.load(response)
    return int(state.get("aliveworkers", 0))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    if shutil.which("java") is None:
        pytest.skip("the standalone Spark cluster needs a Java runtime (java not on PATH)")
    spark_class = spark_home() / "bin" / "spark-class"
    env = spark_env(tmp_path)
    port, webui, worker_webui = free_port(), free_port(), free_port()
    master_log, worker_log = tmp_path / "master.log", tmp_path / "worker.log"
    processes: list[subprocess.Popen[bytes]] = []
    try:
        with open(master_log, "wb") as out:
            processes.append(subprocess.Popen(
                [str(spark_class), "org.apache.spark.deploy.master.Master",
                 "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(webui)],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            ))
        url = f"spark://127.0.0.1:{port}"
        wait_until("master", lambda: alive_workers(webui) >= 0, START_TIMEOUT, [master_log])
        with open(worker_log, "wb") as out:
            processes.append(subprocess.Popen(
                [str(spark_class), "org.apache.spark.deploy.worker.Worker", url,
                 "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
                 "--webui-port", str(worker_webui), "--work-dir", str(tmp_path / "work")],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            ))
        wait_until("worker", lambda: alive_workers(webui) >= 1, START_TIMEOUT,
                   [master_log, worker_log])
        yield url
    finally:
        for process in reversed(processes):
            stop(process)
    assert all(p.poll() is not None for p in processes), "a cluster process survived"


def test_ingest_through_spark_submit_on_a_standalone_cluster(cluster: str, tmp_path: Path) -> None:
    landing, table, checkpoint = tmp_path / "landing", tmp_path / "table", tmp_path / "ckpt"
    writer = LandingWriter(landing, "c1")
    now = datetime(2026, 11, 20, 12, tzinfo=UTC)
    expected: set[tuple[str, int]] = set()
    for device, offsets in (("d1", range(0, 50)), ("d1", range(40, 80)), ("d2", range(0, 30))):
        writer.write([
            {"device_id": device, "stream": "s", "offset": o, "topic": "t", "qos": 1,
             "publish_ts": now + timedelta(seconds=o), "received_at": now + timedelta(hours=1),
             "payload": json.dumps({"temperature": o / 2}).encode()}
            for o in offsets
        ])
        expected |= {(device, o) for o in offsets}
    py_files = build_zip(tmp_path / "dist" / "filemq.zip")
    submit = spark_home() / "bin" / "spark-submit"
    command = [
        str(submit), "--master", cluster, "--py-files", str(py_files),
        "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.executor.memory=512m",
        str(REPO / "spark_ingest" / "job.py"),
        "--landing", str(landing), "--table", str(table), "--checkpoint", str(checkpoint),
        "--payload-schema", "temperature double",
    ]
    try:
        done = subprocess.run(command, env=spark_env(tmp_path), cwd=tmp_path, capture_output=True,
                              timeout=SUBMIT_TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"spark-submit did not finish within {SUBMIT_TIMEOUT:.0f} s: {exc.stderr!r}")
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-5000:]
    lines = [json.loads(line) for line in done.stdout.decode().splitlines() if line.startswith("{")]
    summary = lines[-1]
    assert summary["event"] == "summary"
    assert (summary["rows_in"], summary["rows_written"]) == (120, len(expected))
    assert summary["duplicates_removed"] == 120 - len(expected)

    rows = ds.dataset(table, format="parquet", partitioning="hive").to_table().to_pylist()
    keys = Counter((r["device_id"], r["offset"]) for r in rows)
    assert set(keys) == expected and max(keys.values()) == 1
    assert {r["temperature"] for r in rows if r["device_id"] == "d2"} == {o / 2 for o in range(30)}
    # The job ran on the cluster: the worker started an executor for it.
    assert any((tmp_path / "work").glob("app-*/*")), "no executor ran on the worker"
