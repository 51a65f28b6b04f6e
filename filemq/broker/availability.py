"""What admission and the ingest budget (issue 30) have done, for ``$SYS`` and the metrics.

One table of figures, read by :mod:`filemq.broker.metrics` (``filemq_broker_...``), by the
collector's metrics (``filemq_collector_...``) and by the broker's ``$SYS`` publication
(``$SYS/broker/availability/<figure>``); docs/BROKER.md lists them.
"""

from __future__ import annotations

from filemq.broker.admission import Admission
from filemq.broker.budget import IngestBudget


def availability_figures(admission: Admission | None, budget: IngestBudget | None) -> dict[str, int]:
    """Admission's and the ingest budget's figures (issue 30), by name: what ``$SYS``,
    the broker's and the collector's metrics publish."""
    figures: dict[str, int] = {}
    if admission is not None:
        st = admission.stats
        figures.update(half_open=len(admission.members) + admission.accepting,
                       silent_closed_at_accept=st.silent_closed_at_accept,
                       evicted_silent=st.evicted_silent, evicted_authenticating=st.evicted_authenticating,
                       accept_paused=st.paused)
    if budget is not None:
        figures.update(uncommitted_bytes=budget.log.uncommitted_bytes, uncommitted_limit_bytes=budget.limit,
                       readers_held=len(budget.held), reader_holds=budget.holds)
    return figures


AVAILABILITY_METRICS: tuple[tuple[str, str, str, str], ...] = (
    # (figure, metric name, kind, help)
    ("half_open", "connections_half_open", "gauge",
     "Accepted sockets that have not completed their CONNECT yet (admission's half-open set)"),
    ("silent_closed_at_accept", "admission_closed_silent_at_accept", "counter",
     "Sockets closed at accept: silent past the grace while waiting in the listen backlog"),
    ("evicted_silent", "admission_evicted_silent", "counter",
     "Half-open sockets closed to make room: silent the longest, past the grace"),
    ("evicted_authenticating", "admission_evicted_authenticating", "counter",
     "Half-open sockets closed to make room while their password check ran past the grace"),
    ("accept_paused", "admission_accept_paused", "counter",
     "Times accepting stopped because max_connecting sockets were half-open"),
    ("uncommitted_bytes", "ingest_uncommitted_bytes", "gauge",
     "Bytes accepted from publishers and not yet durable (the ingest budget's measure)"),
    ("uncommitted_limit_bytes", "ingest_uncommitted_limit_bytes", "gauge",
     "The ingest budget: at this many uncommitted bytes publishers stop being read"),
    ("readers_held", "ingest_readers_held", "gauge", "Connections not read now because the ingest budget is full"),
    ("reader_holds", "ingest_reader_holds", "counter", "Times a connection was held by the ingest budget"),
)


def availability_sys(admission: Admission | None, budget: IngestBudget | None) -> list[tuple[str, str]]:
    """The figures as ``$SYS/broker/`` topic suffixes and their values."""
    return [(f"availability/{key}", str(value)) for key, value in availability_figures(admission, budget).items()]
