"""Group commit on asyncio: one fdatasync acknowledges every append that arrived meanwhile.

Appends run on the event loop and only buffer in memory.  The first append of a batch asks
for a commit at the end of the current loop pass; the commit swaps the buffer out, writes it
(and, under ``always``, fdatasyncs it), then resolves the batch's one shared future.  Appends
that arrive during that fsync form the next batch.

Where the commit runs (``on_loop_max_ms``): while fdatasync is quick (the default: at most
20 ms) and the batch is small (at most ``ON_LOOP_MAX_RECORDS``), on the event loop itself, as
Redis runs ``appendfsync always``.  A durable ack waits for the sync anyway, and what arrives
on every socket meanwhile is then read in the next loop pass, together: at everyday rates (a
few messages per commit) this saves each commit two thread hand-offs, a self-pipe wake-up and
the future chaining of ``run_in_executor``, and lets the loop wake once per commit instead of
once per message.  The loop is held for at most one sync: a sync slower than the bound moves
the commits to a dedicated thread (the loop keeps serving pings, CONNACKs and reads meanwhile)
until a sync there takes at most half the bound.  A bigger batch (more than
``ON_LOOP_MAX_RECORDS`` records or ``ON_LOOP_MAX_BYTES`` bytes: load, not trickle) is
committed on the thread too, so the loop reads on while it writes.  0 keeps every commit on
the thread; the ``interval`` policy always uses it.

Loss windows (see docs/FORMAT.md, "Durability"):

* ``always``   - a future resolves only after the fdatasync covering its record: nothing
  acknowledged is lost on power loss.
* ``interval`` - a future resolves after the write to the OS; fdatasync runs every
  ``interval_ms``: up to ``interval_ms`` (plus one fsync) of acknowledged appends may be
  lost on power loss, none on a process crash.
* ``never``    - no explicit fdatasync (except at roll and close): the kernel's dirty
  writeback decides, typically up to ~30 s on Linux; none on a process crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from segments.log import Batch, Log

log = logging.getLogger(__name__)

# A batch of more records than this is committed on the thread even while syncs are quick:
# that many in one loop pass means load, where writing while the loop reads on (pipelining)
# is what keeps the rate, not saving a hand-off per commit (at a device's everyday rates a
# batch holds a few records).
ON_LOOP_MAX_RECORDS = 32
# ... and a batch of more bytes than this: big records take the write itself long enough
# that the loop should keep serving other clients meanwhile.
ON_LOOP_MAX_BYTES = 256 * 1024


class FsyncPolicy(enum.StrEnum):
    """When the commit task calls fdatasync."""

    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


class GroupCommitter:
    """Batches appends to one :class:`Log` and commits each batch with one write (+ fdatasync).

    All methods except :meth:`close` / :meth:`start` / :meth:`append` /
    :meth:`wait_committed` are plain functions that must be called on the event loop thread.
    """

    def __init__(
        self, log: Log, *, policy: FsyncPolicy | str | None = None, interval_ms: int | None = None,
        max_batch_bytes: int = 4 << 20, on_loop_max_ms: float | None = None,
    ) -> None:
        self.log = log
        self.policy = FsyncPolicy(policy if policy is not None else log.config.fsync)
        self.interval = (interval_ms if interval_ms is not None else log.config.fsync_interval_ms) / 1000
        self.max_batch_bytes = max_batch_bytes
        self.commits = 0
        self.commits_on_loop = 0
        self.moves_to_thread = 0  # times a slow sync moved the commits off the loop
        # Commits on the loop while a sync takes at most this long (s); None: never (the
        # interval policy keeps its timed syncs on the thread).
        bound = log.config.commit_on_loop_max_ms if on_loop_max_ms is None else on_loop_max_ms
        self.on_loop_max = bound / 1000 if bound > 0 and self.policy is not FsyncPolicy.INTERVAL else None
        self._on_loop = self.on_loop_max is not None  # the mode now (a slow sync clears it)
        self._commit_soon = False  # a commit on the loop is scheduled (call_soon)
        self._thread_busy = False  # the commit task is writing a batch in its thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._open: asyncio.Future[None] | None = None  # the batch appends currently join
        self._open_bytes = 0
        self._closed_batches: list[tuple[int, asyncio.Future[None]]] = []  # (end_offset, future)
        self._wake = asyncio.Event()
        self._closing = False
        self._listeners: list[Callable[[int], None]] = []
        self._companions: list[Callable[[], None]] = []
        self._companion_needed: list[Callable[[], bool] | None] = []
        self._companion_task: asyncio.Future[None] | None = None  # a companion sync running
        self._companion_again = False
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiter_ids = itertools.count()

    async def start(self) -> None:
        """Start the commit task on the running loop."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="filemq-commit")
        self._task = self._loop.create_task(self._run(), name="filemq-group-commit")

    async def close(self) -> None:
        """Commit and fdatasync everything appended so far, then stop.  Idempotent."""
        if self._task is None or self._closing:
            return
        self._closing = True
        self._wake.set()
        await self._task
        while self._companion_task is not None:  # the journal's last sync, then stop
            await asyncio.gather(self._companion_task, return_exceptions=True)
            await asyncio.sleep(0)
        assert self._loop is not None and self._executor is not None
        try:
            await self._loop.run_in_executor(self._executor, self.log.sync)
        finally:  # a failed final sync (DiskFull, EIO) must not leak the commit thread
            self._executor.shutdown(wait=True)

    def append_nowait(
        self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False,
        timestamp_us: int | None = None, headers: bytes = b"",
    ) -> tuple[int, asyncio.Future[None]]:
        """Buffer a record (``headers``: see :meth:`segments.log.Log.append`); return its
        offset and its batch's commit future.

        The future is shared by the whole batch: await it through :func:`asyncio.shield` if
        the awaiting task may be cancelled.  It raises DiskFull/OSError if the commit failed;
        then the record is not readable and its offset is reused.
        """
        if self._task is None or self._closing:
            raise RuntimeError("GroupCommitter is not running")
        offset = self.log.append_positional(topic, payload, qos, retain, timestamp_us, headers)
        future = self._open
        if future is None:
            future = self._open_batch()
        self._open_bytes += len(payload) + len(topic) + 28
        if headers:
            self._open_bytes += len(headers) + 4
        if self._open_bytes >= self.max_batch_bytes:
            self._closed_batches.append((offset + 1, future))
            self._open = None
        return offset, future

    def _open_batch(self) -> asyncio.Future[None]:
        """A new open batch (its commit future), and its commit asked for: at the end of this
        loop pass on the loop, or by waking the commit thread."""
        loop = self._loop
        assert loop is not None
        future = self._open = loop.create_future()
        self._open_bytes = 0
        if self._on_loop and not self._thread_busy:
            if not self._commit_soon:
                self._commit_soon = True
                loop.call_soon(self._commit_on_loop)
        else:
            self._wake.set()
        return future

    def _commit_on_loop(self) -> None:
        """Commit everything buffered, here on the loop thread (see the module docstring)."""
        self._commit_soon = False
        if self._open is None and not self._closed_batches:
            return
        log_ = self.log
        if not self._on_loop or self._thread_busy or self._closing or \
                log_.next_offset - log_.committed_offset > ON_LOOP_MAX_RECORDS or \
                log_.uncommitted_bytes > ON_LOOP_MAX_BYTES:
            self._wake.set()  # the commit task takes it
            return
        batches, batch = self._take()
        sync = self.policy is FsyncPolicy.ALWAYS
        started = time.monotonic()
        try:
            if batch is not None:
                self.log.write_batch(batch, sync)
        except Exception as exc:
            self._fail(batches, exc)
            return
        took = time.monotonic() - started
        self.commits += 1
        self.commits_on_loop += 1
        assert self.on_loop_max is not None
        if took > self.on_loop_max:
            self._on_loop = False
            self.moves_to_thread += 1
            log.warning("%s: a commit took %.0f ms (over [log] commit_on_loop_max_ms %.0f): commits move to "
                        "the commit thread until a sync is quick again", self.log.directory, took * 1000,
                        self.on_loop_max * 1000)
        self._committed(batches, sync)

    def _take(self) -> tuple[list[tuple[int, asyncio.Future[None]]], Batch | None]:
        """Close the open batch and take every closed one, with the log's buffered records
        (the first step of a commit, on the loop or on the thread)."""
        if self._open is not None:
            self._closed_batches.append((self.log.next_offset, self._open))
            self._open = None
        batches, self._closed_batches = self._closed_batches, []
        return batches, self.log.take_batch()

    def _committed(self, batches: list[tuple[int, asyncio.Future[None]]], synced: bool) -> None:
        """After a successful commit (loop thread): companions, futures, waiters, listeners."""
        if synced:
            self._start_companions()
        for _, future in batches:
            if not future.done():
                future.set_result(None)
        self._notify(self.log.committed_offset)

    def append_many_nowait(
        self, topics: list[str], payloads: list[bytes], retains: list[bool], qos: int, timestamp_us: int,
        headers: list[bytes] | None = None,
    ) -> tuple[int, asyncio.Future[None]]:
        """:meth:`append_nowait` for several records at once (:meth:`segments.log.Log.append_many`,
        ``headers`` one per record or None):
        returns the first one's offset and the one commit future they all share.  On an error
        the records buffered before the failing one are committed with the open batch."""
        if self._task is None or self._closing:
            raise RuntimeError("GroupCommitter is not running")
        future = self._open
        if future is None:
            future = self._open_batch()
        log_ = self.log
        before = log_._pending_bytes
        try:
            first = log_.append_many(topics, payloads, retains, qos, timestamp_us, headers)
        finally:
            self._open_bytes += log_._pending_bytes - before
            if self._open_bytes >= self.max_batch_bytes:
                self._closed_batches.append((log_.next_offset, future))
                self._open = None
        return first, future

    async def append(
        self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False,
        timestamp_us: int | None = None, headers: bytes = b"",
    ) -> int:
        """Append and wait until committed under the policy; returns the offset."""
        offset, future = self.append_nowait(topic, payload, qos=qos, retain=retain, timestamp_us=timestamp_us,
                                            headers=headers)
        await asyncio.shield(future)
        return offset

    async def wait_committed(self, offset: int) -> None:
        """Return once ``log.committed_offset > offset`` (for consumers tailing the log)."""
        if self.log.committed_offset > offset:
            return
        assert self._loop is not None, "start() first"
        future: asyncio.Future[None] = self._loop.create_future()
        heapq.heappush(self._waiters, (offset, next(self._waiter_ids), future))
        await future

    def add_sync_companion(self, sync: Callable[[], None], needed: Callable[[], bool] | None = None) -> None:
        """Run ``sync()`` after each commit that fdatasynced the log, so another file (the
        consumer groups' progress journal) is made durable with the group commit, without a
        schedule of its own. It runs in a thread of its own, overlapping the next log write
        (so it never lengthens a commit cycle); while one runs, later commits coalesce into
        one more run. Its errors are logged, never fail a commit. ``needed()`` (on the loop
        thread) says whether it has anything to sync: when no companion needs to, no thread
        is woken for them (e.g. an ingest with no subscriber acks has no journal to sync)."""
        self._companions.append(sync)
        self._companion_needed.append(needed)

    def _sync_companions(self) -> None:
        for companion in self._companions:
            try:
                companion()
            except OSError as exc:
                log.warning("%s: sync companion %r failed: %s", self.log.directory, companion, exc)

    def _start_companions(self) -> None:
        """After a synced commit (loop thread): start the companions, or note another run."""
        if not self._companions:
            return
        if None not in self._companion_needed and not any(needed() for needed in self._companion_needed
                                                          if needed is not None):
            return
        if self._companion_task is not None:
            self._companion_again = True
            return
        assert self._loop is not None
        self._companion_task = self._loop.run_in_executor(None, self._sync_companions)
        self._companion_task.add_done_callback(self._companions_done)

    def _companions_done(self, _fut: asyncio.Future[None]) -> None:
        self._companion_task = None
        if self._companion_again:
            self._companion_again = False
            self._start_companions()

    def add_commit_listener(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(committed_offset)`` on the loop after each successful commit."""
        self._listeners.append(callback)

    # -- the commit task -------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._loop is not None and self._executor is not None
        loop, executor = self._loop, self._executor
        last_sync = time.monotonic()
        dirty = False
        while True:
            # (a commit already asked of the loop is the loop's, unless it hands it over)
            if (self._open is None and not self._closed_batches) or (self._commit_soon and not self._closing):
                if self._closing:
                    return
                self._wake.clear()
                if dirty and self.policy is FsyncPolicy.INTERVAL:
                    due = last_sync + self.interval - time.monotonic()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), max(due, 0))
                    if time.monotonic() >= last_sync + self.interval:
                        try:
                            await loop.run_in_executor(executor, self.log.datasync)
                        except OSError:
                            log.exception("%s: periodic fdatasync failed", self.log.directory)
                        last_sync, dirty = time.monotonic(), False
                else:
                    await self._wake.wait()
                continue
            batches, batch = self._take()
            now = time.monotonic()
            sync = self.policy is FsyncPolicy.ALWAYS or (
                self.policy is FsyncPolicy.INTERVAL and now - last_sync >= self.interval
            )
            self._thread_busy = True
            took = 0.0
            try:
                if batch is not None:
                    took = await loop.run_in_executor(executor, self._write_timed, batch, sync)
            except Exception as exc:  # every failure goes to the waiters, the task keeps running
                self._thread_busy = False
                self._fail(batches, exc)
                continue
            self._thread_busy = False  # (not in a finally: mypyc cannot compile continue in one)
            self.commits += 1
            if self.on_loop_max is not None and not self._on_loop and took <= self.on_loop_max / 2:
                self._on_loop = True  # quick again: back to the loop
                log.info("%s: commits are quick again (%.1f ms): back on the event loop", self.log.directory,
                         took * 1000)
            if sync:
                last_sync, dirty = now, False
            else:
                dirty = True
            self._committed(batches, sync)

    def _write_timed(self, batch: Batch, sync: bool) -> float:
        """:meth:`Log.write_batch` in the commit thread; returns how long it took (s)."""
        started = time.monotonic()
        self.log.write_batch(batch, sync)
        return time.monotonic() - started

    def _fail(self, batches: list[tuple[int, asyncio.Future[None]]], exc: Exception) -> None:
        # Runs on the loop, so no append can slip in between dropping the buffer and failing
        # the futures of everything in it: what is reported failed is exactly what was dropped.
        self.log.discard_pending()
        failed = batches + self._closed_batches
        if self._open is not None:
            failed.append((self.log.next_offset, self._open))
        self._open, self._closed_batches = None, []
        for _, future in failed:
            if not future.done():
                future.set_exception(exc)
                future.exception()  # mark retrieved: fire-and-forget producers need not await
        log.error("%s: commit failed (%s); %d batches reported failed", self.log.directory, exc, len(failed))

    def _notify(self, committed: int) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] < committed:
            future = heapq.heappop(waiters)[2]
            if not future.done():
                future.set_result(None)
        for callback in self._listeners:
            try:
                callback(committed)
            except Exception:
                log.exception("commit listener %r failed", callback)
