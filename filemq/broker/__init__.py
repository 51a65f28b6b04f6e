"""The MQTT 3.1.1 broker on the log: durable acks, persistent sessions, auth and ACL.

Modules, as in h11 (the state machine apart from the I/O):

* :mod:`.session` — :class:`~.session.Connection`, the per-connection state machine (bytes in,
  bytes out); it talks to the core through the :class:`~.session.Core` Protocol.
* :mod:`.core` — :class:`~.core.BrokerCore`, the broker's rules as composed parts, each
  owning its state (types in :mod:`.state`), wired in its ``__init__``: :mod:`.router` (topic
  trie, shares, consumer groups), :mod:`.registry` (sessions, session files, expiry, wills),
  :mod:`.connect` (CONNECT, session ownership), :mod:`.subscribe` (SUBSCRIBE/UNSUBSCRIBE),
  :mod:`.retain` (retained messages), :mod:`.publish` (inbound PUBLISH, durable acks,
  routing), :mod:`.delivery` (outbound delivery, the QoS 1/2 ack state machine, the output
  path), :mod:`.systopics` (``$SYS``).  docs/LAYERS.md draws them.
* :mod:`.sessions` the durable session store, :mod:`.tailcache` the in-memory tail of the log,
  :mod:`.auth` / :mod:`.acl` logins and rights, :mod:`.sysinfo` the ``$SYS`` figures,
  :mod:`.metrics` the Prometheus families, :mod:`.server` the asyncio shell (:class:`Broker`),
  :mod:`.websocket` MQTT over WebSockets.

May import: ``filemq.queue``, ``filemq.mqtt``, ``filemq.common`` and ``segments``. Must not
import ``filemq.upstream`` (the broker does not know what its publishers carry) or
``filemq.ops`` (the process that runs it is ``filemq.ops.broker_app``).
"""

from filemq.broker.core import ClientInfo, HookResult, PublishHook
from filemq.broker.server import Broker

__all__ = ["Broker", "ClientInfo", "HookResult", "PublishHook"]
