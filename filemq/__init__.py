"""filemq: the MQTT broker and the queue over the segment log, in layers.

Each subpackage is one layer and imports only the layers below it (checked by
import-linter in ``make test``; the contracts are in setup.cfg ``[importlinter]``)::

    filemq.ops        operations: the broker process, service loop, status, metrics endpoint
      │
    filemq.broker     sessions, routing, delivery and acks, auth, ACL, $SYS, the asyncio shell
      │
    filemq.queue  ·  filemq.mqtt  ·  filemq.upstream      (independent of each other)
    the queue over    sans-I/O MQTT     the upstream batch
    the log           codec + client    wire format
      │
    filemq.common     vocabulary every layer uses: topic grammar, configuration schema
      │
    segments          the on-disk log (a separate top-level package below filemq)

Nothing in filemq imports ``worker_agent``, ``collector``, ``spark_ingest``, ``demo`` or
``bench``: those are applications of it.
"""
