"""The upstream wire contract shared by the forwarder (``worker_agent``) and the collector:
the CRC-checked record batch carried in MQTT PUBLISH payloads (:mod:`.batch`).

May import: ``filemq.common``. Must not import the queue, the broker or operations.
"""
