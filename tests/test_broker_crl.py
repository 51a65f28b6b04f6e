"""Certificate revocation on TLS listeners (issue 33 item 16; docs/CONFIG.md "[[listener]]").

``tls_crl`` (Mosquitto's ``crlfile``) holds a PEM CRL of the listener's ``tls_ca``: a client
certificate it revokes fails the TLS handshake, checked on every handshake, and the file is
re-read on SIGHUP, so a lost device's certificate is revoked without a restart.  The real
``filemq broker`` process, real openssl-made CA, certificates and CRLs, real SIGHUP.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from filemq.broker.server import free_port
from filemq.common.checks import Listener
from filemq.common.config import ConfigError
from filemq.mqtt.client import MQTTClient
from tests.broker_process import REPO, load_toml
from tests.tls_material import Crl, client_ctx, make_ca, signed_cert

pytestmark = pytest.mark.timeout(90)


async def _login(port: int, ctx: ssl.SSLContext, client_id: str) -> bool:
    """True when a TLS CONNECT with this client certificate gets CONNACK 0."""
    client = MQTTClient(client_id, port=port, ssl=ctx)
    try:
        await client.connect(timeout=5)
    except (ssl.SSLError, OSError, ConnectionError, TimeoutError, Exception):
        return False
    await client.disconnect()
    return True


def test_revoked_client_certificate_is_refused_after_sighup(tmp_path: Path) -> None:
    """Two devices with certificates of the listener's CA log in; bob's certificate is revoked
    and the CRL rewritten; after SIGHUP (no restart) bob's handshake fails and alice still
    logs in.  Before the reload the old CRL is in force (the file is read at start and on
    SIGHUP, not behind the operator's back)."""
    ca = make_ca(tmp_path, "devices-ca")
    server = signed_cert(tmp_path, "server", "localhost", ca)
    alice = signed_cert(tmp_path, "alice", "alice", ca)
    bob = signed_cert(tmp_path, "bob", "bob", ca)
    crl = Crl(tmp_path, ca)
    plain, tls = free_port(), free_port()
    conf = tmp_path / "filemq.toml"
    conf.write_text(f"""
[[listener]]
host = "127.0.0.1"
port = {plain}

[[listener]]
host = "127.0.0.1"
port = {tls}
tls_cert = "{server[0]}"
tls_key = "{server[1]}"
tls_ca = "{ca[0]}"
tls_crl = "{crl.path}"
require_certificate = true
use_identity_as_username = true
""")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "cli", "broker", "--config", str(conf), "--data-dir",
                             str(tmp_path / "data")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("filemq broker listening"), "the broker did not start"

        async def scenario() -> None:
            assert await _login(tls, client_ctx(ca[0], alice), "alice")
            assert await _login(tls, client_ctx(ca[0], bob), "bob")
            crl.revoke(bob[0])
            assert await _login(tls, client_ctx(ca[0], bob), "bob"), "the CRL changed without a reload"
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while await _login(tls, client_ctx(ca[0], bob), "bob"):
                assert time.monotonic() < deadline, "bob's revoked certificate still logs in after SIGHUP"
                await asyncio.sleep(0.2)
            assert await _login(tls, client_ctx(ca[0], alice), "alice")
            for _ in range(3):  # every handshake, not only the first after the reload
                assert not await _login(tls, client_ctx(ca[0], bob), "bob")

        asyncio.run(asyncio.wait_for(scenario(), 60))
        assert proc.poll() is None, "SIGHUP ended the broker"
    finally:
        proc.terminate()
        proc.wait(20)


def test_tls_crl_is_a_listener_key_and_flag_and_needs_tls_ca(tmp_path: Path) -> None:
    c = load_toml(tmp_path, '[[listener]]\nport = 8883\ntls_cert = "c.pem"\ntls_key = "k.pem"\ntls_ca = "ca.pem"\n'
                        'tls_crl = "crl.pem"\n')
    assert c.listener == (Listener(port=8883, tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem", tls_crl="crl.pem"),)
    f = load_toml(tmp_path, "", listener=("127.0.0.1:8883,tls_cert=c.pem,tls_key=k.pem,tls_ca=ca.pem,tls_crl=crl.pem",))
    assert f.listener == (Listener(host="127.0.0.1", port=8883, tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem",
                                   tls_crl="crl.pem"),)
    with pytest.raises(ConfigError, match="tls_crl revokes client certificates of tls_ca"):
        load_toml(tmp_path, '[[listener]]\nport = 8883\ntls_cert = "c.pem"\ntls_key = "k.pem"\ntls_crl = "crl.pem"\n')
