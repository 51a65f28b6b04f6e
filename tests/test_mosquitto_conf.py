"""Mosquitto users move in (issue 33 item 17; docs/CONFIG.md "From Mosquitto").

``filemq broker --mosquitto-conf FILE`` (and ``agent``) and ``filemq mosquitto-conf FILE``:
tested on the ``mosquitto.conf`` Debian ships and on one with every option the conversion
takes (listeners, TLS files with a CRL, a password file made by ``mosquitto_passwd``, an ACL
file, limits, persistence_location), with the real ``filemq broker`` process; every option
not taken is named with its reason; ``persistence false`` and ``per_listener_settings true``
exit 2.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from filemq.broker.server import free_port
from filemq.common.config import load_config
from filemq.mqtt.client import ConnectionRefused, MQTTClient
from filemq.ops.mosquitto_conf import convert
from tests import mosquitto
from tests.broker_process import REPO
from tests.tls_material import Crl, client_ctx, make_ca, signed_cert

pytestmark = pytest.mark.timeout(90)
DEBIAN_CONF = Path("/etc/mosquitto/mosquitto.conf")
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _start(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "cli", "broker", *args], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("filemq broker listening"):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"the broker did not start: {line!r} {err}")
    return proc, line


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    _, err = proc.communicate(timeout=20)
    return err


@pytest.mark.skipif(not DEBIAN_CONF.exists(), reason="Debian's /etc/mosquitto/mosquitto.conf is not installed")
def test_debian_shipped_mosquitto_conf(tmp_path: Path) -> None:
    """Debian's file: persistence true and its location are taken (data_dir), include_dir is
    followed (conf.d holds no .conf), pid_file and log_dest are named with the reason; the
    real broker starts with it (data directory and port from flags, which win)."""
    conv = convert(DEBIAN_CONF)
    assert conv.values == {"data_dir": "/var/lib/mosquitto/"} and conv.listeners == [] and not conv.refused
    named = {n.option.split()[0]: n.reason for n in conv.ignored}
    assert set(named) == {"pid_file", "log_dest"}
    assert "systemd" in named["pid_file"] and "stderr" in named["log_dest"]
    toml = _cli("mosquitto-conf", str(DEBIAN_CONF))
    assert toml.returncode == 0 and 'data_dir = "/var/lib/mosquitto/"' in toml.stdout
    assert "pid_file" in toml.stderr and "log_dest" in toml.stderr
    proc, line = _start("--mosquitto-conf", str(DEBIAN_CONF), "--data-dir", str(tmp_path / "data"), "--port", "0")
    err = _stop(proc)
    assert "127.0.0.1:" in line
    assert "mosquitto.conf option not taken" in err and "pid_file" in err and "log_dest" in err
    assert (tmp_path / "data").is_dir()


@pytest.mark.skipif(not mosquitto.available(), reason="Debian mosquitto (mosquitto_passwd) is not installed")
def test_every_option_the_conversion_takes_with_the_real_broker(tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "ca")
    server = signed_cert(tmp_path, "server", "localhost", ca)
    device = signed_cert(tmp_path, "device", "dev-7", ca)
    crl = Crl(tmp_path, ca)
    passwd = tmp_path / "passwd"
    subprocess.run([mosquitto.MOSQUITTO_PASSWD, "-b", "-c", str(passwd), "alice", "alice-pw"], check=True,
                   capture_output=True)
    acl = tmp_path / "acl"
    acl.write_text("user alice\ntopic readwrite a/#\n\nuser dev-7\ntopic write d/#\n")
    plain, tls = free_port(), free_port()
    data = tmp_path / "data"
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"""# every option filemq takes
per_listener_settings false
persistence true
persistence_location {data}/
password_file {passwd}
acl_file {acl}
allow_anonymous false
max_packet_size 65536
message_size_limit 32768
max_keepalive 120
max_inflight_messages 50
sys_interval 5

listener {plain} 127.0.0.1
max_connections 200
protocol mqtt

