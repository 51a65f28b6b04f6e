"""`filemq bench codec`: our MQTT codec against amqtt's, on the same bytes, in the same run.

Measures

* decode: a stream of PUBLISH QoS 1 packets (100-byte payload) fed to
  :class:`filemq.mqtt.codec.Decoder` in 64 KiB chunks, as a socket would deliver them, versus
  amqtt's ``PublishPacket.from_stream`` reading the same bytes from an asyncio
  ``StreamReader`` (how amqtt's broker decodes);
* encode: PUBACK for every packet id, ``encode(Puback(pid))`` versus amqtt's
  ``PubackPacket.build(pid).to_bytes()``, and the same PUBLISH packets, ``encode(Publish(...))``
  versus ``PublishPacket.build(...).to_bytes()``.

Both sides' results are checked (count, ids, last payload) so a fast but wrong decoder fails.
Each figure is the best of ``rounds`` runs, to keep scheduler noise out of the ratio.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from filemq.mqtt.codec import Decoder, encode
from filemq.mqtt.packets import Puback, Publish

log = logging.getLogger(__name__)

TOPIC = "sensors/dev-0001/temperature"
PAYLOAD_SIZE = 100
CHUNK = 1 << 16


@dataclass(frozen=True)
class CodecResult:
    """One measured figure: ``rate`` packets per second for ``impl`` doing ``operation``."""

    operation: str
    impl: str
    packets: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.packets / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {
            "bench": "codec",
            "operation": self.operation,
            "impl": self.impl,
            "packets": self.packets,
            "seconds": round(self.seconds, 6),
            "packets_per_s": round(self.rate),
        }


def _packet_id(i: int) -> int:
    return i % 65535 + 1


def publish_stream(packets: int) -> bytes:
    """``packets`` PUBLISH QoS 1 packets with 100-byte payloads, back to back."""
    payload = bytes(range(PAYLOAD_SIZE))
    return b"".join(encode(Publish(TOPIC, payload, 1, packet_id=_packet_id(i))) for i in range(packets))


def _best(rounds: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(rounds))


def decode_ours(stream: bytes, packets: int) -> float:
    """Seconds to decode ``stream`` with our Decoder; checks the result."""
    started = time.perf_counter()
    decoder = Decoder()
    count = 0
    last = None
    for offset in range(0, len(stream), CHUNK):
        decoder.feed(stream[offset : offset + CHUNK])
        got = decoder.packets()
        count += len(got)
        if got:
            last = got[-1]
    elapsed = time.perf_counter() - started
    if count != packets or not isinstance(last, Publish) or last.packet_id != _packet_id(packets - 1):
        raise AssertionError(f"our decoder returned {count} packets, last {last!r}")
    return elapsed


def decode_amqtt(stream: bytes, packets: int) -> float:
    """Seconds for amqtt to decode ``stream`` from an asyncio StreamReader; checks the result."""
    from amqtt.adapters import StreamReaderAdapter
    from amqtt.mqtt.packet import MQTTFixedHeader
    from amqtt.mqtt.publish import PublishPacket

    async def run() -> float:
        reader = asyncio.StreamReader(limit=len(stream) + 1)
        # Fed in the same 64 KiB chunks; all data is in before timing, so no socket waits count.
        for offset in range(0, len(stream), CHUNK):
            reader.feed_data(stream[offset : offset + CHUNK])
        reader.feed_eof()
        adapter = StreamReaderAdapter(reader)
        started = time.perf_counter()
        last = None
        for _ in range(packets):
            header = await MQTTFixedHeader.from_stream(adapter)
            last = await PublishPacket.from_stream(adapter, fixed_header=header)
        elapsed = time.perf_counter() - started
        if last is None or last.packet_id != _packet_id(packets - 1) or last.data != bytes(range(PAYLOAD_SIZE)):
            raise AssertionError(f"amqtt decoded {last!r} last")
        return elapsed

    return asyncio.run(run())


def encode_puback_ours(packets: int) -> float:
    started = time.perf_counter()
    out = [encode(Puback(_packet_id(i))) for i in range(packets)]
    elapsed = time.perf_counter() - started
    if out[-1] != b"\x40\x02" + _packet_id(packets - 1).to_bytes(2, "big"):
        raise AssertionError(f"our PUBACK encoding is wrong: {out[-1]!r}")
    return elapsed


def encode_puback_amqtt(packets: int) -> float:
    from amqtt.mqtt.puback import PubackPacket

    started = time.perf_counter()
    out = [PubackPacket.build(_packet_id(i)).to_bytes() for i in range(packets)]
    elapsed = time.perf_counter() - started
    if out[-1] != b"\x40\x02" + _packet_id(packets - 1).to_bytes(2, "big"):
        raise AssertionError(f"amqtt's PUBACK encoding is unexpected: {out[-1]!r}")
    return elapsed


def _check_publish_bytes(wire: bytes, packets: int, whose: str) -> None:
    decoder = Decoder(server=False)
    decoder.feed(wire)
    got = decoder.packets()
    expected = Publish(TOPIC, bytes(range(PAYLOAD_SIZE)), 1, packet_id=_packet_id(packets - 1))
    if got != [expected]:
        raise AssertionError(f"{whose} PUBLISH encoding decodes to {got!r}")


def encode_publish_ours(packets: int) -> float:
    payload = bytes(range(PAYLOAD_SIZE))
    started = time.perf_counter()
    out = [encode(Publish(TOPIC, payload, 1, packet_id=_packet_id(i))) for i in range(packets)]
    elapsed = time.perf_counter() - started
    _check_publish_bytes(out[-1], packets, "our")
    return elapsed


def encode_publish_amqtt(packets: int) -> float:
    from amqtt.mqtt.publish import PublishPacket

    payload = bytes(range(PAYLOAD_SIZE))
    started = time.perf_counter()
    out = [PublishPacket.build(TOPIC, payload, _packet_id(i), False, 1, False).to_bytes() for i in range(packets)]
    elapsed = time.perf_counter() - started
    _check_publish_bytes(out[-1], packets, "amqtt's")
    return elapsed


def run_codec_bench(packets: int, rounds: int = 3, progress: Callable[[str], None] | None = None) -> list[CodecResult]:
    """Run every measurement; returns ours and amqtt's figure for decode and encode."""
    say = progress or log.info
    say(f"building a stream of {packets} PUBLISH QoS 1 packets ({PAYLOAD_SIZE}-byte payload)")
    stream = publish_stream(packets)
    results = []
    say("decode: filemq")
    results.append(CodecResult("decode_publish", "filemq", packets, _best(rounds, lambda: decode_ours(stream, packets))))
    say("decode: amqtt (baseline)")
    results.append(CodecResult("decode_publish", "amqtt", packets, _best(rounds, lambda: decode_amqtt(stream, packets))))
    say("encode PUBACK: filemq")
    results.append(CodecResult("encode_puback", "filemq", packets, _best(rounds, lambda: encode_puback_ours(packets))))
    say("encode PUBACK: amqtt (baseline)")
    results.append(CodecResult("encode_puback", "amqtt", packets, _best(rounds, lambda: encode_puback_amqtt(packets))))
    say("encode PUBLISH: filemq")
    results.append(CodecResult("encode_publish", "filemq", packets, _best(rounds, lambda: encode_publish_ours(packets))))
    say("encode PUBLISH: amqtt (baseline)")
    results.append(CodecResult("encode_publish", "amqtt", packets, _best(rounds, lambda: encode_publish_amqtt(packets))))
    return results


def ratios(results: list[CodecResult]) -> dict[str, float]:
    """Our rate divided by amqtt's rate, per operation (> 1 means we are faster)."""
    by_key = {(r.operation, r.impl): r for r in results}
    out = {}
    for operation in dict.fromkeys(r.operation for r in results):
        ours, base = by_key.get((operation, "filemq")), by_key.get((operation, "amqtt"))
        if ours and base:
            out[operation] = ours.rate / base.rate
    return out
