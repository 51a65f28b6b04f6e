"""A tiny run of the MQTT export drain of `filemq bench forward` so the benchmark keeps
working: every record arrives upstream, the rate is positive (never a timing threshold)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.forward import run_bridge
from bench.forward_mqtt import run_mqtt_export_drain
from tests import mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.mark.skipif(not mosquitto.available(), reason="Debian mosquitto is not installed")
@pytest.mark.parametrize("oracle", ["puback", "subscriber"])
def test_mqtt_export_drain_ships_every_record(tmp_path: Path, oracle: str) -> None:
    result = run_mqtt_export_drain(tmp_path / "export", 2000, 100, 60, oracle=oracle)
    assert result.name == "mqtt_export_drain" and result.records == 2000
    assert result.rate > 0 and "TIMED OUT" not in result.note
    assert result.cpu_seconds["agent"] > 0
    assert "export.up lag 0 after the agent stopped" in result.note


@pytest.mark.skipif(not mosquitto.available(), reason="Debian mosquitto is not installed")
def test_bridge_baseline_counts_the_remotes_pubacks(tmp_path: Path) -> None:
    result = run_bridge(tmp_path / "bridge", 2000, 100, 60, bridge_timeout=30, oracle="puback")
    assert result.name == "mosquitto_bridge_drain" and result.records == 2000
    assert result.rate > 0 and "TIMED OUT" not in result.note
