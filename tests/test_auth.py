"""Password files: hashing, checking, the login cache, atomic updates and `filemq passwd`."""

from __future__ import annotations

import base64
import hashlib
import logging
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from filemq.broker.auth import (
    DEFAULT_ITERATIONS,
    SCHEME,
    PasswordFile,
    PasswordHash,
    add_or_update,
)
from filemq.common.config import ConfigError

FAST = 1000  # iterations for tests; the format and code path are the same as production's


def test_hash_format_round_trips_and_verifies() -> None:
    h = PasswordHash.create("s3cret", FAST)
    text = h.encode()
    _, scheme, iters, salt, digest = text.split("$")
    assert scheme == SCHEME and int(iters) == FAST
    assert len(base64.b64decode(salt)) == 16 and len(base64.b64decode(digest)) == 64
    assert PasswordHash.decode(text) == h
    assert h.verify("s3cret") and h.verify(b"s3cret")
    assert not h.verify("s3cret ") and not h.verify("")


def test_salts_are_random() -> None:
    a, b = PasswordHash.create("same", FAST), PasswordHash.create("same", FAST)
    assert a.salt != b.salt and a.digest != b.digest


def test_matches_hashlib_reference() -> None:
    import hashlib

    h = PasswordHash.create("pw", 1234, salt=b"0123456789abcdef")
    assert h.digest == hashlib.pbkdf2_hmac("sha512", b"pw", b"0123456789abcdef", 1234)


def test_add_check_update(tmp_path: Path) -> None:
    p = tmp_path / "passwd"
    assert add_or_update(p, "alice", "a-pass", iterations=FAST) is True
    assert add_or_update(p, "bob", "b-pass", iterations=FAST) is True
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    pf = PasswordFile.load(p)
    assert pf.users == ["alice", "bob"] and "alice" in pf
    assert pf.check("alice", "a-pass") and pf.check("bob", b"b-pass")
    assert not pf.check("alice", "b-pass") and not pf.check("carol", "a-pass")
    assert add_or_update(p, "alice", "new-pass", iterations=FAST) is False
    pf = PasswordFile.load(p)
    assert pf.users == ["alice", "bob"]
    assert pf.check("alice", "new-pass") and not pf.check("alice", "a-pass")
    assert not (tmp_path / "passwd.tmp").exists()


def test_update_keeps_comments_and_existing_mode(tmp_path: Path) -> None:
    p = tmp_path / "passwd"
    add_or_update(p, "alice", "x", iterations=FAST)
    p.write_text("# devices\n\n" + p.read_text())
    p.chmod(0o640)
    add_or_update(p, "bob", "y", iterations=FAST)
    lines = p.read_text().splitlines()
    assert lines[:2] == ["# devices", ""] and lines[2].startswith("alice:")
    assert lines[3].startswith("bob:")
    assert stat.S_IMODE(p.stat().st_mode) == 0o640


def test_invalid_usernames_and_empty_password(tmp_path: Path) -> None:
    for bad in ("", "a:b", "a b", "tab\tname"):
        with pytest.raises(ValueError):
            add_or_update(tmp_path / "p", bad, "pw", iterations=FAST)
    with pytest.raises(ValueError):
        add_or_update(tmp_path / "p", "ok", "", iterations=FAST)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("no-colon-here", "username"),
        ("user:plaintext", "expected"),
        (f"user:$md5${FAST}$AAAA$AAAA", "unknown hash scheme"),
        (f"user:${SCHEME}$many$AAAA$AAAA", "iterations"),
        (f"user:${SCHEME}${FAST}$!!!$AAAA", "base64"),
        (f"user:${SCHEME}${FAST}$AAAA$AAAA", "expected 64"),
    ],
)
def test_malformed_lines_name_the_line(tmp_path: Path, line: str, words: str) -> None:
    p = tmp_path / "passwd"
    good = f"alice:{PasswordHash.create('x', FAST).encode()}"
    p.write_text(f"# header\n{good}\n{line}\n")
    with pytest.raises(ConfigError) as info:
        PasswordFile.load(p)
    assert info.value.line == 3 and info.value.file == str(p)
    assert words in str(info.value) and "line 3" in str(info.value)
    before = p.read_text()
    with pytest.raises(ConfigError):
        add_or_update(p, "bob", "pw", iterations=FAST)
    assert p.read_text() == before


