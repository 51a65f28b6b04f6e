"""The broker core is a composition of parts (issue 31 item 2; docs/LAYERS.md, "The broker
core"): no class of filemq/broker/ is assembled from others of the package by inheritance,
and each handler BrokerCore.receive gives a connection's events to is the handling part's own
bound method, so only receive's one frame per read sits between a packet and its part (the hot
path's cost, docs/PERFORMANCE.md)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any

import filemq.broker
from filemq.broker.core import BrokerCore
from tests.broker_harness import Harness, run


def _broker_classes() -> list[type]:
    out: list[type] = []
    for info in pkgutil.walk_packages(filemq.broker.__path__, "filemq.broker."):  # (session/ too)
        module = importlib.import_module(info.name)
        out.extend(c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__)
    return out


def test_no_class_of_the_broker_is_built_from_others_of_the_broker() -> None:
    """No mixins: a class's bases are outside filemq.broker (object, Protocol, a NamedTuple's
    field tuple ...), except session/inflight.py's SentRecord over its own field tuple."""
    classes = _broker_classes()
    assert BrokerCore in classes and len(classes) > 20  # (the walk found the package)
    inherited = {(c.__name__, b.__name__) for c in classes for b in c.__bases__
                 if b.__module__.startswith("filemq.broker.")}
    assert inherited == {("SentRecord", "_SentFields")}


def test_every_core_handler_is_its_parts_own_bound_method(tmp_path: Path) -> None:
    async def main() -> None:
        core = Harness(tmp_path).core
        owner: dict[str, Any] = {
            "on_connect": core.connect, "on_disconnect": core.connect,
            "on_publish": core.ingest, "on_publishes": core.ingest, "on_publish_run": core.ingest,
            "on_subscribe": core.subscriptions, "on_unsubscribe": core.subscriptions,
            "on_puback": core.qos, "on_pubacks": core.qos, "on_pubrec": core.qos,
            "on_pubrel": core.qos, "on_pubcomp": core.qos, "mark_dirty": core.delivery,
        }
        # The handlers BrokerCore.receive calls (declared on the class) and what a connection's
        # output_ready notification calls.
        handlers = {name for name in BrokerCore.__annotations__ if name.startswith("on_")} | {"mark_dirty"}
        assert handlers == set(owner)
        for name, part in owner.items():
            handler = getattr(core, name)
            assert getattr(handler, "__self__", None) is part, name
            assert handler.__func__ is getattr(type(part), name), name
    run(main())
