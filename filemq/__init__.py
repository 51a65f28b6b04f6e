"""filemq: the queue over the log (topics, consumer groups, offsets) and the MQTT broker fronting it."""
