"""Exports in the configuration: ``[[export]]`` tables, ``--export NAME=URL`` flags and the
``--collector`` shorthand, resolved and checked by :func:`filemq.common.config.load_config`
(docs/FORWARDING.md, "Configuration")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import cli
from filemq.common.config import ConfigError, ExportSection, flag_overrides, load_config


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "filemq.toml"
    p.write_text(text)
    return p


def agent_config(args: list[str]) -> Any:
    cmd = cli.main.commands["agent"]
    ctx = cmd.make_context("agent", args)
    return load_config(ctx.params.get("config_file"), flag_overrides("agent", ctx.params))


def test_export_tables_are_typed_with_defaults(tmp_path: Path) -> None:
    c = load_config(write(tmp_path, """
[uplink]
rate_limit_bytes_per_s = "1 MiB"

[[export]]
name = "cloud"
url = "mqtts://broker.example.com"
topics = ["alarms/#", "sensors/+/temp"]
topic_template = "site/{device_id}/{topic}"
qos = 2
priority = 10
tls_ca = "/etc/ca.pem"
tls_cert = "/etc/dev.pem"
tls_key = "/etc/dev.key"

[[export]]
name = "dc"
url = "filemq://10.0.0.2:1884"
compression = "zlib"
enabled = false
"""), {})
    cloud, dc = c.exports
    assert (cloud.name, cloud.kind, cloud.host, cloud.port, cloud.tls) == ("cloud", "mqtt", "broker.example.com", 8883, True)
    assert cloud.topics == ("alarms/#", "sensors/+/temp") and cloud.qos == 2 and cloud.priority == 10
    assert cloud.group_name == "export.cloud" and cloud.retain and cloud.enabled
    assert (dc.kind, dc.port, dc.tls, dc.compression, dc.enabled) == ("filemq", 1884, False, "zlib", False)
    assert dc.topics == ("#",) and dc.topic_template == "{topic}"
    assert c.uplink.rate_limit_bytes_per_s == 1 << 20


def test_export_flag_is_repeatable_and_collector_is_the_shorthand() -> None:
    c = agent_config(["--export", "cloud=mqtt://127.0.0.1:1999", "--export", "lab=mqtt://[::1]",
                      "--collector", "127.0.0.1:1884", "--uplink-rate-limit", "1000000"])
    assert [(e.name, e.url) for e in c.exports] == [
        ("cloud", "mqtt://127.0.0.1:1999"), ("lab", "mqtt://[::1]"), ("collector", "filemq://127.0.0.1:1884")]
    assert c.exports[1].port == 1883 and c.exports[1].host == "::1"
    assert c.uplink.rate_limit_bytes_per_s == 1_000_000


def test_export_flag_overrides_the_url_of_the_table_of_that_name(tmp_path: Path) -> None:
    conf = write(tmp_path, '[[export]]\nname = "cloud"\nurl = "mqtt://a:1"\nqos = 2\n')
    c = agent_config(["--config", str(conf), "--export", "cloud=mqtts://b:2"])
    assert c.exports == (ExportSection("cloud", "mqtts://b:2", qos=2),)


def test_collector_shorthand_carries_the_agent_login_and_tls() -> None:
    c = load_config(None, {"agent.collector": "h:1884", "agent.username": "u", "agent.tls_ca": "/ca.pem"})
    (e,) = c.exports
    assert (e.name, e.url, e.username, e.tls_ca, e.kind) == ("collector", "filemqs://h:1884", "u", "/ca.pem", "filemq")


@pytest.mark.parametrize(("text", "expected"), [
    ('[[export]]\nurl = "mqtt://h"\n', "[[export]] #1 at line 1: 'name' is required"),
    ('[[export]]\nname = "a"\n', "[[export]] #1 at line 1: 'url' is required"),
    ('[[export]]\nname = "a"\nurl = "http://h"\n', "url must be a URL filemq://HOST:PORT"),
    ('[[export]]\nname = "a"\nurl = "filemq://h"\n', "url must be a URL filemq://HOST:PORT"),
    ('[[export]]\nname = "a"\nurl = "mqtt://user:pw@h"\n', "without user, password or path"),
    ('[[export]]\nname = "a b"\nurl = "mqtt://h"\n', "name must be a name of 1-64 letters"),
    ('[[export]]\nname = "a"\nurl = "mqtt://h"\nqos = 0\n', "qos must be an integer 1-2, got 0"),
    ('[[export]]\nname = "a"\nurl = "mqtt://h"\ntopics = ["a/#/b"]\n', "topics must be a non-empty list of valid MQTT"),
    ('[[export]]\nname = "a"\nurl = "mqtt://h"\ntopic_template = "x/{host}"\n', "topic_template must be a string using only"),
    ('[[export]]\nname = "a"\nurl = "mqtt://h"\nqso = 1\n', "unknown key 'qso'; did you mean 'qos'?"),
    ('[[export]]\nname = "a"\nurl = "mqtt://h"\npassword = "x"\n', "unknown key 'password'"),
    ('[[export]]\nname = "a"\nurl = "mqtt://h"\n\n[[export]]\nname = "a"\nurl = "mqtt://g"\n',
     "[[export]] #2 at line 5: export name 'a' is used twice"),
    ('[[export]]\nname = "a"\nurl = "mqtt://h"\ncompression = "zlib"\n',
     "export 'a': compression only apply to filemq:// collector exports"),
    ('[[export]]\nname = "a"\nurl = "mqtts://h"\ntls_cert = "c.pem"\n', "tls_cert and tls_key go together"),
    ('[[export]]\nname = "a"\nurl = "mqtt://h"\ntls_ca = "ca.pem"\n', "use mqtts://"),
    ('export = 3\n', "'export' must be an array of tables"),
])
def test_bad_export_tables_say_which_table_and_how_to_fix(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), {})
    assert expected in str(err.value), str(err.value)
    assert str(err.value).startswith(str(tmp_path / "filemq.toml"))


@pytest.mark.parametrize("value", ["cloud", "=mqtt://h", "cloud=ftp://h", "a b=mqtt://h"])
def test_bad_export_flag_names_the_flag(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        agent_config(["--export", value])
    assert "(flag --export)" in str(err.value) and "NAME=URL" in str(err.value)


def test_collector_shorthand_and_a_collector_table_conflict(tmp_path: Path) -> None:
    conf = write(tmp_path, '[[export]]\nname = "collector"\nurl = "filemq://h:1"\n')
    with pytest.raises(ConfigError) as err:
        agent_config(["--config", str(conf), "--collector", "h:2"])
    assert "shorthand for an export named 'collector'" in str(err.value)


def test_agent_with_only_an_mqtt_export_needs_no_collector() -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli.main, ["agent", "--data-dir", "/nonexistent-x", "--device-id", "d"])
    assert result.exit_code == 2 and "missing --collector or --export" in result.output


def test_agent_rate_limit_is_the_collector_exports_own_cap(tmp_path: Path) -> None:
    """`agent.rate_limit_bytes_per_s` (from before exports) still caps the collector export."""
    import asyncio

    from worker_agent.app import Agent

    async def scenario() -> None:
        agent = Agent(load_config(None, {
            "data_dir": str(tmp_path), "broker.port": 0, "agent.device_id": "d", "log.fsync": "never",
            "agent.collector": "127.0.0.1:1", "agent.rate_limit_bytes_per_s": 1000,
            "agent.export": ["cloud=mqtt://127.0.0.1:1"]}))
        await agent.start()
        try:
            collector, cloud = agent.exports.get("collector"), agent.exports.get("cloud")
            assert collector is not None and cloud is not None
            assert collector.runner is not None and collector.runner._bucket is not None  # type: ignore[union-attr]
            assert cloud.runner is not None and cloud.runner._limiter is None  # type: ignore[union-attr]
        finally:
            await agent.stop()

    asyncio.run(scenario())
