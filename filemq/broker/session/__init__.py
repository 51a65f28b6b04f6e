"""The MQTT session, without I/O (as h11 is for HTTP): all per-client MQTT protocol state,
and nothing else.

It takes bytes (and the broker core's answers) in and gives typed events and bytes out; it has
no transport, no event loop and reads no clock (the time is passed in).  The import contract
``sans-io-session`` in setup.cfg holds it to that.  Its modules, by what they hold:

* :mod:`.connection`: a :class:`~.connection.Connection` holds one network connection's state:
  where it is in the CONNECT handshake, its decoder, the keepalive deadline, MQTT 5 topic
  aliases both ways and our Receive Maximum window, and the inbound acks waiting for their
  commit (the inbound in-flight window).  :meth:`~.connection.Connection.receive_data` turns
  one read's bytes into events; one read's run of PUBLISHes is one event.
* :mod:`.qos_state`: a :class:`~.qos_state.QosState` holds what of a session outlives its
  network connections (MQTT 4.1): the packet ids, the outbound in-flight window, the QoS 2 ids
  both ways.  The session (``SessionState``, which the registry keeps and persists) holds one;
  its methods are the state's transitions, which the broker's QoS part and delivery planner
  call.
* :mod:`.events`: the events a read gives (:class:`~.events.Publishes`,
  :class:`~.events.Acks`) and the commit type the acks wait on; no state.
* :mod:`.inflight`: the outbound in-flight entries (:class:`~.inflight.Outbound`, the
  run entries); no state of their own beyond one delivery's.

Tests drive it with bytes alone (``tests/test_connection_machine.py``, a Hypothesis state
machine against a model of MQTT 4.3/4.4; ``tests/test_qos_state.py``).
"""
