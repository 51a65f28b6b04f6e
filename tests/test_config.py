"""The config loader: defaults, overrides, and errors that name file, line and key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from filemq.common.config import (
    MIB,
    AutoSubscribe,
    Config,
    ConfigError,
    flag_for,
    flag_overrides,
    is_loopback,
    known_keys,
    load_config,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "filemq.toml"
    p.write_text(text)
    return p


def error_of(tmp_path: Path, text: str, overrides: dict[str, object] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides or {})
    return info.value


def test_no_file_gives_documented_defaults() -> None:
    c = load_config(None, {})
    assert c == Config()
    assert (c.broker.host, c.broker.port, c.log.fsync) == ("127.0.0.1", 1883, "always")
    assert c.broker.max_inflight == 32 and c.broker.max_packet_size == MIB
    assert c.broker.anonymous_allowed() and not c.broker.tls_enabled


def test_file_values_are_typed_and_sizes_accept_units(tmp_path: Path) -> None:
    c = load_config(
        write(
            tmp_path,
            """
data_dir = "/var/lib/filemq"
[log]
segment_bytes = "16 MiB"
fsync = "interval"
fsync_interval_ms = 50
retention_bytes = 1073741824
[broker]
port = 1999
password_file = "/etc/filemq/passwd"
auto_subscribe = [{filter = "cmd/%c/#", qos = 1}, "alerts/# qos 0"]
""",
        ),
        {},
    )
    assert c.data_dir == "/var/lib/filemq"
    assert c.log.segment_bytes == 16 * MIB and c.log.retention_bytes == 1 << 30
    assert (c.log.fsync, c.log.fsync_interval_ms) == ("interval", 50)
    assert c.broker.port == 1999 and c.broker.password_file == "/etc/filemq/passwd"
    assert c.broker.auto_subscribe == (AutoSubscribe("cmd/%c/#", 1), AutoSubscribe("alerts/#", 0))


def test_array_of_tables_auto_subscribe(tmp_path: Path) -> None:
    c = load_config(
        write(tmp_path, '[[broker.auto_subscribe]]\nfilter = "cmd/%c/#"\nqos = 2\n'), {}
    )
    assert c.broker.auto_subscribe == (AutoSubscribe("cmd/%c/#", 2),)


def test_overrides_win_over_file_and_none_is_not_an_override(tmp_path: Path) -> None:
    p = write(tmp_path, "[broker]\nport = 1999\nhost = \"127.0.0.2\"\n")
    c = load_config(p, {"broker.port": 1884, "broker.host": None, "data_dir": "d"})
    assert (c.broker.port, c.broker.host, c.data_dir) == (1884, "127.0.0.2", "d")


def test_flag_strings_are_coerced() -> None:
    c = load_config(None, {"broker.port": "2000", "broker.allow_anonymous": "true"})
    assert c.broker.port == 2000 and c.broker.allow_anonymous is True


def test_flag_overrides_maps_click_params_to_keys() -> None:
    params = {"data_dir": "d", "port": 1, "fsync": "never", "config": "x.toml", "tls_cert": None}
    assert flag_overrides("broker", params) == {
        "data_dir": "d",
        "broker.port": 1,
        "log.fsync": "never",
    }
    assert flag_overrides("collector", {"port": 7, "landing": "L"}) == {
        "collector.port": 7,
        "collector.landing": "L",
    }
    assert flag_for("broker.tls_cert") == "--tls-cert" and flag_for("data_dir") == "--data-dir"


def test_toml_syntax_error_carries_line_and_column(tmp_path: Path) -> None:
    e = error_of(tmp_path, "[broker]\nport = 1883\nhost = \n")
    assert e.file is not None and e.file.endswith("filemq.toml")
    assert e.line == 3 and e.column is not None
    assert "TOML syntax error" in str(e) and "filemq.toml" in str(e)


def test_unknown_key_suggests_the_close_one(tmp_path: Path) -> None:
    e = error_of(tmp_path, "# comment\n\n[brokr]\nport = 1884\n")
    assert e.key == "brokr.port" and e.line == 4
    assert "unknown key 'brokr.port' at line 4; did you mean 'broker.port'?" in str(e)
    e = error_of(tmp_path, "[broker]\nhost = \"127.0.0.1\"\nprot = 1\n")
    assert e.line == 3 and "did you mean 'broker.port'?" in e.message
    e = error_of(tmp_path, "[log]\nfsynk = \"never\"\n")
    assert "did you mean 'log.fsync'?" in e.message


def test_unknown_override_is_reported_as_a_flag() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"broker.prot": 1})
    assert info.value.file == "<command line>" and "did you mean 'broker.port'" in str(info.value)


def test_wrong_type_names_key_line_expectation_and_value(tmp_path: Path) -> None:
    e = error_of(tmp_path, "[broker]\nhost = \"127.0.0.1\"\n\n\nport = \"abc\"\n")
    assert e.key == "broker.port" and e.line == 5
    assert e.message == "broker.port at line 5 must be an integer 0-65535 (0 = any free port), got 'abc'"
    assert error_of(tmp_path, "[broker]\nport = 70000\n").line == 2
    # TOML booleans are not integers even though Python's bool subclasses int
    assert error_of(tmp_path, "[broker]\nmax_inflight = true\n").key == "broker.max_inflight"


def test_bad_enum_lists_the_choices(tmp_path: Path) -> None:
    e = error_of(tmp_path, "[log]\nfsync = \"sometimes\"\n")
    assert e.line == 2 and "'always', 'interval', 'never'" in e.message
    assert "'sometimes'" in e.message


def test_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"log.fsync": "maybe"})
    assert "(flag --fsync)" in info.value.message and info.value.line is None


@pytest.mark.parametrize(
    "text",
    [
        'auto_subscribe = [{filter = "a/#/b", qos = 1}]',
        'auto_subscribe = [{filter = "a/b", qos = 3}]',
        'auto_subscribe = [{filter = "a/b", qos = 1, extra = 2}]',
        'auto_subscribe = ["a/b+ qos 1"]',
        "auto_subscribe = 5",
    ],
)
def test_bad_auto_subscribe_rules(tmp_path: Path, text: str) -> None:
    e = error_of(tmp_path, f"[broker]\n{text}\n")
    assert e.key == "broker.auto_subscribe" and e.line == 2


def test_section_must_be_a_table(tmp_path: Path) -> None:
    e = error_of(tmp_path, "broker = 5\n")
    assert e.key == "broker" and e.line == 1


def test_tls_cert_without_key(tmp_path: Path) -> None:
    e = error_of(tmp_path, "[broker]\ntls_cert = \"c.pem\"\n")
    assert e.key == "broker.tls_cert" and e.line == 2 and "broker.tls_key" in e.message
    c = load_config(write(tmp_path, "[broker]\ntls_cert = \"c.pem\"\ntls_key = \"k.pem\"\n"))
    assert c.broker.tls_enabled and c.broker.tls_port == 8883


def test_non_loopback_without_password_file_says_how_to_fix(tmp_path: Path) -> None:
    e = error_of(tmp_path, "[broker]\n\nhost = \"0.0.0.0\"\n")
    assert e.key == "broker.host" and e.line == 3
    for fix in ("filemq passwd FILE USER", "password_file", "allow_anonymous = true"):
        assert fix in e.message
    with pytest.raises(ConfigError) as info:
        load_config(None, {"broker.host": "192.168.1.10"})
    assert "(flag --host)" in info.value.message
    open_ = load_config(write(tmp_path, "[broker]\nhost = \"0.0.0.0\"\nallow_anonymous = true\n"))
    assert open_.broker.anonymous_allowed()
    closed = load_config(None, {"broker.host": "::", "broker.password_file": "pw"})
    assert not closed.broker.anonymous_allowed()
    e = error_of(tmp_path, "[collector]\nhost = \"10.0.0.1\"\n")
    assert e.key == "collector.host"


def test_allow_anonymous_false_without_password_file(tmp_path: Path) -> None:
    e = error_of(tmp_path, "[broker]\nallow_anonymous = false\n")
    assert e.key == "broker.allow_anonymous" and e.line == 2


def test_agent_combinations(tmp_path: Path) -> None:
    e = error_of(tmp_path, "[agent]\npassword = \"x\"\npassword_file = \"f\"\n")
    assert e.key == "agent.password"
    e = error_of(tmp_path, "[agent]\nbackoff_initial_ms = 5000\nbackoff_max_ms = 100\n")
    assert e.key == "agent.backoff_initial_ms" and e.line == 2
    e = error_of(tmp_path, "[agent]\ncollector = \"nohostport\"\n")
    assert e.key == "agent.collector" and "host:port" in e.message
    c = load_config(write(tmp_path, "[agent]\ncollector = \"collector.example:8883\"\n"))
    assert c.agent.collector == "collector.example:8883"


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")
    p = tmp_path / "bin.toml"
    p.write_bytes(b"data_dir = \"\xff\"\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(p)


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("::1")
    assert is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("example.org")


def test_every_key_is_documented_with_its_flag() -> None:
    text = DOCS.read_text()
    rows = set(re.findall(r"^\|\s*`([a-z_.]+)`\s*\|\s*`(--[a-z-]+)`", text, re.MULTILINE))
    documented = {key for key, _ in rows}
    assert set(known_keys()) <= documented, set(known_keys()) - documented
    for key, flag in rows:
        assert flag == flag_for(key), key
