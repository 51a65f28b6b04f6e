"""The process's file-descriptor limit and how many connections it can carry.

A collector serves a fleet: each device holds one TCP connection, i.e. one descriptor, so its
connection limit comes from ``RLIMIT_NOFILE`` rather than a fixed number.
:func:`raise_nofile_limit` raises the soft limit to the hard one where the system allows it
(an unprivileged process may do so; a hard limit of "unlimited" is capped at the kernel's
``fs.nr_open``); :func:`connection_capacity` keeps :data:`FD_RESERVE` descriptors for the
process's own files (log segments and indexes, landing files, offset files, listeners).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

FD_RESERVE = 256
_NR_OPEN = "/proc/sys/fs/nr_open"
_NR_OPEN_DEFAULT = 1 << 20


def _kernel_max() -> int:
    try:
        with open(_NR_OPEN, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return _NR_OPEN_DEFAULT


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit if allowed; the ``(soft, hard)`` in force.

    A refusal is logged and the soft limit kept. Without the ``resource`` module (not POSIX)
    returns ``(-1, -1)``: unknown.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _kernel_max() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the file-descriptor limit from %d to %d: %s", soft, target, exc)
        else:
            soft = target
    return soft, hard


def connection_capacity(soft: int) -> int:
    """Connections that fit ``soft`` descriptors after :data:`FD_RESERVE` for files (at least 1)."""
    if soft < 0:  # unknown or unlimited
        soft = _kernel_max()
    if soft > 2 * FD_RESERVE:
        return soft - FD_RESERVE
    return max(1, soft // 2)
