"""Logins, session ownership, shared-subscription scoping and ACL reload (issue 10 items 4-6,
issue 11 item 4), driven at packet level through the core without sockets (see
tests/broker_harness.py for the harness)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from filemq.broker.acl import Acl
from filemq.broker.auth import add_or_update
from filemq.broker.session_store import SessionStore, StoredSession, StoredSubscription
from filemq.common.config import BrokerSection, CollectorSection
from filemq.mqtt.packets import Connack, Connect, Puback, Publish, Subscribe
from tests.broker_harness import Client, Harness, run, users_file, with_logins

CONNACK_NOT_AUTHORIZED = 0x05


async def _login(h: Harness, client_id: str, user: str, clean: bool = True) -> tuple[Client, Connack]:
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
    pw_file = users_file(tmp_path, "alice")

    async def main() -> None:
        h = Harness(tmp_path, host="127.0.0.1", password_file=str(pw_file))
        with_logins(h, pw_file)
        anon = h.client()
        assert anon.connect("anon").return_code == CONNACK_NOT_AUTHORIZED
        assert anon.conn.closed
        c, connack = await _login(h, "a", "alice")
        assert connack.return_code == 0
    run(main())


def test_allow_anonymous_true_lets_anonymous_in_beside_a_password_file(tmp_path: Path) -> None:
    pw_file = users_file(tmp_path, "alice")

    async def main() -> None:
        h = Harness(tmp_path, host="127.0.0.1", password_file=str(pw_file), allow_anonymous=True)
        with_logins(h, pw_file)
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


# ---- issue 10 item 5: a session belongs to the user who made it ------------------------------

ALICE_MALLORY_ACL = """
user alice
topic readwrite alice/#
user mallory
topic readwrite mallory/#
"""


def test_other_user_cannot_take_a_persistent_session_0x05(tmp_path: Path) -> None:
    """MQTT 3.1.1 §3.2.2.3: mallory CONNECTing with alice's client id (clean session 0 or 1)
    is refused with 0x05; alice's queued message is neither delivered to him nor wiped."""
    pw_file = users_file(tmp_path, "alice", "mallory", "pub")

    async def main() -> None:
        h = Harness(tmp_path, password_file=str(pw_file))
        with_logins(h, pw_file, ALICE_MALLORY_ACL + "user pub\ntopic write #\n")
        alice, connack = await _login(h, "alice-1", "alice", clean=False)
        assert connack.return_code == 0
        alice.send(Subscribe(1, [("alice/secret/#", 1)]))
        alice.received()
        alice.conn.close("test: alice goes offline", will=False)
        pub, _ = await _login(h, "pub-1", "pub")
        pub.send(Publish("alice/secret/1", b"for alice", qos=1, packet_id=1))
        await h.commit()
        assert pub.received() == [Puback(1)]
        for clean in (False, True):
            mallory, connack = await _login(h, "alice-1", "mallory", clean=clean)
            assert connack == Connack(False, CONNACK_NOT_AUTHORIZED)
            assert mallory.conn.closed and mallory.received() == []
        assert h.store.load("alice-1") is not None  # clean session 1 did not wipe it
        alice, connack = await _login(h, "alice-1", "alice", clean=False)
        assert connack == Connack(True, 0)
        got = alice.received()
        assert [(p.topic, p.payload) for p in got] == [("alice/secret/1", b"for alice")]
    run(main())


def test_other_user_cannot_take_over_a_live_connection(tmp_path: Path) -> None:
    """A take-over (MQTT-3.1.4-2) is only for the same user: mallory is refused with 0x05 and
    alice's live connection stays open and keeps receiving."""
    pw_file = users_file(tmp_path, "alice", "mallory")

    async def main() -> None:
        h = Harness(tmp_path, password_file=str(pw_file))
        with_logins(h, pw_file, ALICE_MALLORY_ACL)
        alice, _ = await _login(h, "shared-id", "alice")
        alice.send(Subscribe(1, [("alice/#", 0)]))
        alice.received()
        mallory, connack = await _login(h, "shared-id", "mallory")
        assert connack.return_code == CONNACK_NOT_AUTHORIZED
        assert not alice.conn.closed
        alice.send(Publish("alice/x", b"still mine"))
        await h.commit()
        assert [p.payload for p in alice.received()] == [b"still mine"]
        again, connack = await _login(h, "shared-id", "alice")  # the same user may take over
        assert connack.return_code == 0 and alice.conn.closed
    run(main())


