"""The upstream batch: how the forwarder ships a run of log records to the collector.

One batch is the payload of one MQTT PUBLISH (QoS 1) on ``filemq/v1/<device_id>/<stream>``.
The exact bytes are specified in docs/FORMAT.md ("Upstream batch"); in short::

    header   magic "FMQB", CRC-32C of every byte but the CRC field, version, compression,
             reserved, first_offset, last_offset, count, body_length, device_id, stream
    body     (compressed as the header says) a topic table, then one column per field:
             offset deltas, timestamps, QoS, topic indexes, payload lengths, [header
             lengths,] payload bytes[, header bytes]

Version 2 adds each record's ``headers`` (its MQTT 5.0 message properties, opaque bytes here:
``filemq.mqtt.properties.encode_message_headers``) as the two bracketed parts; version 1 has
neither. :func:`encode_batch` writes version 1 when every record's headers are empty (the
bytes of earlier releases, which an older collector reads) and version 2 otherwise;
:func:`decode_batch` reads both.

Integers are little-endian, so each column is a packed array that the collector hands to
Arrow without a per-record Python step. Every record carries its offset (as a delta from
``first_offset``): offsets are strictly increasing but need not be contiguous, so a batch
stays correct when the device log skipped a corrupt record.

What a caller may rely on:

* :func:`decode_batch` returns a fully validated :class:`Batch` or raises exactly one of two
  errors: :class:`BatchCrcError` (the bytes were damaged on the way: do not acknowledge, the
  agent resends) or :class:`MalformedBatch` (the CRC matches but the content is not a valid
  batch, or the version or compression is unknown: resending cannot help, so quarantine it).
* :func:`peek_header` checks magic, version and CRC and parses the header without
  decompressing or validating the body (for a cheap duplicate check at the door).
* ``encode_batch(...)`` then ``decode_batch(...)`` gives back the same records, headers
  included.
* ``decode_batch(data, check_headers=f)`` calls ``f`` on every non-empty header; a
  ``ValueError`` from it makes the batch a :class:`MalformedBatch` (this module does not know
  the property format: it may not import :mod:`filemq.mqtt`).

Only the standard library and ``crc32c`` are used (this module runs on devices); zstd
(compression 2) works only where the optional ``zstandard`` package is importable.
"""

from __future__ import annotations

import operator
import struct
import sys
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from crc32c import crc32c

MAGIC = b"FMQB"
VERSION_1 = 1  # no record headers
VERSION_2 = 2  # + per record headers (MQTT 5.0 message properties)
VERSION = VERSION_2  # the newest version this module writes and reads
VERSIONS = frozenset({VERSION_1, VERSION_2})

COMPRESSION_NONE = 0
COMPRESSION_ZLIB = 1
COMPRESSION_ZSTD = 2
COMPRESSION_NAMES = {COMPRESSION_NONE: "none", COMPRESSION_ZLIB: "zlib", COMPRESSION_ZSTD: "zstd"}
COMPRESSION_CODES = {name: code for code, name in COMPRESSION_NAMES.items()}

TOPIC_PREFIX = "filemq/v1/"
DEFAULT_STREAM = "main"

# magic, crc (every version starts so: the CRC is checked before the version is trusted),
# version, compression, reserved
_PREFIX = struct.Struct("<4sIBBH")
# first_offset, last_offset, count, body_length
_FIXED = struct.Struct("<QQII")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
PREFIX_SIZE = _PREFIX.size  # 12
CRC_START = 8  # the CRC covers the magic (bytes 0-3) and bytes [8, end)
MIN_HEADER_SIZE = PREFIX_SIZE + _FIXED.size + 2 * _U16.size  # 40

_MAGIC_CRC = crc32c(MAGIC)

MAX_NAME_BYTES = 256  # device id and stream name
MAX_TOPIC_BYTES = 0xFFFF
MAX_DELTA = 0xFFFF_FFFF
MAX_BODY_BYTES = 256 * 1024 * 1024  # refuses decompression bombs

_LITTLE = sys.byteorder == "little"
_FORBIDDEN_NAME_CHARS = frozenset("/+#\x00")


class BatchError(ValueError):
    """Base class: a byte string is not an acceptable upstream batch."""


class BatchCrcError(BatchError):
    """The CRC-32C does not match: the bytes were damaged in transit (resend, don't ack)."""

    def __init__(self, expected: int, actual: int, size: int) -> None:
        super().__init__(
            f"batch CRC-32C mismatch: header says {expected:#010x}, the {size} bytes give"
            f" {actual:#010x} (damaged in transit; the sender should resend)"
        )
        self.expected = expected
        self.actual = actual
        self.size = size


