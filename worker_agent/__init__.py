"""The device process: broker + forwarder in one process."""
