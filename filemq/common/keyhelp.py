"""What ``filemq broker|agent|collector --help`` says about each configuration key: its
section, a one-line meaning, the range its checker accepts and its default.

Range and default come from :mod:`filemq.common.config` (the key's checker and dataclass
default), so the help cannot drift from what the validator accepts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from filemq.common.config import _SECTIONS, GIB, KIB, MIB, Checker, Config, _Bad

# -- help text for the command-line flags (cli.py) -----------------------------------------
# key -> (help section, one-line meaning, what an unset (None) default means). The section
# groups `filemq broker|agent|collector --help`; range and default come from the key's
# checker and dataclass default above, so the help cannot drift from what is accepted.

HELP_SECTIONS = {
    "general": "General options",
    "upstream": "Upstream (forwarding to the collector)",
    "landing": "Landing (Parquet files)",
    "listener": "Listener",
    "security": "Security",
    "limits": "Limits",
    "log": "Log (storage and durability)",
}

_KEY_HELP: dict[str, tuple[str, str, str]] = {
    "data_dir": ("general", "Data directory: the log, offsets, sessions and retained.snap", "required"),
    "listener": ("listener", "A listener (repeatable; replaces --host/--port/--tls-*), e.g. "
                 "'0.0.0.0:8883,tls_cert=c.pem,tls_key=k.pem,require_certificate=true' or "
                 "'0.0.0.0:8080,protocol=websockets'", "the --host/--port shorthand"),
    "log.segment_bytes": ("log", "Roll to a new segment file at this size", ""),
    "log.index_interval_bytes": ("log", "Bytes of records between two sparse-index entries", ""),
    "log.fsync": ("log", "always: fdatasync before any ack; interval: ack first, sync every "
                  "fsync_interval_ms; never: leave it to the OS", ""),
    "log.fsync_interval_ms": ("log", "Sync period in milliseconds for --fsync interval", ""),
    "log.retention_bytes": ("log", "Delete the oldest whole segments once the log exceeds this size",
                            "no size cap"),
    "log.retention_ms": ("log", "Delete whole segments whose newest record is older than this (ms)",
                         "no age cap"),
    "log.min_free_bytes": ("log", "Refuse appends (no ack) when the file system has less free space", ""),
    "log.commit_on_loop_max_ms": ("log", "Run group commits on the event loop while an fdatasync takes at "
                                  "most this long (ms), else on a thread; 0: always on the thread", ""),
    "broker.host": ("listener", "Address the broker listens on; off loopback it needs a password "
                    "file or allow_anonymous", ""),
    "broker.port": ("listener", "Plain MQTT port", ""),
    "broker.password_file": ("security", "Users and password hashes (filemq passwd); clients must "
                             "log in", "no logins"),
    "broker.acl_file": ("security", "ACL file in Mosquitto's format", "everything allowed"),
    "broker.allow_anonymous": ("security", "Let clients without a username in, also beside a "
                               "password file", "only when there is no password file"),
    "broker.login_failures_before_delay": ("security", "Failed logins in a row from one address after "
                                           "which its password checks are spaced out (0 = never)", ""),
    "broker.login_failure_delay_ms": ("security", "Milliseconds between two password checks of an "
                                      "address past login_failures_before_delay", ""),
    "broker.max_connections": ("limits", "Connected clients at most; a CONNECT beyond gets CONNACK 3", ""),
    "broker.max_connecting": ("limits", "Sockets still in their CONNECT at most (counted apart); at "
                              "the limit accepting stops, or the socket silent the longest is closed", ""),
    "broker.max_uncommitted_bytes": ("limits", "Bytes accepted and not yet durable at most; at the bound "
                                     "publishers are not read until commits catch up", "32 MiB (collector: 256 MiB)"),
    "broker.listen_backlog": ("limits", "Connections the kernel holds while max_connecting sockets are "
                              "half-open (capped by net.core.somaxconn)", ""),
    "broker.message_size_limit": ("limits", "Largest PUBLISH or will payload in bytes; larger closes "
                                  "the connection, nothing stored or acknowledged", "only max_packet_size"),
    "broker.max_packet_size": ("limits", "A larger packet closes its connection (bytes)", ""),
    "broker.max_inflight": ("limits", "Unacknowledged QoS 1/2 messages per subscriber", ""),
    "broker.ack_pacing": ("limits", "Linux: TCP_QUICKACK after a read of a subscriber's acks, so "
                          "clients with Nagle's algorithm on are not held up (docs/BROKER.md)", ""),
    "broker.ack_batching": ("limits", "Linux: SO_RCVLOWAT while a subscriber that acks one by one owes "
                            "the acks of its next refill: fewer wake-ups (docs/BROKER.md)", ""),
    "broker.cache_bytes": ("limits", "Memory for recent records, so subscribers that keep up or "
                           "lag a little read them without the disk (bytes)", ""),
    "broker.max_topic_length": ("limits", "Longest topic or filter in bytes; longer is a protocol error", ""),
    "broker.keepalive_max": ("limits", "Cap on the keepalive a client may ask for (seconds)", "no cap"),
    "broker.receive_maximum": ("limits", "MQTT 5: unacknowledged QoS 1/2 PUBLISHes a client may send "
                               "(CONNACK Receive Maximum); more gets DISCONNECT 0x93", "1024"),
    "broker.topic_alias_maximum": ("limits", "MQTT 5: topic aliases a client may set per connection "
                                   "(0 = none)", ""),
    "broker.tls_port": ("listener", "TLS listener port, used when --tls-cert is set", ""),
    "broker.tls_cert": ("security", "PEM certificate chain; enables the TLS listener", "no TLS"),
    "broker.tls_key": ("security", "PEM private key for the TLS certificate", "no TLS"),
    "broker.event_loop": ("general", "asyncio event loop: auto = uvloop where installed, else the "
                          "standard one; uvloop = refuse to start without it", ""),
    "broker.sys_interval_s": ("listener", "Seconds between $SYS/broker/... updates (0 = off)", ""),
    "broker.acl_denied_publish": ("security", "A PUBLISH the ACL denies: ack_drop acknowledges and "
                                  "drops it; disconnect closes the connection unacknowledged", ""),
    "broker.metrics_port": ("listener", "Serve Prometheus metrics on 127.0.0.1:PORT", "off"),
    "broker.auto_subscribe": ("listener", "Subscription added to every persistent session, e.g. "
                              "'cmd/%c/# qos 1' (%c client id, %u username); repeatable", "none"),
    "agent.device_id": ("upstream", "This device's id: idempotency key and upstream client id", "required"),
    "agent.collector": ("upstream", "Upstream collector as HOST:PORT", "required"),
    "agent.username": ("upstream", "Upstream login", "none"),
    "agent.password": ("upstream", "Upstream password (prefer --password-file)", "none"),
    "agent.password_file": ("upstream", "File whose first line is the upstream password", "none"),
    "agent.tls_ca": ("upstream", "PEM CA bundle: enables TLS to the collector and verifies it", "plain TCP"),
    "agent.batch_records": ("upstream", "Records per upstream batch at most", ""),
    "agent.batch_bytes": ("upstream", "Bytes per upstream batch at most", ""),
    "agent.linger_ms": ("upstream", "Wait this long (ms) for a batch to fill", ""),
    "agent.window": ("upstream", "Batches in flight (sent, not yet acknowledged)", ""),
    "agent.compression": ("upstream", "Compression of batch payloads", ""),
    "agent.rate_limit_bytes_per_s": ("upstream", "Cap on upstream bandwidth (bytes per second)", "unlimited"),
    "agent.upstream_max_packet_size": ("upstream", "Largest PUBLISH sent upstream; a record too large "
                                       "on its own is set aside (counted, logged)", ""),
    "agent.backoff_initial_ms": ("upstream", "First reconnect delay (ms); doubles with jitter", ""),
    "agent.backoff_max_ms": ("upstream", "Longest reconnect delay (ms)", ""),
    "agent.metrics_port": ("listener", "Serve Prometheus metrics (forwarder and broker) on "
                           "127.0.0.1:PORT", "off"),
    "agent.stream": ("upstream", "Stream name in the batch topic and the idempotency key", ""),
    "agent.ack_timeout_ms": ("upstream", "Reconnect and resend when a batch is not acknowledged "
                             "within this time (ms)", ""),
    "agent.health_interval_s": ("upstream", "Seconds between health reports to each collector (one also "
                                "at every connect); 0 sends none", ""),
    "agent.export": ("upstream", "An export NAME=URL (repeatable): filemq[s]://HOST:PORT (collector) or "
                     "mqtt[s]://HOST[:PORT] (any MQTT broker); more keys in [[export]] tables", "none"),
    "uplink.rate_limit_bytes_per_s": ("upstream", "Bytes per second for all exports together, "
                                      "higher priority first", "unlimited"),
    "collector.host": ("listener", "Address the collector listens on; off loopback it needs a "
                       "password file or allow_anonymous", ""),
    "collector.port": ("listener", "Port devices connect to", ""),
    "collector.password_file": ("security", "Device logins (filemq passwd)", "no logins"),
    "collector.acl_file": ("security", "ACL file; recommended line: pattern write filemq/v1/%u/#",
                           "everything allowed"),
    "collector.allow_anonymous": ("security", "Let devices without a username in, also beside a "
                                  "password file", "only when there is no password file"),
    "collector.max_connections": ("limits", "Device connections at most", "sized from the "
                                  "file-descriptor limit"),
    "collector.collector_id": ("landing", "Id written into every landed row and file name", "the host name"),
    "collector.landing": ("landing", "Landing directory (_staging/, incoming/dt=.../)", "required"),
    "collector.roll_bytes": ("landing", "Roll the Parquet file at this size", ""),
    "collector.roll_seconds": ("landing", "Roll the Parquet file at this age (seconds)", ""),
    "collector.metrics_port": ("listener", "The operations HTTP port: /metrics, /api/fleet, /fleet "
                               "on ops_host:PORT", "off"),
    "collector.ops_host": ("listener", "Address of the operations HTTP port (loopback unless set)", ""),
    "collector.fleet_behind_records": ("general", "A device whose export lag exceeds this many records "
                                       "is 'behind'", ""),
    "collector.fleet_behind_age_s": ("general", "A device whose oldest unacknowledged record is older "
                                     "than this (s) is 'behind'", ""),
    "collector.fleet_disk_low_bytes": ("general", "A device with less free disk than this is 'disk_low'", ""),
    "collector.fleet_stale_intervals": ("general", "A connected device silent for this many health "
                                        "intervals is 'stale'", ""),
    "collector.fleet_device_labels": ("general", "Fleet metrics with one label per device (cardinality!)",
                                      ""),
    "collector.fleet_max_devices": ("limits", "Devices the fleet registry keeps at most (the longest "
                                    "offline go first)", ""),
    "ingest.landing": ("general", "Landing directory to read", "required"),
    "ingest.table": ("general", "Curated table directory (Parquet, partitioned by dt)", "required"),
    "ingest.checkpoint": ("general", "Streaming checkpoint directory, one per table", "required"),
    "ingest.spark_master": ("general", "Spark master URL", ""),
    "ingest.payload": ("general", "json parses payloads into the --payload-schema columns", ""),
    "ingest.payload_schema": ("general", "Spark DDL of the JSON payload", "none"),
    "ingest.fleet_events_table": ("general", "The fleet_events table (connects, disconnects, health)",
                                  "fleet_events beside the table"),
    "ingest.fleet_events_checkpoint": ("general", "Checkpoint of the fleet_events table",
                                       "<checkpoint>_fleet_events"),
    "ingest.archive": ("general", "Move ingested landing files here after their batch commits", "none"),
    "ingest.every_s": ("general", "Keep running: a micro-batch every N seconds", "run once"),
    "ingest.max_files_per_batch": ("general", "Landing files per micro-batch at most", ""),
}


@dataclass(frozen=True)
class KeyHelp:
    """What ``--help`` says about a key: its section, meaning, accepted values and default."""

    key: str
    section: str
    meaning: str
    accepts: str | None  # from the key's checker; None for any non-empty string
    default: str  # the default as a flag value ("64 MiB", "always") or "none (...)" when unset

    @property
    def text(self) -> str:
        return f"{self.meaning}; {self.accepts}." if self.accepts else f"{self.meaning}."


def _field(key: str) -> dataclasses.Field[Any]:
    section, _, name = key.rpartition(".")
    cls = _SECTIONS[section] if section else Config
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _default_text(value: Any, check: Checker, unset: str) -> str:
    if value is None or value == ():
        return f"none ({unset})" if unset and unset != "none" else "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        for unit, n in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
            if value >= n and value % n == 0:
                text = f"{value // n} {unit}"
                try:
                    if check(text, True) == value:  # a size key: show it as one
                        return text
                except _Bad:
                    pass
        return str(value)
    return str(value)


def key_help(key: str) -> KeyHelp:
    """The help of a dotted key (``"broker.max_inflight"``), from :data:`_KEY_HELP`, the
    key's checker (range) and its default; keys without an entry get a generic meaning."""
    f = _field(key)
    check: Checker = f.metadata["check"]
    section, meaning, unset = _KEY_HELP.get(key, ("general", f"Config key {key}", ""))
    try:
        check(object(), False)  # every checker refuses this and says what it accepts
        accepts = None
    except _Bad as bad:
        accepts = None if bad.expected == "a non-empty string" else bad.expected
    section_name, _, name = key.rpartition(".")
    default = getattr(getattr(Config(), section_name) if section_name else Config(), name)
    return KeyHelp(key, section, meaning, accepts, _default_text(default, check, unset))
