"""The PUBACK slicer: a read of nothing but whole PUBACKs split into packet ids with C-level
slices, not decoded packet by packet.

What a QoS 1 peer sends back is mostly such reads: a subscriber acking the broker's deliveries,
the broker acking an export link's publishes.  A PUBACK with no reason code is four bytes,
``40 02 hi lo`` (MQTT 3.1.1 3.4 and MQTT 5.0 3.4.2.1: reason code 0x00 and no properties may be
left out), so a read of ``n`` of them is ``4 n`` bytes whose every fourth byte from 0 is 0x40
and from 1 is 0x02.  :func:`puback_ids` is the one place that tests this; the broker's
connection (filemq/broker/session/connection.py) and the export link (worker_agent/mqtt_link.py) both use
it, and anything else (another packet, a PUBACK with a reason code or properties, a packet id 0,
a packet cut by the read) goes to the decoder, which applies every rule.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

# For reads of up to PUBACK_RUN PUBACKs: per count, the bytes every first and every second
# byte must be, and a Struct's unpack that reads the ids straight out (each "40 02 hi lo").
PUBACK_RUN = 64
PUBACK_TYPES = [b"\x40" * n for n in range(PUBACK_RUN + 1)]
PUBACK_LENGTHS = [b"\x02" * n for n in range(PUBACK_RUN + 1)]
PUBACK_IDS = [struct.Struct(">" + "2xH" * n).unpack for n in range(PUBACK_RUN + 1)]
unpack_words = struct.unpack
LOW16 = (0xFFFF).__and__  # the packet id of a PUBACK read as a 32-bit word
# "40 02 00 00" (a PUBACK of packet id 0, which MQTT-2.3.1-1 forbids) can only be found at a
# packet's start in a read of whole PUBACKs.
PUBACK_ID_ZERO = b"\x40\x02\x00\x00"


def puback_ids(data: bytes) -> Sequence[int] | None:
    """The packet ids, in order, if ``data`` is one or more whole four-byte PUBACKs with
    non-zero ids; else None (decode ``data`` packet by packet: the decoder reports what is
    wrong, e.g. a packet id 0).  Never raises; an id may occur more than once."""
    n = len(data) >> 2
    if not n or len(data) & 3 or data[0] != 0x40:
        return None
    pids: Sequence[int]
    if n <= PUBACK_RUN:
        if data[0::4] != PUBACK_TYPES[n] or data[1::4] != PUBACK_LENGTHS[n]:
            return None
        pids = PUBACK_IDS[n](data)
    elif data[0::4] == b"\x40" * n and data[1::4] == b"\x02" * n:
        # Each PUBACK as one big-endian 32-bit word 0x4002_iiii: the id is its low half.
        pids = list(map(LOW16, unpack_words(f">{n}I", data)))
    else:
        return None
    # find, not "in": bytes.__contains__ first tries its argument as an int and raises and
    # clears a TypeError every time.
    if data.find(PUBACK_ID_ZERO) >= 0:
        return None
    return pids
