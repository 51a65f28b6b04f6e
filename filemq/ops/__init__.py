"""Operations: the ``filemq broker`` process (:mod:`.broker_app`), the signal-driven
service loop (:mod:`.service`), ``filemq status`` (:mod:`.status`) and the metrics HTTP
endpoint (:mod:`.metrics_http`).

May import: every filemq layer below (broker, queue, mqtt, upstream, common) and ``segments``.
Must not import ``worker_agent``, ``collector``, ``spark_ingest``, ``demo`` or ``bench``.
"""