def test_session_owner_is_stored_and_survives_a_restart(tmp_path: Path) -> None:
    pw_file = users_file(tmp_path, "alice", "mallory")

    async def main() -> None:
        h = Harness(tmp_path, password_file=str(pw_file))
        with_logins(h, pw_file, ALICE_MALLORY_ACL)
        await _login(h, "alice-1", "alice", clean=False)
        stored = h.store.load("alice-1")
        assert stored is not None and stored.owner == "alice" and stored.owner_known
        h2 = Harness(tmp_path, password_file=str(pw_file))  # a new core on the same files
        with_logins(h2, pw_file, ALICE_MALLORY_ACL)
        _, connack = await _login(h2, "alice-1", "mallory", clean=False)
        assert connack.return_code == CONNACK_NOT_AUTHORIZED
    run(main())


def test_session_file_without_owner_is_adopted_only_within_the_acl(tmp_path: Path) -> None:
    """A session file written before owners were recorded: mallory, whose ACL does not allow
    its subscription, is refused; alice adopts it and her ownership is written."""
    pw_file = users_file(tmp_path, "alice", "mallory")
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "alice-1.json").write_text(
        '{"format":1,"client_id":"alice-1","subscriptions":{"alice/secret/#":{"qos":1,"start":0}},'
        '"qos2_inbound":[]}\n')

    async def main() -> None:
        h = Harness(tmp_path, password_file=str(pw_file))
        with_logins(h, pw_file, ALICE_MALLORY_ACL)
        _, connack = await _login(h, "alice-1", "mallory", clean=False)
        assert connack.return_code == CONNACK_NOT_AUTHORIZED
        _, connack = await _login(h, "alice-1", "alice", clean=False)
        assert connack == Connack(True, 0)
        stored = h.store.load("alice-1")
        assert stored is not None and stored.owner == "alice" and stored.owner_known
    run(main())


def test_every_delivery_is_checked_against_the_receivers_read_rights(tmp_path: Path) -> None:
    """A subscription granted under older rules delivers nothing the user may no longer read
    (no deny rule involved: the check is not limited to ACLs with deny rules)."""
    async def main() -> None:
        h = Harness(tmp_path)
        h.core.acl = Acl.parse("user alice\ntopic readwrite alice/#\n")
        alice = h.connected("alice-1", clean=False, username="alice",
                            subscribe=Subscribe(1, [("alice/secret/#", 0)]))
        alice.conn.close("test: offline", will=False)
        h.core.acl = Acl.parse("user alice\ntopic readwrite alice/public/#\nuser pub\ntopic write #\n")
        alice = h.connected("alice-1", clean=False, username="alice")
        pub = h.connected("pub-1", username="pub")
        pub.send(Publish("alice/secret/1", b"no longer readable"))
        await h.commit()
        assert [p.payload for p in alice.received()] == []
        alice.send(Subscribe(2, [("alice/public/#", 0)]))
        pub.send(Publish("alice/secret/2", b"no"), Publish("alice/public/2", b"yes"))
        await h.commit()
        assert [p.payload for p in alice.received() if isinstance(p, Publish)] == [b"yes"]
    run(main())


# ---- issue 10 item 6: a shared subscription is its share name and its filter -----------------


