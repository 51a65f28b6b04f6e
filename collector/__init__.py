"""The upstream receiver: batch validation, dedup, durable landing of Parquet files."""
