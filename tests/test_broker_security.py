"""Logins, session ownership, shared-subscription scoping and ACL reload (issue 10 items 4-6,
issue 11 item 4), driven at packet level through the core without sockets (see
tests/test_broker_session.py for the harness)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from filemq.acl import Acl
from filemq.auth import PasswordFile, add_or_update
from filemq.config import BrokerSection, CollectorSection
from filemq.mqtt.packets import Connack, Connect, Publish, Puback, Subscribe
from tests.test_broker_session import Harness, run

CONNACK_NOT_AUTHORIZED = 0x05


def _with_logins(h: Harness, pw_file: Path, acl_text: str | None = None) -> None:
    h.core.passwords = PasswordFile.load(pw_file)
    if acl_text is not None:
        h.core.acl = Acl.parse(acl_text)


def _users(tmp_path: Path, *users: str) -> Path:
    pw_file = tmp_path / "pw"
    for user in users:
        add_or_update(pw_file, user, user + "-pw", iterations=1000)
    return pw_file


async def _login(h: Harness, client_id: str, user: str, clean: bool = True) -> tuple[object, Connack]:
    """CONNECT as ``user`` (password ``<user>-pw``), waiting for the threaded password check."""
    c = h.client()
    c.send(Connect(client_id=client_id, clean_session=clean, username=user,
                   password=(user + "-pw").encode()))
    for _ in range(500):
        out = c.received()
        if out:
            c._left = out[1:]
            assert isinstance(out[0], Connack), out
            return c, out[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no CONNACK for {client_id!r}")


# ---- issue 10 item 4: a password file means a login is required ----------------------------


def test_password_file_on_loopback_refuses_anonymous_with_0x05(tmp_path: Path) -> None:
    """MQTT 3.1.1 §3.2.2.3 (0x05 not authorized): with a password file set and ``allow_anonymous`` unset, an
    anonymous CONNECT is refused on a loopback listener too (it used to get in)."""
    pw_file = _users(tmp_path, "alice")

    async def main() -> None:
        h = Harness(tmp_path, host="127.0.0.1", password_file=str(pw_file))
        _with_logins(h, pw_file)
        anon = h.client()
        assert anon.connect("anon").return_code == CONNACK_NOT_AUTHORIZED
        assert anon.conn.closed
        c, connack = await _login(h, "a", "alice")
        assert connack.return_code == 0
    run(main())


def test_allow_anonymous_true_lets_anonymous_in_beside_a_password_file(tmp_path: Path) -> None:
    pw_file = _users(tmp_path, "alice")

    async def main() -> None:
        h = Harness(tmp_path, host="127.0.0.1", password_file=str(pw_file), allow_anonymous=True)
        _with_logins(h, pw_file)
        assert h.client().connect("anon").return_code == 0
    run(main())


def test_anonymous_rule_of_broker_and_collector_sections() -> None:
    assert BrokerSection().anonymous_allowed()  # no password file: anonymous on loopback
    assert not BrokerSection(password_file="pw").anonymous_allowed()
    assert not BrokerSection(host="::1", password_file="pw").anonymous_allowed()
    assert BrokerSection(password_file="pw", allow_anonymous=True).anonymous_allowed()
    assert CollectorSection().anonymous_allowed()
    assert not CollectorSection(password_file="pw").anonymous_allowed()
    assert CollectorSection(password_file="pw", allow_anonymous=True).anonymous_allowed()