def test_share_groups_are_per_name_and_filter(tmp_path: Path) -> None:
    """MQTT 5 §4.8.2 (a Shared Subscription is identified by ShareName *and* Topic Filter):
    mallory's ``$share/work/mallory/#`` is not a member of alice's ``$share/work/alice/jobs/#``,
    so he takes none of her messages (he used to drain half of them)."""
    async def main() -> None:
        h = Harness(tmp_path)
        h.core.acl = Acl.parse("user alice\ntopic readwrite alice/#\nuser mallory\ntopic readwrite mallory/#\n"
                               "user pub\ntopic write #\n")
        alice = h.connected("alice-1", username="alice", subscribe=Subscribe(1, [("$share/work/alice/jobs/#", 1)]))
        mallory = h.connected("m-1", username="mallory", subscribe=Subscribe(1, [("$share/work/mallory/#", 1)]))
        pub = h.connected("pub-1", username="pub")
        n = 20
        pub.send(*[Publish("alice/jobs/x", b"%d" % i, 1, packet_id=i + 1) for i in range(n)])
        await h.commit()
        got: list[Publish] = []
        for _ in range(n):  # bounded: one PUBACK round per in-flight window
            batch = [p for p in alice.received() if isinstance(p, Publish)]
            if not batch:
                break
            got += batch
            alice.send(*[Puback(p.packet_id) for p in batch])  # type: ignore[arg-type]
        assert sorted(p.payload for p in got) == sorted(b"%d" % i for i in range(n))
        assert mallory.received() == []
        names = {g for g in h.queue._groups if g.startswith("mqtt-share:")}
        assert names == {"mqtt-share:work/alice/jobs/#", "mqtt-share:work/mallory/#"}
    run(main())


def test_old_share_group_is_split_per_filter_without_loss(tmp_path: Path) -> None:
    """A data dir from before: ``mqtt-share:pool`` (filters of all members) becomes one group per
    filter, each starting at the old group's Pending offset, and the old group is dropped."""
    from filemq.broker.server import log_config
    from filemq.mqtt.client import MQTTClient
    from filemq.queue import Queue, QueueConfig
    from tests.broker_process import collect, make_config, running

    async def main() -> None:
        cfg = make_config(tmp_path)
        async with Queue.open(tmp_path, QueueConfig(log=log_config(cfg))) as q:
            q.group("mqtt-share:pool", ("jobs/#", "other/#"), durable=True)
            for i in range(5):
                await q.publish("jobs/a", b"%d" % i, qos=1)
        # The member subscribed before those records (a persistent session from before).
        SessionStore(tmp_path).save(StoredSession("member", {"$share/pool/jobs/#": StoredSubscription(1, 0)}))
        async with running(cfg) as b:
            assert b.queue is not None
            names = sorted(g.name for g in b.queue.groups())
            assert names == ["mqtt-share:pool/jobs/#", "mqtt-share:pool/other/#"]
            got: list[Publish] = []
            member = MQTTClient("member", port=b.port, clean_session=False, on_message=got.append)
            assert (await member.connect()).session_present
            await collect(got, 5)
            assert [m.payload for m in got] == [b"%d" % i for i in range(5)]
            await member.disconnect()
    run(main())


# ---- issue 11 item 4: SIGHUP reloads the password and ACL files -------------------------------

REPO = Path(__file__).resolve().parents[1]