listener {tls} 127.0.0.1
certfile {server[0]}
keyfile {server[1]}
cafile {ca[0]}
crlfile {crl.path}
require_certificate true
use_identity_as_username true
""")
    conv = convert(conf)
    assert not conv.ignored and not conv.refused
    assert conv.values == {
        "data_dir": f"{data}/", "broker.password_file": str(passwd), "broker.acl_file": str(acl),
        "broker.allow_anonymous": False, "broker.max_packet_size": 65536, "broker.message_size_limit": 32768,
        "broker.keepalive_max": 120, "broker.max_inflight": 50, "broker.sys_interval_s": 5,
        "broker.max_connections": 200,
    }
    assert conv.listeners == [
        {"host": "127.0.0.1", "port": plain, "protocol": "mqtt"},
        {"host": "127.0.0.1", "port": tls, "tls_cert": str(server[0]), "tls_key": str(server[1]),
         "tls_ca": str(ca[0]), "tls_crl": str(crl.path), "require_certificate": True,
         "use_identity_as_username": True},
    ]
    # The TOML that `filemq mosquitto-conf` prints loads to the same configuration.
    out = _cli("mosquitto-conf", str(conf))
    assert out.returncode == 0, out.stderr
    (tmp_path / "converted.toml").write_text(out.stdout)
    assert load_config(tmp_path / "converted.toml") == load_config(None, conv.overrides())

    proc, _ = _start("--mosquitto-conf", str(conf))
    try:
        async def scenario() -> None:
            alice = MQTTClient("alice-1", port=plain, username="alice", password="alice-pw")
            await alice.connect()  # a Mosquitto $7$ hash, as mosquitto_passwd wrote it
            await alice.publish("a/x", b"hi", qos=1)
            await alice.disconnect()
            with pytest.raises(ConnectionRefused):
                await MQTTClient("anon", port=plain).connect()  # allow_anonymous false
            dev = MQTTClient("dev-7", port=tls, ssl=client_ctx(ca[0], device))
            await dev.connect()  # the certificate's CN is the username (use_identity_as_username)
            await dev.publish("d/1", b"x", qos=1)
            await dev.disconnect()

        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        _stop(proc)
    assert (data / "sessions").is_dir()  # persistence_location is the data directory


@pytest.mark.parametrize("line, why", [
    ("persistence false", "never keeps acknowledged messages in memory only"),
    ("per_listener_settings true", "one password_file and acl_file to every listener"),
])
def test_a_guarantee_weakening_option_exits_2_with_its_reason(tmp_path: Path, line: str, why: str) -> None:
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {free_port()} 127.0.0.1\nallow_anonymous true\n{line}\n")
    run = _cli("broker", "--mosquitto-conf", str(conf), "--data-dir", str(tmp_path / "d"))
    assert run.returncode == 2 and why in run.stderr and f"{conf}:3" in run.stderr, run.stderr
    assert not (tmp_path / "d").exists()  # nothing started
    assert _cli("mosquitto-conf", str(conf)).returncode == 2


def test_unknown_bridge_and_plugin_options_are_named_and_include_dir_is_followed(tmp_path: Path) -> None:
    inc = tmp_path / "conf.d"
    inc.mkdir()
    (inc / "b.conf").write_text("connection cloud\naddress cloud.example:8883\ntopic # out 1\n")
    (inc / "a.conf").write_text("auth_plugin /usr/lib/x.so\nauth_opt_db users\n")
    (inc / "notes.txt").write_text("max_packet_size 1\n")  # not a .conf: not read
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"include_dir {inc}\nfrobnicate yes\nmax_queued_messages 100\n")
    conv = convert(conf)
    assert [(Path(n.file).name, n.line, n.option.split()[0]) for n in conv.ignored] == [
        ("a.conf", 1, "auth_plugin"), ("a.conf", 2, "auth_opt_db"), ("b.conf", 1, "connection"),
        ("b.conf", 2, "address"), ("b.conf", 3, "topic"), ("mosquitto.conf", 2, "frobnicate"),
        ("mosquitto.conf", 3, "max_queued_messages")]
    reasons = [n.reason for n in conv.ignored]
    assert "[[export]]" in reasons[2] and "not a Mosquitto option" in reasons[5] and "log on disk" in reasons[6]
    assert conv.values == {}
