"""Password files: salted PBKDF2-SHA512 hashes, constant-time checks, atomic updates.

The file has one user per line (``#`` comments and blank lines allowed)::

    sensor-1:$filemq-pbkdf2-sha512$210000$<salt base64>$<hash base64>

The hash is ``hashlib.pbkdf2_hmac("sha512", password, salt, iterations)`` over the UTF-8 (or
raw MQTT) password bytes with a random 16-byte salt; the 64-byte result is compared with
``hmac.compare_digest``.  Usernames are non-empty and contain no ``:``, whitespace or
control characters.

Files written by Mosquitto's ``mosquitto_passwd`` drop in: its lines are read as they are
(the format as in Mosquitto's ``password_mosq.c``; salts of any length, 12 bytes there)::

    alice:$7$101$<salt base64>$<hash base64>   # PBKDF2-HMAC-SHA512(password, salt, 101), 64 bytes
    bob:$6$<salt base64>$<hash base64>         # SHA-512(password || salt), 64 bytes

and checked in constant time too.  An entry weaker than :data:`MIN_STRONG_ITERATIONS` PBKDF2
rounds (Mosquitto writes 101) or a ``$6$`` entry is logged once (WARNING, per file, user and
hash) with the ``filemq passwd FILE USER`` command that replaces it with this module's scheme;
``filemq passwd`` only ever writes that scheme.

What a caller may rely on:

* :meth:`PasswordFile.load` raises :class:`~filemq.common.config.ConfigError` with the line number
  for any malformed line or duplicate user; a loaded file never changes (reload = load again).
* :meth:`PasswordFile.check` takes about as long for an unknown user as for a wrong password
  (it derives a hash against a dummy entry), so timing does not reveal which users exist.
  An empty password never logs in, whatever the file holds (as Mosquitto refuses them): a
  line that is the hash of the empty password is logged once (WARNING, per file and user)
  when it is first tried, with the command that sets a password.
  A miss costs one PBKDF2 (~80 ms at 210,000 iterations on a small core): call it from an
  executor, not the event loop.  It is thread-safe.
* Login cache: a successful ``(user, password)`` pair is remembered (bounded LRU, default
  1,024 entries) as an HMAC-SHA256 under a random per-process key, so a reconnect storm of
  1,000 clients costs one PBKDF2 per distinct login instead of one per connection.
  Tradeoff: someone who can read the broker's memory could test password guesses against a
  cache entry at HMAC speed instead of PBKDF2 speed -- but such a reader also sees the plain
  passwords arriving in CONNECT packets, so nothing is lost that was not already exposed.
  Failed checks are never cached (a guessing attacker pays full PBKDF2 every time), and the
  cache dies with the object, so reloading the file drops it.
* :class:`LoginThrottle` keeps failed password checks per source address: after a number of
  them in a row, that address's checks start at most one per delay (a flood of wrong
  passwords from one address cannot hold every PBKDF2 thread).
* :func:`add_or_update` rewrites the file with :func:`segments.fileio.atomic_write`; a new
  file is created with mode 0600, an existing one keeps its mode.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from filemq.common.config import ConfigError, read_config_text
from segments.fileio import OS_FILE_IO, FileIO, atomic_write

SCHEME = "filemq-pbkdf2-sha512"
DEFAULT_ITERATIONS = 210_000
"""OWASP's recommendation for PBKDF2-HMAC-SHA512 (2023)."""
SALT_BYTES = 16
HASH_BYTES = 64
MOSQUITTO_PBKDF2 = "7"
"""``mosquitto_passwd``'s default scheme: ``$7$<iterations>$<salt>$<hash>``, PBKDF2-HMAC-SHA512."""
MOSQUITTO_SHA512 = "6"
"""``mosquitto_passwd -H sha512`` (Mosquitto 1.6 and older): ``$6$<salt>$<hash>``, SHA-512(pw || salt)."""
MIN_STRONG_ITERATIONS = 100_000
"""PBKDF2 entries with fewer rounds are logged as weak (Mosquitto's default is 101)."""
MAX_ITERATIONS = 2_000_000
"""PBKDF2 entries with more rounds are refused at load: every login attempt for such a user
(and for unknown users, checked against the first entry) would hold an auth thread for that
long -- about 10 s at this cap on a small core, hours for a ``$7$2000000000$`` line."""

