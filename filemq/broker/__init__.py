"""The MQTT 3.1.1 broker on the log: durable acks, persistent sessions, auth and ACL.

Layers, as in h11: :mod:`.session` is the per-connection state machine (bytes in, bytes
out), :mod:`.core` the shared broker state and rules (sessions, routing, durable acks),
:mod:`.sessions` the durable session store, :mod:`.tailcache` the in-memory tail of the log,
:mod:`.server` the asyncio shell (:class:`Broker`), :mod:`.app` the ``filemq broker`` process.
"""

from filemq.broker.core import ClientInfo, HookResult, PublishHook
from filemq.broker.server import Broker

__all__ = ["Broker", "ClientInfo", "HookResult", "PublishHook"]
