"""Optional compiled build of the broker's hot path (docs/PERFORMANCE.md, "Compiled build").

The package metadata is in setup.cfg; this file only adds extension modules, and only when
asked.  ``pip install .`` / ``pip install -e .`` build the pure-Python package and never need a
C compiler.  ``FILEMQ_COMPILE=1 pip install .`` compiles the modules in ``HOT_PATH`` with mypyc
(mypy is then fetched as a build requirement; a C compiler and the Python headers must be
present); ``make compiled`` builds them in a copy of the tree (build/compiled/).  The same .py
files are the only source: mypyc compiles them unchanged.  ``filemq --version`` says which
build runs.  ``MYPYC_OPT_LEVEL`` (default 3) and ``MYPYC_MULTI_FILE`` (default 0) are
passed to mypyc.
"""

from __future__ import annotations

import os

from setuptools import setup

# The modules a message passes through (decode -> append -> PUBACK; tail cache -> encode ->
# write) and what they call per message.  Left interpreted, and why (docs/PERFORMANCE.md):
# segments/fileio.py (DiskFull derives from OSError, which a mypyc native class cannot),
# filemq/broker/connect.py (CONNECT: once per connection), filemq/broker/registry.py
# (session files: per SUBSCRIBE or QoS 2 exchange; mypyc 2.x failed on closures like its
# write_snapshot's in a non-native class), filemq/broker/router.py (the trie is matched once
# per commit batch, its methods run per SUBSCRIBE), filemq/broker/systopics.py (once per
# sys_interval_s),
# filemq/common/native.py (the marker shim itself), and everything that is not per message
# (server, client, config, ops, broker/session_store.py: session files are written
# per SUBSCRIBE or QoS 2 exchange, and tests replace SessionStore.write on an instance, which
# a native class does not allow).
HOT_PATH = [
    "filemq/mqtt/codec.py",
    "filemq/mqtt/codec311.py",
    "filemq/mqtt/codec5.py",
    "filemq/mqtt/runcodec.py",
    "filemq/mqtt/packets.py",
    "filemq/mqtt/pubacks.py",
    "filemq/mqtt/properties.py",
    "filemq/broker/acl.py",
    "filemq/broker/core.py",
    "filemq/broker/delivery.py",
    "filemq/broker/qos.py",
    "filemq/broker/publish.py",
    "filemq/broker/retain.py",
    "filemq/broker/session/connection.py",
    "filemq/broker/session/events.py",
    "filemq/broker/session/inflight.py",
    "filemq/broker/session/qos_state.py",
    "filemq/broker/session_state.py",
    "filemq/broker/subscribe.py",
    "filemq/broker/tailcache.py",
    "filemq/common/topics.py",
    "filemq/queue/api.py",
    "filemq/queue/groups.py",
    "filemq/queue/offsets.py",
    "filemq/queue/retained.py",
    "segments/commit.py",
    "segments/errors.py",
    "segments/index.py",
    "segments/log.py",
    "segments/record.py",
    "segments/segment.py",
]

MYPY_REQUIREMENT = "mypy>=1.10"


def _ext_modules() -> list[object]:
    if os.environ.get("FILEMQ_COMPILE") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        # First pass of an isolated pip build: setup_requires below makes pip install mypy
        # into the build environment and run this file again.
        return []
    # MYPYC_MULTI_FILE=1 (make compiled): one C file per module, so `build_ext -j N` compiles
    # them in parallel, in less compiler time; one file for all (the default) lets the C
    # compiler inline across modules: ~6 % fewer instructions per fanout delivery (PERFORMANCE.md).
    return list(mypycify(HOT_PATH, opt_level=os.environ.get("MYPYC_OPT_LEVEL", "3"),
                         multi_file=os.environ.get("MYPYC_MULTI_FILE", "0") == "1"))


setup(
    ext_modules=_ext_modules(),
    setup_requires=[MYPY_REQUIREMENT] if os.environ.get("FILEMQ_COMPILE") == "1" else [],
)
