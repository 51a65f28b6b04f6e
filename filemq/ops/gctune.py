"""The cyclic garbage collector's settings for the long-running processes (broker, agent).

Every log record is a tuple (a ``NamedTuple`` subclass, which the collector never untracks),
and the broker's tail cache holds tens of thousands of them (``broker.cache_bytes``). At
CPython's defaults a young collection ran every 700 allocations of such objects, and a full
collection -- which visits every tracked object, the cache and everything imported at start
included -- each time the survivors grew by a quarter: on a broker ingesting 100-byte
messages with a 16 MiB cache that was a measurable share of its CPU per message
(docs/PERFORMANCE.md). Two settings, for both processes:

* ``gc.freeze()`` once started: the modules, classes and functions of the start-up move to
  the permanent generation, which no collection visits (they live as long as the process);
* a young-generation threshold of :data:`GC_YOUNG_THRESHOLD` allocations: fewer young (and
  so middle and full) collections; the older thresholds stay as they are.

Cycles are still collected, only less often; a reference cycle's memory lives a little
longer. What a caller may rely on: :func:`tune_gc` is idempotent and changes nothing but the
collector's thresholds and its frozen generation.
"""

from __future__ import annotations

import gc

GC_YOUNG_THRESHOLD = 20_000
"""Young-generation threshold (CPython's default: 700). The agent measured a backlog drain
that ran a young collection every ~700 records, ~20 % of reading and acknowledging one."""


def tune_gc(*, freeze: bool = True) -> None:
    """Collect the young generation less often; with ``freeze``, first collect once and move
    every object alive now to the permanent generation (call it when start-up is done)."""
    if freeze:
        gc.collect()
        gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
