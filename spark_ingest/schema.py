"""Spark types of the landing file and of the curated table, and the payload schema option.

The landing columns mirror :data:`collector.landing.LANDING_SCHEMA` (the contract in
ARCHITECTURE.md); a test checks the two stay the same. They are those of the newest landing
schema version (2); Spark reads a version 1 file, which lacks the MQTT 5.0 property columns,
with nulls in them, so one read (and one streaming query) takes files of both versions.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import types as T

from collector.landing import KEY_COLUMNS

LANDING_SPARK_SCHEMA = T.StructType(
    [
        T.StructField("device_id", T.StringType()),
        T.StructField("stream", T.StringType()),
        T.StructField("offset", T.LongType()),
        T.StructField("topic", T.StringType()),
        T.StructField("qos", T.ByteType()),
        T.StructField("publish_ts", T.TimestampType()),
        T.StructField("received_at", T.TimestampType()),
        T.StructField("collector_id", T.StringType()),
        T.StructField("payload", T.BinaryType()),
        T.StructField("schema_version", T.ShortType()),
        # Schema version 2 (issue 13): the MQTT 5.0 message properties, null when absent.
        T.StructField("payload_format_indicator", T.ByteType()),
        T.StructField("message_expiry_s", T.LongType()),
        T.StructField("content_type", T.StringType()),
        T.StructField("response_topic", T.StringType()),
        T.StructField("correlation_data", T.BinaryType()),
        T.StructField(
            "user_properties",
            T.ArrayType(
                T.StructType(
                    [T.StructField("key", T.StringType()), T.StructField("value", T.StringType())]
                )
            ),
        ),
    ]
)
"""The landing file columns as Spark reads them (timestamps are UTC instants)."""

LANDING_COLUMNS: tuple[str, ...] = tuple(f.name for f in LANDING_SPARK_SCHEMA.fields)
KEYS: list[str] = list(KEY_COLUMNS)
PARTITION_COLUMN = "dt"
"""Curated partition: the UTC date of ``publish_ts`` as ``YYYY-MM-DD``."""
PAYLOAD_ERROR_COLUMN = "payload_error"
PAYLOAD_ERROR = "payload is not JSON matching the payload schema"
"""Value of ``payload_error`` for a row whose payload did not parse."""

RESERVED_COLUMNS = frozenset({*LANDING_COLUMNS, PARTITION_COLUMN, PAYLOAD_ERROR_COLUMN})


class PayloadSchemaError(ValueError):
    """The ``--payload-schema`` DDL does not parse or clashes with a table column."""


@dataclass(frozen=True)
class PayloadSchema:
    """Typed columns parsed from a JSON payload (``--payload json --payload-schema DDL``)."""

    ddl: str
    fields: T.StructType

    @classmethod
    def parse(cls, ddl: str) -> PayloadSchema:
        """Parse a Spark DDL field list such as ``"temperature double, humidity double"``.

        Needs an active SparkContext (Spark parses DDL in the JVM). Raises
        :class:`PayloadSchemaError` naming the problem.
        """
        try:
            parsed = T.DataType.fromDDL(ddl)
        except Exception as exc:  # Spark raises several parse error types
            raise PayloadSchemaError(f"payload schema {ddl!r} does not parse: {exc}") from exc
        if not isinstance(parsed, T.StructType) or not parsed.fields:
            raise PayloadSchemaError(f"payload schema {ddl!r} must be a list of fields")
        clashes = sorted(f.name for f in parsed.fields if f.name in RESERVED_COLUMNS)
        if clashes:
            raise PayloadSchemaError(
                f"payload schema {ddl!r}: field(s) {', '.join(clashes)} clash with table"
                f" columns; rename them in the DDL"
            )
        return cls(ddl, parsed)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields.fields]
