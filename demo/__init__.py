"""``filemq demo``: the whole pipeline end to end on loopback (:mod:`.pipeline`).

An application of every package (broker, agent, collector, Spark ingest), so it lives above
them, next to ``cli.py`` and ``bench/``.
"""
