"""Every config key has a flag on the commands that read it, and the flag wins over the file
(ARCHITECTURE.md, "Command line": every key has a flag; flags override the file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import cli
from filemq.common.config import ConfigError, flag_overrides, load_config, section_keys

# command -> (its own section, other sections it reads, keys it takes from its own section instead)
COMMANDS: dict[str, tuple[str, tuple[str, ...], set[str]]] = {
    "broker": ("broker", (), set()),
    # broker.metrics_port is `filemq broker`'s: the agent serves broker metrics on agent.metrics_port.
    "agent": ("agent", ("broker", "uplink"), {"broker.metrics_port"}),
    "collector": ("collector", ("broker",), {"broker.host", "broker.port", "broker.password_file",
                                              "broker.acl_file", "broker.allow_anonymous",
                                              "broker.max_connections", "broker.metrics_port"}),
    "ingest": ("ingest", (), set()),
}


def _config(command: str, args: list[str], config_file: Path | None = None) -> Any:
    cmd = cli.main.commands[command]
    ctx = cmd.make_context(command, [*args, *(["--config", str(config_file)] if config_file else [])])
    own = COMMANDS[command][0]
    return load_config(ctx.params.get("config_file"), flag_overrides(own, ctx.params))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_key_of_a_command_has_a_flag_routed_to_it(command: str) -> None:
    own, others, skip = COMMANDS[command]
    params = {p.name for p in cli.main.commands[command].params}
    missing = []
    for section in (own, "log", *others) if command != "ingest" else (own,):
        for key, _ in section_keys(section):
            name = key.split(".", 1)[1]
            pname = name if section in (own, "log") else f"{section}__{name}"
            if key not in skip and pname not in params:
                missing.append(key)
    assert missing == []
    assert "data_dir" in params or command == "ingest"


def test_generated_flags_reach_the_config_and_beat_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "f.toml"
    conf.write_text('[broker]\nmax_connections = 7\n[log]\nsegment_bytes = "8 MiB"\n')
    from_file = _config("broker", ["--data-dir", str(tmp_path)], conf)
    assert from_file.broker.max_connections == 7 and from_file.log.segment_bytes == 8 << 20
    c = _config("broker", ["--max-connections", "5", "--segment-bytes", "1 MiB",
                           "--auto-subscribe", "cmd/%c/# qos 1", "--retention-ms", "60000"], conf)
    assert c.broker.max_connections == 5
    assert c.log.segment_bytes == 1 << 20 and c.log.retention_ms == 60000
    assert [(a.filter, a.qos) for a in c.broker.auto_subscribe] == [("cmd/%c/#", 1)]


def test_agent_broker_keys_and_its_own_keys_do_not_collide(tmp_path: Path) -> None:
    c = _config("agent", ["--password-file", "/up.pw", "--broker-password-file", "/local.pw",
                          "--port", "1999", "--max-inflight", "7", "--backoff-max-ms", "9000",
                          "--ack-timeout-ms", "1234"])
    assert c.agent.password_file == "/up.pw" and c.broker.password_file == "/local.pw"
    assert c.broker.port == 1999 and c.broker.max_inflight == 7
    assert c.agent.backoff_max_ms == 9000 and c.agent.ack_timeout_ms == 1234


def test_collector_allow_anonymous_and_ingest_keys(tmp_path: Path) -> None:
    c = _config("collector", ["--allow-anonymous", "true", "--max-connections", "3"])
    assert c.collector.allow_anonymous is True and c.collector.max_connections == 3
    conf = tmp_path / "i.toml"
    conf.write_text('[ingest]\nlanding = "/l"\ntable = "/t"\ncheckpoint = "/c"\nspark_master = "spark://h:7077"\n')
    i = _config("ingest", ["--every", "30", "--table", "/t2"], conf).ingest
    assert (i.landing, i.table, i.checkpoint, i.spark_master, i.every_s) == ("/l", "/t2", "/c", "spark://h:7077", 30)


def test_a_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(ConfigError) as err:
        _config("broker", ["--max-connections", "lots"])
    assert "flag --max-connections" in str(err.value) and "got 'lots'" in str(err.value)


@pytest.mark.parametrize(("command", "missing"), [
    ("broker", "--data-dir"),
    ("agent", "--data-dir, --device-id, --collector or --export"),
    ("collector", "--data-dir, --landing"),
])
def test_a_service_without_its_required_keys_exits_2_naming_them(command: str, missing: str) -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli.main, [command])
    assert result.exit_code == 2
    assert f"filemq {command}: missing {missing} (or the same keys in the config file)" in result.output


def test_a_bad_config_file_exits_2_with_file_and_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    conf = tmp_path / "bad.toml"
    conf.write_text("[broker]\nprot = 1884\n")
    result = CliRunner().invoke(cli.main, ["broker", "--config", str(conf), "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert str(conf) in result.output and "line 2" in result.output and "broker.port" in result.output


def test_message_size_limit_key_flag_and_default(tmp_path: Path) -> None:
    """``broker.message_size_limit`` (payload bytes): unset by default (today's maximum, bounded
    only by max_packet_size); a size from the file or the flag; out of range is an error."""
    assert _config("broker", []).broker.message_size_limit is None
    conf = tmp_path / "m.toml"
    conf.write_text('[broker]\nmessage_size_limit = "64 KiB"\n')
    assert _config("broker", [], conf).broker.message_size_limit == 64 << 10
    assert _config("broker", ["--message-size-limit", "1000"], conf).broker.message_size_limit == 1000
    with pytest.raises(ConfigError) as err:
        _config("broker", ["--message-size-limit", "0"])
    assert "flag --message-size-limit" in str(err.value)
