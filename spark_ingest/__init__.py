"""The PySpark job: landing Parquet -> curated table, exactly-once rows."""