_warned_weak: set[tuple[str, str, str]] = set()  # (file, user, hash) already logged as weak
_warned_empty: set[tuple[str, str]] = set()  # (file, user) whose entry is the empty password, logged

log = logging.getLogger(__name__)

_USER_RE = re.compile(r"^[^:\s\x00-\x1f\x7f]+$")


def valid_username(user: str) -> bool:
    """True when ``user`` can be stored in a password file."""
    return bool(_USER_RE.match(user))


def _as_bytes(password: str | bytes) -> bytes:
    return password.encode("utf-8") if isinstance(password, str) else password


@dataclass(frozen=True)
class PasswordHash:
    """One stored hash: iteration count, salt and derived key, and the scheme that made it
    (:data:`SCHEME`, or Mosquitto's :data:`MOSQUITTO_PBKDF2` / :data:`MOSQUITTO_SHA512`)."""

    iterations: int
    salt: bytes
    digest: bytes
    scheme: str = SCHEME

    @classmethod
    def create(
        cls, password: str | bytes, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
    ) -> PasswordHash:
        """Hash ``password`` with a fresh random salt (or ``salt``, for tests)."""
        if not 1 <= iterations <= MAX_ITERATIONS:
            raise ValueError(f"iterations must be 1 to {MAX_ITERATIONS:,}, got {iterations}")
        salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
        digest = hashlib.pbkdf2_hmac("sha512", _as_bytes(password), salt, iterations)
        return cls(iterations, salt, digest)

    def verify(self, password: str | bytes) -> bool:
        """Derive and compare in constant time."""
        if self.scheme == MOSQUITTO_SHA512:
            derived = hashlib.sha512(_as_bytes(password) + self.salt).digest()
        else:
            derived = hashlib.pbkdf2_hmac("sha512", _as_bytes(password), self.salt, self.iterations)
        return hmac.compare_digest(derived, self.digest)

    def weakness(self) -> str | None:
        """Why this entry is weak (a Mosquitto ``$6$`` hash, few PBKDF2 rounds), or None."""
        if self.scheme == MOSQUITTO_SHA512:
            return "a single salted SHA-512 ($6$, mosquitto_passwd -H sha512)"
        if self.iterations < MIN_STRONG_ITERATIONS:
            return f"only {self.iterations} PBKDF2 iterations (at least {MIN_STRONG_ITERATIONS:,} recommended)"
        return None

    def encode(self) -> str:
        """The ``$filemq-pbkdf2-sha512$<iterations>$<salt>$<hash>`` text (Mosquitto entries keep
        their own ``$7$``/``$6$`` form)."""
        salt = base64.b64encode(self.salt).decode("ascii")
        digest = base64.b64encode(self.digest).decode("ascii")
        if self.scheme == MOSQUITTO_SHA512:
            return f"${MOSQUITTO_SHA512}${salt}${digest}"
        return f"${self.scheme}${self.iterations}${salt}${digest}"

    @classmethod
    def decode(cls, text: str) -> PasswordHash:
        """Parse :meth:`encode` output; ``ValueError`` says what is wrong."""
        parts = text.split("$")
        if len(parts) < 2 or parts[0] != "":
            raise ValueError(f"expected ${SCHEME}$<iterations>$<salt>$<hash>")
        scheme = parts[1]
        if scheme == MOSQUITTO_SHA512:
            if len(parts) != 4:
                raise ValueError("expected $6$<salt>$<hash> (mosquitto_passwd -H sha512)")
            parts.insert(2, "1")  # one SHA-512: no iteration count on the line
        elif scheme in (SCHEME, MOSQUITTO_PBKDF2):
            if len(parts) != 5:
                raise ValueError(f"expected ${scheme}$<iterations>$<salt>$<hash>")
        else:
            raise ValueError(f"unknown hash scheme {scheme!r} (expected {SCHEME!r}, or "
                             "mosquitto_passwd's '7' or '6')")
        if not parts[2].isdigit() or int(parts[2]) < 1:
            raise ValueError(f"iterations must be a positive integer, got {parts[2]!r}")
        if int(parts[2]) > MAX_ITERATIONS:
            raise ValueError(f"{int(parts[2]):,} iterations is over the {MAX_ITERATIONS:,} a login may "
                             "cost (filemq.broker.auth.MAX_ITERATIONS)")
        try:
            salt = base64.b64decode(parts[3], validate=True)
            digest = base64.b64decode(parts[4], validate=True)
        except binascii.Error as exc:
            raise ValueError(f"salt or hash is not valid base64 ({exc})") from None
        if not salt:
            raise ValueError("empty salt")
        if len(digest) != HASH_BYTES:
            raise ValueError(f"hash is {len(digest)} bytes, expected {HASH_BYTES}")
        return cls(int(parts[2]), salt, digest, scheme)


