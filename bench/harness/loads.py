"""The broker bench's two loads, each for either MQTT protocol version: ``ingest`` (QoS 1
publishers, PUBACKs/s) and ``fanout`` (publishers and persistent QoS 1 subscribers,
deliveries/s).  The broker bench's scenarios (:mod:`bench.throughput`), the tree comparisons
and the profilers all run these."""

from __future__ import annotations

from bench.harness.brokers import BrokerBenchOptions
from bench.harness.processes import BrokerProcess
from bench.loadgen import run_load
from bench.loadspec import LoadResult, PublisherSpec, SubscriberSpec
from filemq.mqtt.packets import PROTOCOL_LEVEL, Properties

# ``--v5-properties``: what a typical MQTT 5 device adds to a message (3.3.2.3.9, 3.3.2.3.7).
V5_PROPERTIES = Properties(content_type="application/octet-stream", user_properties=[("source", "bench")])


def ingest_run(broker: BrokerProcess, opts: BrokerBenchOptions, messages: int, topic: str, *,
               protocol: int = PROTOCOL_LEVEL, properties: Properties | None = None) -> LoadResult:
    """Durable QoS 1 ingest: ``opts.publishers`` publishers share ``messages`` on ``topic``."""
    per = max(messages // opts.publishers, 1)
    specs = [PublisherSpec(broker.host, broker.port, f"bench-pub-{i}", topic, per, opts.size, opts.inflight,
                           max_seconds=opts.max_seconds, protocol=protocol, properties=properties,
                           client=opts.publisher_client)
             for i in range(opts.publishers)]
    return run_load(specs)


def fanout_run(broker: BrokerProcess, opts: BrokerBenchOptions, messages: int, *,
               protocol: int = PROTOCOL_LEVEL, properties: Properties | None = None) -> LoadResult:
    """``opts.subscribers`` persistent QoS 1 subscribers to bench/fanout/#, then ``messages``
    from ``opts.publishers`` publishers."""
    subs = [SubscriberSpec(broker.host, broker.port, f"bench-fan-sub-{i}", "bench/fanout/#", qos=1,
                           clean_session=False, idle_seconds=5.0, max_seconds=opts.max_seconds * 4,
                           protocol=protocol, client=opts.subscriber_client)
            for i in range(opts.subscribers)]
    per = max(messages // opts.publishers, 1)
    pubs = [PublisherSpec(broker.host, broker.port, f"bench-fan-pub-{i}", f"bench/fanout/{i}", per, opts.size,
                          opts.inflight, max_seconds=opts.max_seconds, protocol=protocol, properties=properties,
                          client=opts.publisher_client)
            for i in range(opts.publishers)]
    return run_load(pubs, subs, timeout=opts.max_seconds * 6)
