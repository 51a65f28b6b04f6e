"""What the broker core's parts need of the queue (:class:`QueuePort`): a protocol, so the
parts depend on these methods, not on :class:`filemq.queue.Queue` itself, and a test fake
stands in for it (also in the compiled build, where a parameter typed with a class is checked
at run time and one typed with a protocol is not)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from filemq.queue.groups import ConsumerGroup, OffsetSnapshot, Start
    from segments.log import LogView


class QueuePort(Protocol):
    """The subset of :class:`filemq.queue.Queue` the broker core uses."""

    @property
    def log(self) -> LogView: ...

    def publish_nowait(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                       timestamp_us: int | None = None, *, validated: bool = False,
                       headers: bytes = b"") -> tuple[int, asyncio.Future[None]]: ...

    def publish_many_nowait(self, topics: list[str], payloads: list[bytes], retains: list[bool], qos: int,
                            timestamp_us: int, headers: list[bytes] | None = None,
                            ) -> tuple[int, asyncio.Future[None]]: ...

    def add_commit_listener(self, callback: Callable[[int], None]) -> None: ...

    def group(self, name: str, filters: Sequence[str] | None = None, durable: bool = True,
              start: Start | int = "latest") -> ConsumerGroup: ...

    def get_group(self, name: str) -> ConsumerGroup | None: ...

    def drop_group(self, name: str) -> bool: ...

    def groups_acked(self) -> int: ...

    def journal_progress(self) -> int: ...

    def persist_due(self) -> list[tuple[ConsumerGroup, OffsetSnapshot]]: ...

    def write_snapshots(self, snapshots: list[tuple[ConsumerGroup, OffsetSnapshot]]) -> None: ...