def _parse(text: str, file: str) -> dict[str, tuple[int, PasswordHash]]:
    """``{user: (line number, hash)}``; malformed lines and duplicates raise ConfigError."""
    users: dict[str, tuple[int, PasswordHash]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, rest = line.partition(":")
        if not sep or not valid_username(user):
            raise ConfigError(
                f"line {lineno}: expected 'user:${SCHEME}$...' with a username without "
                "':' or spaces (create lines with `filemq passwd FILE USER`)",
                file=file,
                line=lineno,
            )
        try:
            entry = PasswordHash.decode(rest)
        except ValueError as exc:
            raise ConfigError(
                f"line {lineno}: bad hash for user {user!r}: {exc}", file=file, line=lineno
            ) from None
        if user in users:
            raise ConfigError(
                f"line {lineno}: user {user!r} already defined at line {users[user][0]}",
                file=file,
                line=lineno,
            )
        users[user] = (lineno, entry)
    return users


class PasswordFile:
    """The users of one password file, checked in constant time with a login cache."""

    def __init__(
        self, entries: dict[str, PasswordHash], *, path: str = "", cache_size: int = 1024
    ) -> None:
        self.path = path
        self._entries = dict(entries)
        first = next(iter(entries.values()), None)
        iterations = first.iterations if first is not None else DEFAULT_ITERATIONS
        # Unknown users are checked against this so they cost the same as a wrong password.
        self._dummy = PasswordHash(iterations, secrets.token_bytes(SALT_BYTES), bytes(HASH_BYTES),
                                   first.scheme if first is not None else SCHEME)
        self._cache_key = secrets.token_bytes(32)
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, cache_size: int = 1024) -> PasswordFile:
        """Read and validate ``path``; raises :class:`ConfigError` (with line) on any problem."""
        file = os.fspath(path)
        text = read_config_text(file, "password file")
        parsed = _parse(text, file)
        for user, (lineno, entry) in parsed.items():
            why = entry.weakness()
            key = (file, user, entry.encode())
            if why is not None and key not in _warned_weak:
                _warned_weak.add(key)
                log.warning("password file %s line %d: user %r has a weak hash, %s; rehash it with "
                            "`filemq passwd %s %s`", file, lineno, user, why, file, user)
        entries = {user: entry for user, (_, entry) in parsed.items()}
        return cls(entries, path=file, cache_size=cache_size)

    @property
    def users(self) -> list[str]:
        """The usernames, in file order."""
        return list(self._entries)

    def __contains__(self, user: object) -> bool:
        return user in self._entries

    def _cache_token(self, user: str, password: bytes) -> bytes:
        msg = user.encode("utf-8", "surrogatepass") + b"\x00" + password
        return hmac.new(self._cache_key, msg, hashlib.sha256).digest()

    def cached(self, user: str, password: str | bytes) -> bool:
        """True when this exact pair succeeded recently (microseconds; safe on the event loop).

        False means "not known", not "wrong": call :meth:`check` then.
        """
        token = self._cache_token(user, _as_bytes(password))
        with self._lock:
            if token in self._cache:
                self._cache.move_to_end(token)
                return True
        return False

    def check(self, user: str, password: str | bytes) -> bool:
        """True when ``password`` is ``user``'s; unknown users cost the same as wrong passwords."""
        pw = _as_bytes(password)
        if self.cached(user, pw):
            return True
        entry = self._entries.get(user)
        ok = (entry or self._dummy).verify(pw) and entry is not None
        if ok and not pw:
            # The same cost as a wrong password, and refused: an entry hashing "" is a mistake.
            if (self.path, user) not in _warned_empty:
                _warned_empty.add((self.path, user))
                log.warning("password file %s: the entry of user %r is the empty password; empty passwords "
                            "are refused (as Mosquitto does): set one with `filemq passwd %s %s`",
                            self.path, user, self.path, user)
            return False
        if ok and self._cache_size > 0:
            token = self._cache_token(user, pw)
            with self._lock:
                self._cache[token] = None
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return ok