def test_duplicate_user_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "passwd"
    entry = PasswordHash.create("x", FAST).encode()
    p.write_text(f"alice:{entry}\nalice:{entry}\n")
    with pytest.raises(ConfigError, match="already defined at line 1") as info:
        PasswordFile.load(p)
    assert info.value.line == 2


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read password file"):
        PasswordFile.load(tmp_path / "nope")


class CountingHash(PasswordHash):
    calls = 0

    def verify(self, password: str | bytes) -> bool:
        CountingHash.calls += 1
        return super().verify(password)


def test_cache_skips_pbkdf2_only_for_successful_pairs() -> None:
    h = PasswordHash.create("pw", FAST)
    pf = PasswordFile({"alice": CountingHash(h.iterations, h.salt, h.digest)}, cache_size=2)
    CountingHash.calls = 0
    assert not pf.cached("alice", "pw")
    assert pf.check("alice", "pw") and CountingHash.calls == 1
    assert pf.cached("alice", "pw")
    for _ in range(5):
        assert pf.check("alice", "pw")
    assert CountingHash.calls == 1
    for _ in range(3):  # failures are never cached: each one pays
        assert not pf.check("alice", "wrong")
    assert CountingHash.calls == 4
    assert not pf.cached("alice", "wrong") and not pf.cached("bob", "pw")


def test_cache_is_bounded_lru() -> None:
    users = {f"u{i}": PasswordHash.create(f"p{i}", FAST) for i in range(3)}
    pf = PasswordFile(users, cache_size=2)
    for i in range(3):
        assert pf.check(f"u{i}", f"p{i}")
    assert not pf.cached("u0", "p0") and pf.cached("u1", "p1") and pf.cached("u2", "p2")
    no_cache = PasswordFile(users, cache_size=0)
    assert no_cache.check("u0", "p0") and not no_cache.cached("u0", "p0")


def test_unknown_user_costs_a_pbkdf2_like_a_wrong_password() -> None:
    # Timing is noisy on a shared machine, so compare medians with a wide margin: an
    # unknown user that skipped PBKDF2 would be ~1000x faster, not 2x.
    pf = PasswordFile({"alice": PasswordHash.create("pw", 20_000)})

    def median(user: str) -> float:
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            assert not pf.check(user, "wrong")
            samples.append(time.perf_counter() - t)
        return sorted(samples)[2]

    known, unknown = median("alice"), median("mallory")
    assert unknown > known / 3


def test_default_iterations_is_owasp() -> None:
    assert DEFAULT_ITERATIONS >= 210_000


