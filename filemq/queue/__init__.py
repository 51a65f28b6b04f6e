"""The queue over the log: consumer groups with Doing/Pending offsets (:mod:`.groups`,
:mod:`.offsets`), retained messages (:mod:`.retained`) and the :class:`Queue` API
(:mod:`.api`) that owns the log, its group commit and the groups.

May import: ``segments`` and ``filemq.common``. Must not import MQTT (``filemq.mqtt``),
the broker, the upstream wire format or operations.
"""

from filemq.queue.api import GROUPS_DIR, LOG_DIR, Queue, QueueConfig

__all__ = ["GROUPS_DIR", "LOG_DIR", "Queue", "QueueConfig"]