class _Process:
    """A real ``filemq`` process run with ``-v``; its stderr is read line by line on demand."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stderr: list[str] = []

    @classmethod
    async def start(cls, *args: str, ready: str) -> tuple[_Process, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cli", "-v", *args, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert ready in line, line
        return cls(proc), line

    async def expect(self, text: str, timeout: float = 20.0) -> str:
        """The next stderr line containing ``text`` (bounded wait)."""
        assert self.proc.stderr is not None
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.proc.stderr.readline()
                if not raw:
                    raise AssertionError(f"process ended before logging {text!r}: {self.stderr[-5:]}")
                line = raw.decode(errors="replace")
                self.stderr.append(line)
                if text in line:
                    return line

    async def hup(self, expect: str) -> str:
        self.proc.send_signal(signal.SIGHUP)
        line = await self.expect(expect)
        assert self.proc.returncode is None
        return line

    async def terminate(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            return await self.proc.wait()

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def test_sighup_reloads_password_and_acl_files_in_a_running_broker(tmp_path: Path) -> None:
    """The real ``filemq broker`` process: SIGHUP keeps it running with its connections; a login
    added to the password file works at once; a read right removed from the ACL stops deliveries
    to an existing subscription; a new file that fails to parse keeps the old one in force."""
    from filemq.mqtt.client import ConnectionRefused, MQTTClient

    pw_file = users_file(tmp_path, "alice", "pub")
    acl = tmp_path / "acl"
    acl.write_text("user alice\ntopic read alice/#\nuser pub\ntopic write #\nuser carol\ntopic read #\n")

    async def main() -> None:
        broker, line = await _Process.start(
            "broker", "--data-dir", str(tmp_path / "d"), "--port", "0", "--password-file", str(pw_file),
            "--acl-file", str(acl), ready="filemq broker listening on")
        try:
            port = int(line.split("127.0.0.1:")[1].split(",")[0])
            got: list[Publish] = []
            alice = MQTTClient("alice-1", port=port, username="alice", password="alice-pw", on_message=got.append)
            await alice.connect()
            assert await alice.subscribe([("alice/#", 1)]) == [1]
            pub = MQTTClient("pub-1", port=port, username="pub", password="pub-pw")
            await pub.connect()
            with pytest.raises(ConnectionRefused):
                await MQTTClient("carol-1", port=port, username="carol", password="carol-pw").connect()

            add_or_update(pw_file, "carol", "carol-pw", iterations=1000)
            acl.write_text("user alice\ntopic read alice/public/#\nuser pub\ntopic write #\n"
                           "user carol\ntopic read #\n")
            await broker.hup("reload: ACL file")
            carol = MQTTClient("carol-1", port=port, username="carol", password="carol-pw")
            await carol.connect()  # the added login works at once
            await pub.publish("alice/secret/1", b"no longer readable", qos=1)
            await pub.publish("alice/public/1", b"readable", qos=1)
            await _collect(got, 1)
            assert [m.payload for m in got] == [b"readable"]  # in log order: secret/1 was skipped

            acl.write_text("user alice\ntopic read alice/#\nfrobnicate everything\n")
            good_pw = pw_file.read_text()
            pw_file.write_text(good_pw + "dave:plaintext\n")
            await broker.hup("the password file in force is kept")
            await broker.expect("the ACL in force is kept")
            dave = MQTTClient("dave-1", port=port, username="carol", password="carol-pw")
            await dave.connect()  # the old password file is still in force
            await dave.disconnect()
            await pub.publish("alice/secret/2", b"still not", qos=1)
            await pub.publish("alice/public/2", b"old ACL in force", qos=1)
            await _collect(got, 2)
            assert [m.payload for m in got] == [b"readable", b"old ACL in force"]
            assert not alice.closed.is_set() and not pub.closed.is_set()
            for c in (alice, pub, carol):
                await c.disconnect()
            assert await broker.terminate() == 0
        finally:
            await broker.kill()
    asyncio.run(main())


async def _collect(got: list[Publish], n: int, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while len(got) < n:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("service", ["agent", "collector"])
def test_sighup_reloads_and_does_not_end_agent_or_collector(tmp_path: Path, service: str) -> None:
    """``filemq agent`` (its device broker) and ``filemq collector`` reload their password
    (and ACL) files on SIGHUP and keep running; SIGTERM still ends them with 0."""
    from filemq.mqtt.client import MQTTClient

    pw_file = users_file(tmp_path, "dev1")
    acl = tmp_path / "acl"
    acl.write_text("pattern write filemq/v1/%u/#\n")
    if service == "agent":
        args = ["agent", "--data-dir", str(tmp_path / "a"), "--device-id", "dev1", "--collector", "127.0.0.1:1",
                "--port", "0", "--broker-password-file", str(pw_file)]
        ready, expect = "broker listening on 127.0.0.1:", "reload: password file"
    else:
        args = ["collector", "--data-dir", str(tmp_path / "c"), "--landing", str(tmp_path / "land"), "--port", "0",
                "--password-file", str(pw_file), "--acl-file", str(acl)]
        ready, expect = "listening on 127.0.0.1:", "reload: ACL file"

    async def main() -> None:
        proc, line = await _Process.start(*args, ready=ready)
        try:
            port = int(line.split("127.0.0.1:")[1].split(",")[0].split()[0])
            add_or_update(pw_file, "dev2", "dev2-pw", iterations=1000)
            await proc.hup(expect)
            dev2 = MQTTClient("dev2", port=port, username="dev2", password="dev2-pw")
            await dev2.connect()  # the login added before SIGHUP works
            await dev2.disconnect()
            assert await proc.terminate() == 0
        finally:
            await proc.kill()
    asyncio.run(main())
