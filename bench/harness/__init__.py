"""The bench harness: the parts every ``filemq bench`` scenario shares, below the scenarios
(no module here imports one).

* :mod:`.processes` the processes a bench starts and stops (filemq, mosquitto and amqtt
  brokers, ``filemq`` agent/collector commands), free ports, progress lines;
* :mod:`.cpu` CPU accounting (/proc) and the per-message CPU figures;
* :mod:`.brokers` a broker bench run's options and its brokers' start with them;
* :mod:`.loads` the ingest and fanout loads, for either MQTT protocol version, and the MQTT 5
  properties of ``--v5-properties``;
* :mod:`.alternate` the contenders of a run (by protocol version) and the alternating runner
  (contenders x repetitions, CPU measured);
* :mod:`.summary` rounding and result text (errors, a refused CONNECT, CPU).
"""
