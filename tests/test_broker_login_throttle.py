"""Failed logins per source address (issue 33 item 18): after
``broker.login_failures_before_delay`` failed password checks in a row from one address, its
checks are spaced ``login_failure_delay_ms`` apart, so a flood of wrong passwords from one
address cannot hold the PBKDF2 threads that every other client's login needs."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from filemq.broker.auth import LoginThrottle, PasswordFile, add_or_update
from filemq.mqtt.packets import Connack, Connect
from tests.broker_harness import Client, Harness, run

# ---- the throttle alone (sans-I/O: the test is the clock) -----------------------------------


@given(st.integers(1, 6), st.lists(st.sampled_from(["fail", "ok", "check"]), max_size=40))
def test_throttle_spaces_checks_only_after_failures_in_a_row(after: int, steps: list[str]) -> None:
    """Against a model: an address with fewer than ``after`` failures in a row is never
    delayed; past it, consecutive checks start ``delay`` apart (reserved in order); a success
    resets it."""
    t = LoginThrottle(after, 1.0)
    now, in_a_row, next_start = 100.0, 0, 100.0
    for step in steps:
        if step == "fail":
            crossed = t.failed("a", now)
            in_a_row += 1
            assert crossed == (in_a_row == after)
        elif step == "ok":
            t.succeeded("a")
            in_a_row = 0
        else:
            wait = t.wait("a", now, horizon=1000.0)
            if in_a_row < after:
                assert wait == 0.0
            else:
                start = max(now, next_start)
                assert wait == start - now
                next_start = start + 1.0
        if in_a_row < after:
            next_start = now
        assert t.failures("a") == in_a_row
        assert t.wait("b", now, 1000.0) == 0.0  # another address is never held up


def test_throttle_refuses_past_its_horizon_and_keeps_bounded_memory() -> None:
    t = LoginThrottle(2, 1.0, max_sources=3)
    t.failed("a", 0.0)
    t.failed("a", 0.0)
    assert [t.wait("a", 0.0, horizon=2.5) for _ in range(5)] == [0.0, 1.0, 2.0, None, None]
    for source in "bcde":
        t.failed(source, 0.0)
    assert t.failures("a") == 0 and t.failures("e") == 1  # "a" was dropped first
    assert LoginThrottle(0, 1.0).wait("x", 0.0, 1.0) == 0.0  # 0: never delayed


# ---- the broker ------------------------------------------------------------------------------


class Checks:
    """Records when each password check starts (a wrapper around PasswordFile.check)."""

    def __init__(self, passwords: PasswordFile) -> None:
        self.real = passwords.check
        self.starts: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    def __call__(self, user: str, password: Any) -> bool:
        with self.lock:
            self.starts.append((user, time.monotonic()))
        return self.real(user, password)


def _harness(tmp_path: Path, **broker: Any) -> tuple[Harness, Checks]:
    pw_file = tmp_path / "pw"
    add_or_update(pw_file, "alice", "secret", iterations=1000)
    add_or_update(pw_file, "bob", "bob-pw", iterations=1000)
    h = Harness(tmp_path, **broker)
    h.core.passwords = PasswordFile.load(pw_file)
    h.core.anonymous_allowed = False
    checks = Checks(h.core.passwords)
    h.core.passwords.check = checks  # type: ignore[method-assign]
    return h, checks


def _from(h: Harness, address: str) -> Client:
    h._n += 1
    return Client(h, f"{address}:{40000 + h._n}")


async def _answer(c: Client, timeout: float = 5.0) -> int:
    for _ in range(int(timeout / 0.01)):
        got = c.received()
        if got:
            assert type(got[0]) is Connack
            return int(got[0].return_code)
        await asyncio.sleep(0.01)
    raise AssertionError("no CONNACK")


def test_failed_logins_in_a_row_space_out_that_address_only(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """After 3 failed logins in a row from 10.9.9.9, its checks start 200 ms apart; bob's
    login from 10.1.1.1 is checked meanwhile, not behind them; the address is named in one
    WARNING however many attempts follow; its own correct login, when its turn comes,
    succeeds and resets it."""
    async def main() -> None:
        h, checks = _harness(tmp_path, login_failures_before_delay=3, login_failure_delay_ms=200)
        with caplog.at_level(logging.WARNING, "filemq.broker"):
            for i in range(3):
                c = _from(h, "10.9.9.9")
                c.send(Connect(client_id=f"x{i}", username="alice", password=b"wrong"))
                assert await _answer(c) == 0x04
            held = [_from(h, "10.9.9.9") for _ in range(3)]
            for i, c in enumerate(held):
                c.send(Connect(client_id=f"y{i}", username="alice", password=b"wrong" if i < 2 else b"secret"))
            other = _from(h, "10.1.1.1")
            other.send(Connect(client_id="other", username="bob", password=b"bob-pw"))
            assert await _answer(other) == 0
            assert [await _answer(c) for c in held] == [0x04, 0x04, 0]
        alice = [at for user, at in checks.starts if user == "alice"][3:]
        (bob,) = [at for user, at in checks.starts if user == "bob"]
        assert len(alice) == 3 and bob < alice[-1]
        gaps = [b - a for a, b in zip(alice, alice[1:], strict=False)]
        assert all(g >= 0.19 for g in gaps), gaps
        named = [r for r in caplog.records if "failed logins in a row from 10.9.9.9" in r.message]
        assert len(named) == 1
        assert h.core.connect._login_throttle.failures("10.9.9.9") == 0  # the success reset it
    run(main())


def test_a_throttled_address_past_the_connect_timeout_is_refused_unchecked(tmp_path: Path) -> None:
    """Attempts that could not start their check within the CONNECT deadline are refused at
    once with CONNACK 3 server unavailable (no password verdict, no PBKDF2): one address's
    queue is bounded."""
    async def main() -> None:
        h, checks = _harness(tmp_path, login_failures_before_delay=1, login_failure_delay_ms=400)
        h.core.connect_timeout = 1.0
        first = _from(h, "10.9.9.9")
        first.send(Connect(client_id="f", username="alice", password=b"wrong"))
        assert await _answer(first) == 0x04
        flood = [_from(h, "10.9.9.9") for _ in range(6)]
        for i, c in enumerate(flood):
            c.send(Connect(client_id=f"z{i}", username="alice", password=b"wrong"))
        answers = [await _answer(c) for c in flood]
        assert answers.count(0x03) == 3 and answers.count(0x04) == 3  # starts at 0, 0.4, 0.8 s
        assert len(checks.starts) == 1 + 3
    run(main())


def test_login_throttle_off_with_0(tmp_path: Path) -> None:
    async def main() -> None:
        h, checks = _harness(tmp_path, login_failures_before_delay=0)
        for i in range(8):
            c = _from(h, "10.9.9.9")
            c.send(Connect(client_id=f"x{i}", username="alice", password=b"wrong"))
            assert await _answer(c) == 0x04
        assert h.core.connect._login_throttle.wait("10.9.9.9", time.monotonic(), 10.0) == 0.0
    run(main())
