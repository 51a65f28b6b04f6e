"""Which rows of a micro-batch repeat a key: exact, on the driver, with pyarrow and numpy.

For a batch of a few million rows this is far cheaper than a Spark shuffle: only the three
key columns are read (the string columns as Parquet dictionaries, turned into small integer
codes), packed into one integer per key and sorted, and neighbours compared. The answer is the list of rows to
drop as ``(file name, row index)`` pairs, which the ingest removes in the same Spark pass
that writes the table (a broadcast anti join), so the batch's files are scanned by Spark
once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from spark_ingest.schema import KEYS

log = logging.getLogger(__name__)

DROP_FILE = "_filemq_file"
"""Column of :attr:`Duplicates.rows`: the landing file name (as ``_metadata.file_name``)."""
DROP_ROW = "_filemq_row"
"""Column of :attr:`Duplicates.rows`: the row position in that file (``_metadata.row_index``)."""

_STRING_KEYS = [k for k in KEYS if k != "offset"]
_READERS = max(2, min(8, os.cpu_count() or 2))


@dataclass(frozen=True)
class Duplicates:
    """The verdict on a batch's keys.

    ``rows``: the batch rows to drop (columns :data:`DROP_FILE`, :data:`DROP_ROW`): every
    copy of a key except the first landed one, and every copy of a key already in the
    table. ``keys``: how many distinct keys had more than one copy.
    """

    rows: pa.Table
    keys: int


def find_duplicates(batch_files: Sequence[Path], table_files: Sequence[Path]) -> Duplicates:
    """Find the duplicate rows of ``batch_files`` (in the order given) against ``table_files``.

    ``batch_files`` must be in landing order (name order) and have distinct names; the
    first copy of a key is the one kept. ``table_files`` are the curated table's data files
    that may already hold keys of the batch. Keys are compared in full (no hashing), so two
    different keys are never taken for one. Raises OSError / ``pyarrow.ArrowException`` if
    a file cannot be read.
    """
    names = [p.name for p in batch_files]
    if len(set(names)) != len(names):
        raise ValueError("batch files must have distinct names (they identify the rows)")
    codes = {name: _Codes() for name in _STRING_KEYS}
    # Parquet decoding releases the GIL: read the files in parallel, then encode in order.
    with ThreadPoolExecutor(max_workers=_READERS) as pool:
        tables = list(pool.map(_read_key_columns, [*table_files, *batch_files]))
    keys = pa.concat_tables([_encode(table, codes) for table in tables])
    if keys.num_rows < 2:
        return Duplicates(_empty_rows(), 0)
    # A row's number in `keys` orders the copies of a key: table rows come first (a key
    # already in the table always wins and is never dropped), then the batch files in
    # landing order, each in row order. No id column is built for the millions of rows.
    table_rows = sum(t.num_rows for t in tables[: len(table_files)])
    batch_sizes = [t.num_rows for t in tables[len(table_files):]]
    # One integer per (device_id, stream) pair; sorting integers is the cheapest exact
    # grouping Arrow offers here (a string group_by is ~5x slower on 5 M rows).
    device, stream = (keys.column(name) for name in _STRING_KEYS)
    streams = max(1, len(codes[_STRING_KEYS[1]]))
    pairs_count = streams * max(1, len(codes[_STRING_KEYS[0]]))
    keys = pa.table({"pair": pc.add(pc.multiply(device, streams), stream),
                     "offset": keys.column("offset")})
    rows_in_runs = _rows_in_runs(keys, pairs_count)
    if len(rows_in_runs) == 0:
        return Duplicates(_empty_rows(), 0)
    # Rows in a run of equal keys: few. Sorted again with the row number, the first of
    # each run is the copy to keep, so nothing depends on the first sort being stable.
    # (A sort, not Arrow's group_by/join: those load Acero, ~1 s on first use.)
    copies = keys.take(rows_in_runs).append_column("row", rows_in_runs)
    copies = copies.take(
        pc.sort_indices(
            copies, sort_keys=[("pair", "ascending"), ("offset", "ascending"), ("row", "ascending")]
        )
    ).combine_chunks()
    pairs, offsets, numbers = (copies.column(name) for name in ("pair", "offset", "row"))
    later_copy = pa.concat_arrays([
        pa.array([False]),
        pc.and_(pc.equal(pairs[1:], pairs[:-1]), pc.equal(offsets[1:], offsets[:-1]))
        .combine_chunks(),
    ])
    duplicated_keys = copies.num_rows - pc.sum(later_copy).as_py()
    dropped = pc.subtract(
        numbers.filter(pc.and_(later_copy, pc.greater_equal(numbers, table_rows))), table_rows
    )
    file_of_row = pa.concat_arrays(
        [pa.repeat(pa.scalar(i, pa.int32()), n) for i, n in enumerate(batch_sizes)]
    )
    file_index = pc.take(file_of_row, dropped)
    starts = pa.array([sum(batch_sizes[:i]) for i in range(len(batch_sizes))], pa.int64())
    position = pc.subtract(dropped, pc.take(starts, file_index))
    rows = pa.table(
        {DROP_FILE: pc.take(pa.array(names, pa.string()), file_index), DROP_ROW: position}
    )
    log.debug("%d duplicated keys, %d rows to drop", duplicated_keys, rows.num_rows)
    return Duplicates(rows, duplicated_keys)


def _rows_in_runs(keys: pa.Table, pairs_count: int) -> pa.Array:
    """Numbers (int64) of the rows of ``keys`` whose (pair, offset) occurs more than once."""
    low, high = pc.min_max(keys.column("offset")).values()
    shift = 63 - pairs_count.bit_length()
    if not (low.as_py() >= 0 and high.as_py() < (1 << shift)):
        order = pc.sort_indices(keys, sort_keys=[("pair", "ascending"), ("offset", "ascending")])
        pairs = keys.column("pair").take(order)
        offsets = keys.column("offset").take(order)
        same = pc.and_(
            pc.equal(pairs[1:], pairs[:-1]), pc.equal(offsets[1:], offsets[:-1])
        ).combine_chunks()
        # A row is in a run if it equals its predecessor or its successor.
        in_run = pc.or_(
            pa.concat_arrays([pa.array([False]), same]),
            pa.concat_arrays([same, pa.array([False])]),
        )
        return order.filter(in_run).cast(pa.int64())
    # Both fit in one int64 (offsets are counters from 0). numpy sorts the values (no
    # indices) about 20x faster than Arrow's sort_indices; equal neighbours give the few
    # repeated keys, and a hash lookup of every row in that small set gives their rows.
    packed = pc.add(pc.shift_left(keys.column("pair"), shift), keys.column("offset"))
    values = packed.combine_chunks()
    ordered = np.sort(values.to_numpy())
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated) == 0:
        return pa.array([], pa.int64())
    in_set = pc.is_in(values, value_set=pa.array(np.unique(repeated)))
    return pc.indices_nonzero(in_set).cast(pa.int64())


class _Codes:
    """Small integer codes for the values of one string key column, shared by all files."""

    def __init__(self) -> None:
        self._values: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._values)

    def encode(self, column: pa.ChunkedArray) -> pa.ChunkedArray:
        chunks = []
        for chunk in column.chunks:
            if not pa.types.is_dictionary(chunk.type):
                chunk = chunk.dictionary_encode()
            # A Parquet dictionary holds the distinct values of a column chunk (a few
            # hundred devices): translating it, not every row, is what keeps this cheap.
            lookup = pa.array(
                [self._values.setdefault(v, len(self._values))
                 for v in chunk.dictionary.to_pylist()],
                pa.int64(),
            )
            chunks.append(pc.take(lookup, chunk.indices))
        return pa.chunked_array(chunks, pa.int64())


def _read_key_columns(path: Path) -> pa.Table:
    return pq.read_table(path, columns=KEYS, read_dictionary=_STRING_KEYS, use_threads=False)


def _encode(table: pa.Table, codes: dict[str, _Codes]) -> pa.Table:
    columns = {name: codes[name].encode(table.column(name)) for name in _STRING_KEYS}
    return pa.table({**columns, "offset": table.column("offset")})


def _empty_rows() -> pa.Table:
    return pa.table({DROP_FILE: pa.array([], pa.string()), DROP_ROW: pa.array([], pa.int64())})