class LoginThrottle:
    """Failed password checks per source address (sans-I/O: the caller passes the clock).

    After ``after`` failed checks in a row from one address (0: never), each further check
    from it starts ``delay`` seconds after the one before it started, so one address costs at
    most one PBKDF2 per ``delay`` whatever it sends; a success resets the address.  At most
    ``max_sources`` addresses are kept (least recently failed dropped first), so a flood of
    addresses costs bounded memory.
    """

    def __init__(self, after: int, delay: float, max_sources: int = 4096) -> None:
        self.after = after
        self.delay = delay
        self.max_sources = max_sources
        # address -> [failures in a row, monotonic time its next check may start]
        self._sources: OrderedDict[str, list[float]] = OrderedDict()

    def wait(self, source: str, now: float, horizon: float) -> float | None:
        """Seconds the next password check from ``source`` must wait (0.0: none), reserving
        its start; None when that start is more than ``horizon`` seconds away (refuse it
        without a check: the queue of that address is full)."""
        entry = self._sources.get(source)
        if entry is None or not self.after or entry[0] < self.after:
            return 0.0
        start = max(now, entry[1])
        if start - now > horizon:
            return None
        entry[1] = start + self.delay
        return start - now

    def failed(self, source: str, now: float) -> bool:
        """Count a failed check from ``source``; True exactly when this one starts its delays
        (the caller logs that once)."""
        entry = self._sources.get(source)
        if entry is None:
            entry = self._sources[source] = [0, now]
            if len(self._sources) > self.max_sources:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(source)
        entry[0] += 1
        return bool(self.after) and entry[0] == self.after

    def succeeded(self, source: str) -> None:
        """A check from ``source`` succeeded: its failures in a row are over."""
        self._sources.pop(source, None)

    def failures(self, source: str) -> int:
        """Failed checks in a row from ``source``."""
        entry = self._sources.get(source)
        return 0 if entry is None else int(entry[0])


def add_or_update(
    path: str | os.PathLike[str],
    user: str,
    password: str | bytes,
    *,
    iterations: int = DEFAULT_ITERATIONS,
    fileio: FileIO = OS_FILE_IO,
) -> bool:
    """Set ``user``'s password in the file at ``path``, creating it (mode 0600) if missing.

    Other lines, comments included, are kept in place.  Returns True when the user was new.
    Raises ``ValueError`` for an invalid username or empty password and
    :class:`ConfigError` when the existing file is malformed (it is left untouched).
    """
    if not valid_username(user):
        raise ValueError(f"invalid username {user!r}: it must be non-empty, without ':' or spaces")
    if not _as_bytes(password):
        raise ValueError("the password is empty")
    file = os.fspath(path)
    target = Path(file)
    try:
        text = target.read_text(encoding="utf-8")
        mode = target.stat().st_mode & 0o777
    except FileNotFoundError:
        text, mode = "", 0o600
    existing = _parse(text, file)
    line = f"{user}:{PasswordHash.create(password, iterations).encode()}"
    lines = text.splitlines()
    if user in existing:
        lines[existing[user][0] - 1] = line
    else:
        lines.append(line)
    # atomic_write creates its temp file with the default mode; create it first with the
    # final mode so the hashes are never readable by others, not even for a moment.
    tmp = target.with_name(target.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    atomic_write(target, ("\n".join(lines) + "\n").encode("utf-8"), fileio)
    return user not in existing
