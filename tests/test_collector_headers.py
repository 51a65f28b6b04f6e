"""The collector door's record-header check (issue 33 item 19): the same verdict as the full
MQTT 5.0 property decoder, with its work on the event loop bounded per batch."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("pyarrow", reason="the collector extra (pyarrow) is not installed")

import collector.headers as door  # noqa: E402
from collector.headers import FULL_CHECKS_PER_BATCH, HeaderCheck, check_headers  # noqa: E402
from filemq.mqtt.packets import Properties  # noqa: E402
from filemq.mqtt.properties import decode_message_headers, encode_message_headers  # noqa: E402
from filemq.upstream.batch import BatchRecord, MalformedBatch, decode_batch, encode_batch  # noqa: E402

text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=12)
message_properties = st.builds(
    Properties,
    payload_format_indicator=st.none() | st.sampled_from([0, 1]),
    message_expiry_interval=st.none() | st.integers(0, 2**32 - 1),
    content_type=st.none() | text,
    response_topic=st.none() | text,
    correlation_data=st.none() | st.binary(max_size=12),
    user_properties=st.lists(st.tuples(text, text), max_size=3),
)


def _verdict(check: Any, headers: bytes) -> bool:
    try:
        check(headers)
    except ValueError:
        return False
    return True


@given(message_properties, st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4))
@settings(max_examples=400)
def test_shape_check_agrees_with_the_full_decoder(props: Properties, edits: list[tuple[int, int]]) -> None:
    """For valid headers and any bytes of the same length (the valid ones with bytes changed:
    identifiers, length fields, string contents, a NUL, broken UTF-8), the door's check --
    which, once a layout is known, only compares the layout bytes and decodes the strings --
    accepts exactly what decode_message_headers accepts (MQTT 5.0 2.2.2.2, MQTT-1.5.4-1/-2)."""
    headers = encode_message_headers(props)
    if not headers:
        return
    door._shapes.clear()  # (the cache keeps a few layouts per length: start from none)
    check_headers(headers)  # valid: accepted, and its layout learnt
    assert door._known_shape(headers)
    mutated = bytearray(headers)
    for at, value in edits:
        mutated[at % len(mutated)] = value
    expected = _verdict(decode_message_headers, bytes(mutated))
    assert _verdict(check_headers, bytes(mutated)) == expected
    assert _verdict(HeaderCheck(), bytes(mutated)) == expected


def _batch(headers: list[bytes]) -> bytes:
    return encode_batch("dev-1", "main", [BatchRecord(i, 1_700_000_000_000_000 + i, "t", b"p", 1, h)
                                          for i, h in enumerate(headers)])


class CountingDecoder:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, headers: bytes) -> Properties | None:
        self.calls += 1
        return decode_message_headers(headers)


def test_distinct_headers_of_one_layout_cost_one_full_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case of the issue: 10,000 records, each with its own correlation id and sequence
    number (distinct bytes, few layouts).  The full decoder runs once per layout (here: per
    length of the sequence number), not once per record; a bad string in the middle is
    still found and names its record."""
    counting = CountingDecoder()
    monkeypatch.setattr(door, "decode_message_headers", counting)
    monkeypatch.setattr(door, "_shapes", {})
    headers = [encode_message_headers(Properties(content_type="application/json", correlation_data=os.urandom(16),
                                                 user_properties=[("seq", str(i))]))
               for i in range(10_000)]
    checked = HeaderCheck()
    batch = decode_batch(_batch(headers), check_headers=checked)
    assert len(batch) == 10_000 and checked.deferred == 0
    assert counting.calls == 4  # sequence numbers of 1, 2, 3 and 4 digits
    bad = list(headers)
    bad[5_000] = bad[5_000].replace(b"application/json", b"application/\xffson")
    with pytest.raises(MalformedBatch, match="offset 5000"):
        decode_batch(_batch(bad), check_headers=HeaderCheck())


def test_a_batch_of_all_new_layouts_gets_a_bounded_number_of_full_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender whose every record has a layout of its own (a free-text property of every
    length): at most FULL_CHECKS_PER_BATCH full decodes per batch; the rest are counted as
    deferred (landing decodes every header and lands an undecodable one's row without its
    properties, with an ERROR).  The next batch gets its own budget."""
    counting = CountingDecoder()
    monkeypatch.setattr(door, "decode_message_headers", counting)
    monkeypatch.setattr(door, "_shapes", {})
    n = FULL_CHECKS_PER_BATCH + 500
    headers = [encode_message_headers(Properties(user_properties=[("note", "x" * i)])) for i in range(n)]
    checked = HeaderCheck()
    decode_batch(_batch(headers), check_headers=checked)
    assert counting.calls == FULL_CHECKS_PER_BATCH and checked.deferred == 500
    again = HeaderCheck()
    recent = headers[FULL_CHECKS_PER_BATCH - 10:FULL_CHECKS_PER_BATCH]  # (learnt last: still known)
    decode_batch(_batch(recent), check_headers=again)
    assert counting.calls == FULL_CHECKS_PER_BATCH and again.deferred == 0