def test_cli_passwd_stdin_creates_0600_file(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "passwd"
    p.parent.mkdir()
    runner = CliRunner()
    args = ["passwd", str(p), "dev1", "--password-stdin", "--iterations", str(FAST)]
    result = runner.invoke(main, args, input="hunter2\n")
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert PasswordFile.load(p).check("dev1", "hunter2")
    result = runner.invoke(main, args, input="changed\n")
    assert result.exit_code == 0 and "updated" in result.output
    assert PasswordFile.load(p).check("dev1", "changed")


def test_cli_passwd_prompts_twice(tmp_path: Path) -> None:
    p = tmp_path / "passwd"
    runner = CliRunner()
    args = ["passwd", str(p), "dev2", "--iterations", str(FAST)]
    result = runner.invoke(main, args, input="abc\nabc\n")
    assert result.exit_code == 0, result.output
    assert PasswordFile.load(p).check("dev2", "abc")
    result = runner.invoke(main, args, input="one\ntwo\n")  # mismatch: click asks again, then EOF
    assert result.exit_code != 0
    assert PasswordFile.load(p).check("dev2", "abc")


def test_cli_passwd_rejects_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    p = tmp_path / "passwd"
    r = runner.invoke(main, ["passwd", str(p), "a:b", "--password-stdin"], input="x\n")
    assert r.exit_code == 2 and "USER" in r.output
    r = runner.invoke(main, ["passwd", str(p), "ok", "--password-stdin"], input="\n")
    assert r.exit_code == 1 and "empty" in r.output
    p.write_text("garbage line\n")
    r = runner.invoke(
        main, ["passwd", str(p), "ok", "--password-stdin", "--iterations", "5"], input="x\n"
    )
    assert r.exit_code == 1 and "line 1" in r.output
    assert p.read_text() == "garbage line\n"


# ---- mosquitto_passwd files drop in ---------------------------------------------------------

MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
needs_mosquitto_passwd = pytest.mark.skipif(
    not Path(MOSQUITTO_PASSWD).exists(), reason="Debian's mosquitto_passwd is not installed")


def _mosquitto_file(path: Path, users: dict[str, str], *args: str) -> None:
    for i, (user, password) in enumerate(users.items()):
        create = ["-c"] if i == 0 else []
        subprocess.run([MOSQUITTO_PASSWD, *args, *create, "-b", str(path), user, password],
                       check=True, capture_output=True, timeout=30)


@needs_mosquitto_passwd
@pytest.mark.parametrize(("hash_args", "prefix"), [((), "$7$101$"), (("-H", "sha512"), "$6$")])
def test_mosquitto_passwd_files_drop_in(tmp_path: Path, hash_args: tuple[str, ...], prefix: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """Files written by Debian's mosquitto_passwd ($7$ PBKDF2-SHA512 by default, $6$ salted
    SHA-512 with -H sha512) load and check; each weak entry is logged once with the fix."""
    p = tmp_path / "mosq.pw"
    _mosquitto_file(p, {"alice": "secret", "bob": "pä ss wörd"}, *hash_args)
    assert all(line.split(":", 1)[1].startswith(prefix) for line in p.read_text().splitlines())
    with caplog.at_level(logging.WARNING, "filemq.broker.auth"):
        pw = PasswordFile.load(p)
        PasswordFile.load(p)  # a reload does not repeat the warnings
    assert pw.users == ["alice", "bob"]
    assert pw.check("alice", "secret") and pw.check("bob", "pä ss wörd".encode())
    assert not pw.check("alice", "secreT") and not pw.check("bob", "secret") and not pw.check("eve", "x")
    weak = [r.getMessage() for r in caplog.records if "weak hash" in r.getMessage()]
    assert len(weak) == 2
    assert f"`filemq passwd {p} alice`" in weak[0] and f"`filemq passwd {p} bob`" in weak[1]


@needs_mosquitto_passwd
def test_filemq_passwd_rehashes_a_mosquitto_entry_with_the_strong_scheme(tmp_path: Path) -> None:
    p = tmp_path / "mosq.pw"
    _mosquitto_file(p, {"alice": "secret", "bob": "hunter2"})
    bob_line = p.read_text().splitlines()[1]
    assert not add_or_update(p, "alice", "new secret", iterations=FAST)
    lines = p.read_text().splitlines()
    assert lines[0].startswith(f"alice:${SCHEME}$") and lines[1] == bob_line  # bob kept as is
    pw = PasswordFile.load(p)
    assert pw.check("alice", "new secret") and pw.check("bob", "hunter2")
    assert PasswordHash.decode(lines[0].split(":", 1)[1]).weakness() is not None  # FAST rounds
    assert PasswordHash.create("x").weakness() is None  # the default is strong


def test_mosquitto_hashes_match_the_reference_construction() -> None:
    """The formulas of Mosquitto's password_mosq.c, independent of the mosquitto_passwd binary."""
    salt = bytes(range(12))
    pbkdf2 = hashlib.pbkdf2_hmac("sha512", b"pw", salt, 101)
    b64 = base64.b64encode
    h7 = PasswordHash.decode(f"$7$101${b64(salt).decode()}${b64(pbkdf2).decode()}")
    assert h7.verify("pw") and not h7.verify("pw2")
    assert h7.encode() == f"$7$101${b64(salt).decode()}${b64(pbkdf2).decode()}"
    sha = hashlib.sha512(b"pw" + salt).digest()
    h6 = PasswordHash.decode(f"$6${b64(salt).decode()}${b64(sha).decode()}")
    assert h6.verify("pw") and not h6.verify("pw2")
    assert h6.encode() == f"$6${b64(salt).decode()}${b64(sha).decode()}"
    with pytest.raises(ValueError, match=r"expected \$6\$"):
        PasswordHash.decode(f"$6$101${b64(salt).decode()}${b64(sha).decode()}")