class MalformedBatch(BatchError):
    """A batch that resending cannot fix: bad structure, unknown version or compression.

    ``device_id``/``stream``/``first_offset`` are filled in when the header was readable.
    """

    def __init__(
        self,
        reason: str,
        *,
        device_id: str | None = None,
        stream: str | None = None,
        first_offset: int | None = None,
    ) -> None:
        where = ""
        if device_id is not None:
            where = f" from device {device_id!r} stream {stream!r} first offset {first_offset}"
        super().__init__(f"malformed batch{where}: {reason}")
        self.reason = reason
        self.device_id = device_id
        self.stream = stream
        self.first_offset = first_offset


class RecordLike(Protocol):
    """What :func:`encode_batch` needs of a record (``segments.Record`` fits)."""

    @property
    def offset(self) -> int: ...

    @property
    def timestamp_us(self) -> int: ...

    @property
    def topic(self) -> str: ...

    @property
    def payload(self) -> bytes: ...

    @property
    def qos(self) -> int: ...

    @property
    def headers(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One record of a decoded batch; ``headers`` as in ``segments.Record`` (b"" when none)."""

    offset: int
    timestamp_us: int
    topic: str
    payload: bytes
    qos: int
    headers: bytes = b""


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The fixed part of a batch; ``body_length`` is the uncompressed body size."""

    version: int
    compression: int
    device_id: str
    stream: str
    first_offset: int
    last_offset: int
    count: int
    body_length: int
    header_size: int


@dataclass(frozen=True, slots=True)
class Batch:
    """A decoded, validated batch, kept in columns (see the module docstring).

    ``offset_deltas``, ``timestamps_us``, ``topic_index`` and ``payload_lengths`` are arrays
    in native byte order; ``qos`` has one byte per record; ``payloads`` is every payload
    concatenated; ``body`` is the uncompressed body (little-endian columns) for consumers
    that want to wrap the columns without copying. ``header_lengths`` and ``headers`` are
    the records' headers in the same way (version 2); for a version 1 batch
    ``header_lengths`` is empty and ``headers`` is ``b""``.
    """

    header: BatchHeader
    topics: tuple[str, ...]
    offset_deltas: array[int]
    timestamps_us: array[int]
    qos: bytes
    topic_index: array[int]
    payload_lengths: array[int]
    payloads: bytes
    body: bytes
    column_starts: tuple[int, int, int, int, int, int]
    header_lengths: array[int] = field(default_factory=lambda: array("I"))
    headers: bytes = b""

    @property
    def has_headers(self) -> bool:
        """Whether any record has non-empty headers."""
        return bool(self.headers)

    @property
    def device_id(self) -> str:
        return self.header.device_id

    @property
    def stream(self) -> str:
        return self.header.stream

    @property
    def first_offset(self) -> int:
        return self.header.first_offset

    @property
    def last_offset(self) -> int:
        return self.header.last_offset

    def __len__(self) -> int:
        return self.header.count

    def offsets(self) -> list[int]:
        """The offset of every record, in order."""
        first = self.header.first_offset
        return [first + d for d in self.offset_deltas]

    def records(self) -> Iterator[BatchRecord]:
        """The records, in order."""
        first = self.header.first_offset
        topics = self.topics
        payloads = self.payloads
        pos = 0
        for delta, ts, qos, ti, length, headers in zip(
            self.offset_deltas,
            self.timestamps_us,
            self.qos,
            self.topic_index,
            self.payload_lengths,
            self.record_headers(),
            strict=True,
        ):
            end = pos + length
            yield BatchRecord(first + delta, ts, topics[ti], payloads[pos:end], qos, headers)
            pos = end

    def record_headers(self) -> Iterator[bytes]:
        """Each record's headers, in order (``b""`` for a record without)."""
        if not self.headers:
            yield from (b"" for _ in range(self.header.count))
            return
        headers = self.headers
        pos = 0
        for length in self.header_lengths:
            end = pos + length
            yield headers[pos:end]
            pos = end


def batch_topic(device_id: str, stream: str = DEFAULT_STREAM) -> str:
    """The MQTT topic a batch of ``device_id``/``stream`` is published on."""
    return f"{TOPIC_PREFIX}{device_id}/{stream}"


def parse_batch_topic(topic: str) -> tuple[str, str] | None:
    """``(device_id, stream)`` from a batch topic, or None if ``topic`` is not one."""
    if not topic.startswith(TOPIC_PREFIX):
        return None
    parts = topic[len(TOPIC_PREFIX) :].split("/")
    if len(parts) != 2 or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]


