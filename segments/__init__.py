"""filemq: the on-disk segment log (record -> segment -> log). Knows nothing of MQTT or networks."""
