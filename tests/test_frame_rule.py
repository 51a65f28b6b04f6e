"""The record frame check has one home (issue 31 item 3): segments/frame_rule.py declares it and
generates each reader's form of it into segments/record.py.  These tests regenerate the file
and fail on any difference (a hand edit of a generated block, or a rule change not
regenerated), and check that the generator rejects what it cannot place."""
from __future__ import annotations

import pytest

from segments import frame_rule, record


def test_record_py_is_what_frame_rule_generates() -> None:
    text = frame_rule.RECORD_PY.read_text()
    assert frame_rule.regenerate(text) == text, "run: python -m segments.frame_rule"
    assert frame_rule.main(["--check"]) == 0


def test_every_reader_carries_a_generated_block() -> None:
    """check_frame, length_in_range, decode_run (both formats), scan_run (both formats)."""
    text = frame_rule.RECORD_PY.read_text()
    forms = [m.group("form").strip() for line in text.split("\n") if (m := frame_rule.MARKER.match(line))]
    assert forms == ["check_frame", "length", "format 1", "format 2, hstop", "format 1", "format 2"]


def test_a_hand_edit_of_a_generated_block_is_undone() -> None:
    text = frame_rule.RECORD_PY.read_text()
    edited = text.replace("length < 24 or framed > 67108864", "length < 24 or framed >= 67108864", 1)
    assert edited != text
    assert frame_rule.regenerate(edited) == text


def test_a_changed_constant_reaches_the_inlined_literals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast forms write record.py's constants as literals: a constant changed without
    regenerating makes the file differ from what the generator writes."""
    text = frame_rule.RECORD_PY.read_text()
    monkeypatch.setattr(record, "MAX_RECORD_BYTES", 1 << 20)
    new = frame_rule.regenerate(text)
    assert new != text
    assert new.count("framed > 1048576") == 4


def test_a_rule_change_reaches_every_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """One edit of the declared rule changes all six generated blocks."""
    text = frame_rule.RECORD_PY.read_text()
    monkeypatch.setattr(frame_rule, "LENGTH_IN_RANGE",
                        frame_rule.Check("length in range", "length <= MIN_LENGTH or framed > MAX_RECORD_BYTES",
                                         "BAD_LENGTH"))
    monkeypatch.setattr(frame_rule, "CHECKS", (frame_rule.LENGTH_IN_RANGE, frame_rule.WHOLE_FRAME, frame_rule.FLAGS))
    new = frame_rule.regenerate(text)
    assert new.count("length <= MIN_LENGTH or framed") == 2  # check_frame, length_in_range
    assert new.count("length <= 24 or framed") == 4  # the fast forms, MIN_LENGTH inlined
    assert "length < MIN_LENGTH" not in new and "length < 24" not in new


@pytest.mark.parametrize("bad", [
    "    # <frame-check format 3>\n    # </frame-check>\n",
    "    # <frame-check check_frame; or: offset != expected>\n    # </frame-check>\n",
    "    # <frame-check format 1>\n    x = 1\n",
    "no markers at all\n",
])
def test_the_generator_rejects_a_block_it_cannot_fill(bad: str) -> None:
    with pytest.raises(ValueError):
        frame_rule.regenerate(bad)


def test_the_generated_check_is_the_documented_rule() -> None:
    """Spot checks of the compiled result against the rule in the module docstring."""
    good = record.encode(7, 1, b"t", b"p", 1)
    assert record.check_frame(good, 0, len(good)) == len(good)
    bad_flags = bytearray(good)
    bad_flags[9] = 3  # QoS 3
    assert record.check_frame(bytes(bad_flags), 0, len(good)) == record.BAD_HEADER