def check_name(kind: str, name: str) -> bytes:
    """``name`` (a device id or stream) as UTF-8; ValueError if it cannot be one.

    Names appear as one level of an MQTT topic, so ``/``, ``+``, ``#`` and NUL are refused.
    """
    if not name:
        raise ValueError(f"{kind} must not be empty")
    if _FORBIDDEN_NAME_CHARS.intersection(name):
        raise ValueError(f"{kind} {name!r} must not contain '/', '+', '#' or NUL")
    raw = name.encode("utf-8")
    if len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"{kind} {name!r} is longer than {MAX_NAME_BYTES} bytes")
    return raw


def _le(values: array[int]) -> bytes:
    if not _LITTLE:
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _from_le(typecode: str, data: bytes | memoryview) -> array[int]:
    values = array(typecode)
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    return values


def _compressor(compression: int, level: int | None) -> tuple[int, object]:
    if compression == COMPRESSION_ZSTD:
        try:
            import zstandard
        except ImportError as exc:
            raise ValueError("zstd compression needs the 'zstandard' package") from exc
        return compression, zstandard.ZstdCompressor(level=level if level is not None else 3)
    return compression, None


def encode_batch(
    device_id: str,
    stream: str,
    records: Sequence[RecordLike],
    *,
    compression: int | str = COMPRESSION_NONE,
    level: int | None = None,
    version: int | None = None,
) -> bytes:
    """The batch bytes for ``records`` (at least one, offsets strictly increasing).

    ``compression`` is a code or a name (``"none"``, ``"zlib"``, ``"zstd"``); ``level`` is
    passed to the compressor (zlib default 1: the link is rarely slower than the CPU on the
    record counts we ship). ``version`` None: 1 when every record's headers are empty (the
    bytes an older collector reads), else 2; 2 forces version 2; 1 refuses records with
    headers. Raises ValueError for an empty batch, bad names, offsets that do not increase
    or do not fit the format, a QoS outside 0-2, or headers that version 1 cannot carry.
    """
    if isinstance(compression, str):
        if compression not in COMPRESSION_CODES:
            raise ValueError(f"unknown compression {compression!r}")
        compression = COMPRESSION_CODES[compression]
    if compression not in COMPRESSION_NAMES:
        raise ValueError(f"unknown compression code {compression}")
    if not records:
        raise ValueError("a batch needs at least one record")
    device_raw = check_name("device id", device_id)
    stream_raw = check_name("stream", stream)
    count = len(records)
    first = records[0].offset
    last = records[-1].offset
    if first < 0 or last - first > MAX_DELTA:
        raise ValueError(f"offsets {first}..{last} do not fit one batch (span > {MAX_DELTA})")

    deltas = array("I", [r.offset - first for r in records])
    if count > 1 and not all(map(operator.lt, deltas, islice(deltas, 1, None))):
        raise ValueError(f"record offsets {first}..{last} are not strictly increasing")
    timestamps = array("q", [r.timestamp_us for r in records])
    qos = bytes([r.qos for r in records])
    if max(qos) > 2:
        raise ValueError("a record has a QoS outside 0-2")
    topic_ids: dict[str, int] = {}
    index = array("I", [topic_ids.setdefault(r.topic, len(topic_ids)) for r in records])
    payloads = [r.payload for r in records]
    lengths = array("I", [len(p) for p in payloads])
    headers = [r.headers for r in records]
    with_headers = any(headers)
    if version is None:
        version = VERSION_2 if with_headers else VERSION_1
    elif version not in VERSIONS:
        raise ValueError(f"unknown batch format version {version}")
    elif version == VERSION_1 and with_headers:
        raise ValueError("batch format version 1 cannot carry record headers")

    parts: list[bytes] = [_U32.pack(len(topic_ids))]
    for topic in topic_ids:
        raw = topic.encode("utf-8")
        if len(raw) > MAX_TOPIC_BYTES:
            raise ValueError(f"topic {topic[:80]!r}... is longer than {MAX_TOPIC_BYTES} bytes")
        parts.append(_U16.pack(len(raw)))
        parts.append(raw)
    parts += [_le(deltas), _le(timestamps), qos, _le(index), _le(lengths)]
    if version == VERSION_2:
        parts.append(_le(array("I", [len(h) for h in headers])))
    parts += payloads
    if version == VERSION_2:
        parts += headers
    body = b"".join(parts)
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"batch body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")

    if compression == COMPRESSION_ZLIB:
        stored = zlib.compress(body, level if level is not None else 1)
    elif compression == COMPRESSION_ZSTD:
        _, zc = _compressor(compression, level)
        stored = zc.compress(body)  # type: ignore[attr-defined]
    else:
        stored = body
    rest = b"".join(
        (
            _FIXED.pack(first, last, count, len(body)),
            _U16.pack(len(device_raw)),
            device_raw,
            _U16.pack(len(stream_raw)),
            stream_raw,
            stored,
        )
    )
    rest = bytes((version, compression, 0, 0)) + rest
    return MAGIC + _U32.pack(crc32c(rest, _MAGIC_CRC)) + rest


