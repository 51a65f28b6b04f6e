"""The ``filemq agent`` process: the device broker and the forwarder in one event loop.

:func:`run_agent` returns the process exit code: 0 after a clean shutdown (SIGTERM/SIGINT:
stop forwarding -- unacknowledged records stay in the log for next time --, stop the broker,
persist offsets and sessions), 2 for a configuration problem, 1 for a runtime failure.

The agent ships its log through its exports (:mod:`worker_agent.exports`): each a durable
consumer group ``export.NAME`` (created at the log's first offset, so records published before
the agent first ran are shipped too) to a filemq collector or any MQTT broker. Their progress
is published under ``$SYS/broker/export/NAME/...`` (and, for the first collector export, the
older ``$SYS/broker/forwarder/...``) every ``broker.sys_interval_s`` and is visible in
``filemq status DIR``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from filemq.broker import Broker
from filemq.broker.metrics import backlog_status
from filemq.common.aio import cancel_and_wait
from filemq.common.config import Config, ConfigError
from filemq.ops.eventloop import serves_tls
from filemq.ops.gctune import tune_gc
from filemq.ops.service import Sidecar, run_until_signalled, serve_until_signalled
from worker_agent.exports import Exports
from worker_agent.exports import describe as describe_exports
from worker_agent.forwarder import Forwarder, ForwarderConfig, Upstream
from worker_agent.health import HealthReporter

log = logging.getLogger("filemq.agent")

# The group of the --collector export (named "forwarder" before exports; renamed at start).
GROUP_NAME = "export.collector"


def forwarder_config(config: Config) -> ForwarderConfig:
    """The ``[agent]`` forwarder settings (the defaults of collector exports); ConfigError if incomplete."""
    a = config.agent
    if a.device_id is None:
        raise ConfigError("the agent needs a device id (agent.device_id, flag --device-id)", key="agent.device_id")
    if not config.exports:
        raise ConfigError("the agent needs the collector's address (agent.collector, flag --collector HOST:PORT) "
                          "or an export (flag --export NAME=URL, or an [[export]] table)", key="agent.collector")
    try:
        return ForwarderConfig(
            device_id=a.device_id,
            stream=a.stream,
            batch_records=a.batch_records,
            batch_bytes=a.batch_bytes,
            linger_s=a.linger_ms / 1000,
            window=a.window,
            compression=a.compression,
            rate_limit_bytes_per_s=a.rate_limit_bytes_per_s,
            backoff_initial_s=a.backoff_initial_ms / 1000,
            backoff_max_s=a.backoff_max_ms / 1000,
            ack_timeout_s=a.ack_timeout_ms / 1000,
            upstream_max_packet_size=a.upstream_max_packet_size,
        )
    except ValueError as exc:
        raise ConfigError(f"agent: {exc}", key="agent.device_id") from exc


class Agent:
    """A device broker plus its forwarder, startable and stoppable in-process."""

    def __init__(self, config: Config, *, connect: Callable[[], Upstream] | None = None) -> None:
        self.config = config
        self.forwarder_config = forwarder_config(config)
        self.exports = Exports(config, connect=connect)
        self.broker = Broker(config)
        # The first collector export's forwarder (legacy $SYS/broker/forwarder/..., metrics).
        self.forwarder: Forwarder | None = None
        self.health: HealthReporter | None = None  # (set at start unless agent.health_interval_s = 0)
        self._sys_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.broker.start()
        queue = self.broker.queue
        assert queue is not None
        a = self.config.agent
        if a.health_interval_s > 0:
            self.health = HealthReporter(self.forwarder_config.device_id, self.forwarder_config.stream, self.broker,
                                         self.exports, a.health_interval_s)
        self.exports.start(queue, health=self.health.report if self.health is not None else None)
        self.forwarder = self.exports.forwarder
        if self.config.broker.sys_interval_s > 0:
            self._sys_task = asyncio.create_task(self._publish_sys(), name="filemq-agent-sys")
        log.info("agent %s exporting to %s", self.forwarder_config.device_id, describe_exports(self.exports))
        local, upstream = self.config.broker.max_packet_size, self.forwarder_config.upstream_max_packet_size
        if local > upstream and self.forwarder is not None:
            log.warning("broker.max_packet_size %d exceeds agent.upstream_max_packet_size %d: a local"
                        " message too large for the collector is skipped upstream (counted as"
                        " oversized_skipped, logged with its offset), not forwarded", local, upstream)

    async def stop(self) -> None:
        if self._sys_task is not None:
            await cancel_and_wait(self._sys_task)
        await self.exports.stop()
        await self.broker.stop()

    def reload(self) -> bool:
        """SIGHUP: the device broker re-reads its password and ACL files (:meth:`Broker.reload`)."""
        return self.broker.reload()

    async def _publish_sys(self) -> None:
        interval = self.config.broker.sys_interval_s
        while True:
            await asyncio.sleep(interval)
            core, fwd = self.broker.core, self.forwarder
            if core is not None:
                try:
                    core.publish_sys((fwd.sys_messages() if fwd is not None else []) + self.exports.sys_messages())
                except Exception:
                    log.exception("publishing forwarder $SYS topics failed; continuing")


async def serve_agent(config: Config, ready: Callable[[str], None] | None = None,
                      stop: asyncio.Event | None = None) -> int:
    """Start the agent, call ``ready(line)``, run until ``stop`` or a signal; the exit code."""

    def metrics(agent: Agent) -> Sidecar | None:
        if config.agent.metrics_port is None:
            return None
        from worker_agent.metrics import start_metrics_server

        return start_metrics_server(agent, config.agent.metrics_port)

    b = config.broker
    return await serve_until_signalled(
        lambda: Agent(config), name="agent", where=f"{b.host}:{b.port} (data dir {config.data_dir})",
        describe=lambda agent: (f"filemq agent {agent.forwarder_config.device_id}: broker listening on "
                                f"{agent.broker.listening}, data dir {agent.broker.data_dir}, "
                                f"exporting to {describe_exports(agent.exports)}"),
        log=log, ready=ready, stop=stop, sidecar=metrics, status=lambda agent: backlog_status(agent.broker))


def run_agent(config: Config, ready: Callable[[str], None] | None = None) -> int:
    """``filemq agent``: run until SIGTERM/SIGINT in a new event loop; the exit code."""
    tune_gc()
    return run_until_signalled(serve_agent(config, ready), name="agent", log=log, event_loop=config.broker.event_loop,
                               tls=serves_tls(config))