def peek_header(data: bytes | bytearray | memoryview, *, verify_crc: bool = True) -> BatchHeader:
    """Check the CRC, magic, version and reserved bits, then parse the header (not the body).

    Raises :class:`BatchCrcError` or :class:`MalformedBatch` as :func:`decode_batch` does
    for the header; a body that fails later validation is not detected here.
    ``verify_crc=False`` skips the CRC, for bytes already checked (e.g. read back from a log
    whose own record CRC covers them).
    """
    view = memoryview(data)
    size = len(view)
    if size < CRC_START:
        raise MalformedBatch(f"{size} bytes is shorter than the {CRC_START}-byte batch prefix")
    (crc,) = _U32.unpack_from(view, 4)
    actual = crc32c(view[CRC_START:], crc32c(view[:4])) if verify_crc else crc
    if actual != crc:
        # Checked before anything else so that damage anywhere (magic and version included)
        # is resent rather than quarantined.
        raise BatchCrcError(crc, actual, size)
    if size < PREFIX_SIZE:
        raise MalformedBatch(f"{size} bytes is shorter than the {PREFIX_SIZE}-byte batch prefix")
    magic, _, version, compression, reserved = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise MalformedBatch(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a filemq batch")
    if version not in VERSIONS:
        raise MalformedBatch(
            f"unknown batch format version {version} (this collector reads 1 to {VERSION})"
        )
    if reserved != 0:
        raise MalformedBatch(f"reserved bits {reserved:#06x} are set")
    if size < MIN_HEADER_SIZE:
        raise MalformedBatch(f"{size} bytes is shorter than the {MIN_HEADER_SIZE}-byte header")
    first, last, count, body_length = _FIXED.unpack_from(view, PREFIX_SIZE)
    pos = PREFIX_SIZE + _FIXED.size
    names: list[str] = []
    for kind in ("device id", "stream"):
        if pos + 2 > size:
            raise MalformedBatch(f"header ends inside the {kind} length")
        (n,) = _U16.unpack_from(view, pos)
        pos += 2
        if n == 0 or n > MAX_NAME_BYTES or pos + n > size:
            raise MalformedBatch(f"{kind} length {n} is out of range")
        try:
            name = str(view[pos : pos + n], "utf-8")
            check_name(kind, name)
        except ValueError as exc:
            raise MalformedBatch(f"bad {kind}: {exc}") from None
        names.append(name)
        pos += n
    device_id, stream = names

    def bad(reason: str) -> MalformedBatch:
        return MalformedBatch(reason, device_id=device_id, stream=stream, first_offset=first)

    if compression not in COMPRESSION_NAMES:
        raise bad(f"unknown compression code {compression}")
    if count == 0:
        raise bad("count is 0")
    if last < first or last - first > MAX_DELTA or last - first + 1 < count:
        raise bad(f"offsets {first}..{last} cannot hold {count} records")
    if body_length > MAX_BODY_BYTES:
        raise bad(f"body length {body_length} exceeds {MAX_BODY_BYTES}")
    return BatchHeader(version, compression, device_id, stream, first, last, count, body_length, pos)


def decode_batch(
    data: bytes | bytearray | memoryview,
    *,
    check_headers: Callable[[bytes], object] | None = None,
) -> Batch:
    """Parse and fully validate a batch; see the module docstring for the two errors.

    ``check_headers``, when given, is called with every distinct non-empty record header; a
    ``ValueError`` it raises becomes a :class:`MalformedBatch` naming the record's offset.
    """
    header = peek_header(data)
    view = memoryview(data)
    stored = view[header.header_size :]

    def bad(reason: str) -> MalformedBatch:
        return MalformedBatch(
            reason, device_id=header.device_id, stream=header.stream, first_offset=header.first_offset
        )

    body = _decompress(header, stored, bad)
    if len(body) != header.body_length:
        raise bad(f"body is {len(body)} bytes, header says {header.body_length}")
    count = header.count
    size = len(body)
    if size < 4:
        raise bad("body ends before the topic table")
    (n_topics,) = _U32.unpack_from(body, 0)
    pos = 4
    if n_topics == 0 or n_topics > count:
        raise bad(f"topic table of {n_topics} entries for {count} records")
    topics: list[str] = []
    for i in range(n_topics):
        if pos + 2 > size:
            raise bad(f"body ends inside topic {i}")
        (n,) = _U16.unpack_from(body, pos)
        pos += 2
        if pos + n > size:
            raise bad(f"body ends inside topic {i}")
        try:
            topic = body[pos : pos + n].decode("utf-8")
        except UnicodeDecodeError:
            raise bad(f"topic {i} is not valid UTF-8") from None
        if "\x00" in topic:
            raise bad(f"topic {i} contains NUL")
        topics.append(topic)
        pos += n
    starts: list[int] = []
    columns: list[bytes] = []
    widths = (4, 8, 1, 4, 4, 4) if header.version == VERSION_2 else (4, 8, 1, 4, 4)
    for width in widths:
        end = pos + width * count
        if end > size:
            raise bad("body ends inside the record columns")
        starts.append(pos)
        columns.append(body[pos:end])
        pos = end
    starts.append(pos)
    deltas = _from_le("I", columns[0])
    timestamps = _from_le("q", columns[1])
    qos = columns[2]
    index = _from_le("I", columns[3])
    lengths = _from_le("I", columns[4])
    payload_end = pos + sum(lengths)
    if payload_end > size:
        raise bad(f"payload lengths add up to {sum(lengths)}, the body holds {size - pos} bytes")
    payloads = body[pos:payload_end]
    header_lengths = array("I")
    headers = b""
    if header.version == VERSION_2:
        header_lengths = _from_le("I", columns[5])
        headers = body[payload_end:]
        if sum(header_lengths) != len(headers):
            raise bad(
                f"header lengths add up to {sum(header_lengths)}, the body holds"
                f" {len(headers)} bytes after the payloads"
            )
    elif payload_end != size:
        raise bad(f"payload lengths add up to {sum(lengths)}, the body holds {size - pos} bytes")
    if deltas[0] != 0:
        raise bad(f"first record's offset delta is {deltas[0]}, not 0")
    if deltas[-1] != header.last_offset - header.first_offset:
        raise bad(
            f"last record's offset {header.first_offset + deltas[-1]} is not the header's"
            f" last offset {header.last_offset}"
        )
    if count > 1 and not all(map(operator.lt, deltas, islice(deltas, 1, None))):
        raise bad("record offsets are not strictly increasing")
    if max(qos) > 2:
        raise bad("a record has a QoS outside 0-2")
    if max(index) >= n_topics:
        raise bad(f"a topic index is beyond the {n_topics}-entry topic table")
    if check_headers is not None and headers:
        hpos = 0
        checked: set[bytes] = set()  # records of one publisher often repeat their properties
        for delta, length in zip(deltas, header_lengths, strict=True):
            if length:
                record_headers = headers[hpos : hpos + length]
                hpos += length
                if record_headers in checked:
                    continue
                try:
                    check_headers(record_headers)
                except ValueError as exc:
                    raise bad(
                        f"record at offset {header.first_offset + delta} has malformed headers: {exc}"
                    ) from None
                checked.add(record_headers)
    s = starts
    return Batch(
        header,
        tuple(topics),
        deltas,
        timestamps,
        qos,
        index,
        lengths,
        payloads,
        body,
        (s[0], s[1], s[2], s[3], s[4], s[-1]),
        header_lengths,
        headers,
    )


def _decompress(
    header: BatchHeader, stored: memoryview, bad: Callable[[str], MalformedBatch]
) -> bytes:
    if header.compression == COMPRESSION_NONE:
        return bytes(stored)
    if header.compression == COMPRESSION_ZLIB:
        inflater = zlib.decompressobj()
        try:
            # max_length + 1 bounds memory even for a decompression bomb.
            body = inflater.decompress(stored, header.body_length + 1)
        except zlib.error as exc:
            raise bad(f"zlib body does not decompress: {exc}") from None
        if not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
            raise bad("zlib body is truncated or longer than the header's body length")
        return body
    try:
        import zstandard
    except ImportError:
        raise bad("zstd compression is not supported here (install 'zstandard')") from None
    try:
        out = zstandard.ZstdDecompressor().decompress(
            bytes(stored), max_output_size=header.body_length
        )
    except zstandard.ZstdError as exc:
        raise bad(f"zstd body does not decompress: {exc}") from None
    return bytes(out)


def records_after(batch: Batch, after_offset: int) -> list[BatchRecord]:
    """The records of ``batch`` with an offset greater than ``after_offset`` (for trimming)."""
    return [r for r in batch.records() if r.offset > after_offset]
