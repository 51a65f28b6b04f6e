"""The record frame check, declared once: the code of every reader that applies it is
generated from here into segments/record.py.

A record frame is valid only if its length is in range, the whole frame is there, its version
is known, its reserved flag bits are zero and its QoS is not 3, its topic (and, in format 2,
its ``headers_len`` field and headers) fit inside the frame, and its CRC-32C matches.  Three
readers apply that rule and must agree on every byte: :func:`segments.record.check_frame`
(one record, says why it fails: the walk, resync, ``filemq inspect``/verify, recovery's slow
path), :func:`~segments.record.decode_run` (the read fast path) and
:func:`~segments.record.scan_run` (the recovery fast path).  The fast paths inline the check
into their loops (one ``unpack`` per record and no call: a call per record would cost them
more than the check itself), so the check cannot be one function they call.  Instead, as
CPython's Argument Clinic does, the rule is the :data:`CHECKS` table below and
``python -m segments.frame_rule`` writes each reader's form of it into segments/record.py,
between a ``# <frame-check FORM>`` marker and ``# </frame-check>``.
tests/test_frame_rule.py regenerates the file and fails on any difference, so a hand edit of
a generated block, or a rule change not regenerated, cannot pass.

Forms (the marker's FORM):

* ``check_frame``: the whole body of ``check_frame(buf, pos, end)``, one ``if`` per check,
  returning the check's reason (INCOMPLETE, BAD_LENGTH, BAD_CRC, BAD_HEADER) or the framed
  length;
* ``length``: the return statement of ``length_in_range(length)`` (its ``framed`` set), the
  first check alone, for recovery's guess at whether a damaged record's length is right;
* ``format 1`` / ``format 2``: one boolean expression, true when the record at ``pos`` is not
  a valid record of that format, over the locals a fast loop has unpacked (``length, crc,
  version, flags, offset, ts, topic_len`` from ``HEADER``, ``framed = length + LENGTH_SIZE``,
  ``nxt = pos + framed``, ``end``, ``buf``, ``view = memoryview(buf)``, ``flags_ok =
  _FLAGS_OK``, ``headers_unpack = HEADERS_LEN.unpack_from``).  ``FORM; or: EXPR`` adds the
  loop's own condition (the offset sequence) before the CRC, the one costly check.  The
  format 2 form leaves ``at`` (the ``headers_len`` field's position) set for the loop to use,
  and with ``format 2, hstop`` also ``hstop`` (the end of the headers).  The fast forms write
  the constants of :data:`INLINED` as literals (named in a comment above them): a literal
  costs less than a global per record, and the diff test catches a constant changed without
  regenerating.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

RECORD_PY = Path(__file__).with_name("record.py")


@dataclass(frozen=True)
class Check:
    """One part of the rule: ``fails`` is a Python expression that is true when a frame breaks
    it; ``reason`` is the name of check_frame's result for it.  ``{flags_ok}``, ``{view}`` and
    ``{headers_unpack}`` name what a fast loop holds in locals (check_frame: the globals);
    ``{hstop}`` is ``hstop := `` where the reader keeps the end of the headers, else empty."""

    what: str
    fails: str
    reason: str


# Checked in this order, cheapest first; the CRC last.
LENGTH_IN_RANGE = Check("length in range", "length < MIN_LENGTH or framed > MAX_RECORD_BYTES", "BAD_LENGTH")
WHOLE_FRAME = Check("the whole frame is there", "nxt > end", "INCOMPLETE")
FLAGS = Check("no reserved flag bit, QoS not 3", "not {flags_ok}[flags]", "BAD_HEADER")
# The checks of each known version (the version constant's name); any other version: BAD_HEADER.
BY_VERSION: dict[str, tuple[Check, ...]] = {
    "FORMAT_VERSION": (
        Check("topic inside the frame", "HEADER_SIZE + topic_len > framed", "BAD_LENGTH"),
    ),
    "FORMAT_VERSION_HEADERS": (
        Check("headers_len field inside the frame",
              "(at := pos + HEADER_SIZE + topic_len) + HEADERS_LEN_SIZE > nxt", "BAD_LENGTH"),
        Check("headers inside the frame",
              "({hstop}at + HEADERS_LEN_SIZE + {headers_unpack}(buf, at)[0]) > nxt", "BAD_LENGTH"),
    ),
}
UNKNOWN_VERSION = "BAD_HEADER"
# A small frame's bytes are cheaper to copy than to wrap in a memoryview.
CRC = Check("CRC-32C of the bytes after the crc field",
            "crc32c(buf[pos + CRC_START : nxt] if framed < 4096 else {view}[pos + CRC_START : nxt]) != crc",
            "BAD_CRC")
CHECKS = (LENGTH_IN_RANGE, WHOLE_FRAME, FLAGS)  # then the version's checks, then CRC

FAST_NAMES = {"flags_ok": "flags_ok", "view": "view", "headers_unpack": "headers_unpack", "hstop": ""}
GLOBAL_NAMES = {"flags_ok": "_FLAGS_OK", "view": "memoryview(buf)", "headers_unpack": "HEADERS_LEN.unpack_from",
                "hstop": ""}
KEEP_HSTOP = {"hstop": "hstop := "}
FORMATS = {"format 1": "FORMAT_VERSION", "format 2": "FORMAT_VERSION_HEADERS"}
# The fast forms write these constants of record.py as literals.
INLINED = ("MIN_LENGTH", "MAX_RECORD_BYTES", "FORMAT_VERSION", "FORMAT_VERSION_HEADERS", "HEADER_SIZE",
           "HEADERS_LEN_SIZE", "CRC_START")
WIDTH = 116  # generated lines wrap here (ruff's E501 is off; the hand-written code goes to ~120)

MARKER = re.compile(r"^(?P<indent> *)# <frame-check (?P<form>[^;>]+)(?:; or: (?P<extra>.+))?>$")
END = "# </frame-check>"


def _render(check: Check, names: dict[str, str]) -> str:
    return check.fails.format(**names)


def check_frame_body() -> list[str]:
    """The body of check_frame, one check per ``if`` (indent 0)."""
    lines = [
        "if end - pos < HEADER_SIZE:",
        "    return INCOMPLETE",
        "length, crc, version, flags, _, _, topic_len = HEADER.unpack_from(buf, pos)",
        "framed: int = length + LENGTH_SIZE",
        "nxt = pos + framed",
    ]
    for check in CHECKS:
        lines += [f"if {_render(check, GLOBAL_NAMES)}:  # {check.what}", f"    return {check.reason}"]
    for i, (version, checks) in enumerate(BY_VERSION.items()):
        lines.append(f"{'if' if i == 0 else 'elif'} version == {version}:")
        for check in checks:
            lines += [f"    if {_render(check, GLOBAL_NAMES)}:  # {check.what}", f"        return {check.reason}"]
    lines += ["else:  # unknown version", f"    return {UNKNOWN_VERSION}"]
    lines += [f"if {_render(CRC, GLOBAL_NAMES)}:", f"    return {CRC.reason}", "return framed"]
    return lines


def fast_terms(form: str, extra: str | None, keep_hstop: bool = False) -> list[str]:
    """The terms, or-ed, of the fast loops' expression for ``form`` (``format 1``/``format 2``);
    ``keep_hstop``: bind ``hstop`` (format 2)."""
    version = FORMATS[form]
    names = FAST_NAMES | KEEP_HSTOP if keep_hstop else FAST_NAMES
    terms = [_render(LENGTH_IN_RANGE, names), _render(WHOLE_FRAME, names), f"version != {version}",
             _render(FLAGS, names)]
    terms += [_render(check, names) for check in BY_VERSION[version]]
    if extra:
        terms.append(f"({extra.strip()})")
    terms.append(_render(CRC, names))
    return terms


def _inline(terms: list[str]) -> tuple[list[str], list[str]]:
    """``terms`` with record.py's constants written as literals (a LOAD_CONST is cheaper than a
    LOAD_GLOBAL, per record), and the ``NAME=value`` of those replaced, in order of use."""
    from segments import record

    used: dict[str, int] = {}

    def literal(m: re.Match[str]) -> str:
        value: int = getattr(record, m.group(0))
        used[m.group(0)] = value
        return str(value)

    pattern = re.compile(r"\b(?:" + "|".join(INLINED) + r")\b")
    return [pattern.sub(literal, term) for term in terms], [f"{k}={v}" for k, v in used.items()]


def _wrap(terms: list[str], indent: str) -> list[str]:
    lines: list[str] = []
    line = indent + terms[0]
    for term in terms[1:]:
        if len(line) + 4 + len(term) > WIDTH:
            lines.append(line)
            line = f"{indent}or {term}"
        else:
            line += f" or {term}"
    lines.append(line)
    return lines


def generate(form: str, extra: str | None, indent: str) -> list[str]:
    """The generated lines of one marked block."""
    if form in ("check_frame", "length"):
        if extra:
            raise ValueError(f"{form} takes no extra condition")
        if form == "length":
            return [f"{indent}return not ({_render(LENGTH_IN_RANGE, GLOBAL_NAMES)})"]
        return [indent + line if line else line for line in check_frame_body()]
    form, *binds = (part.strip() for part in form.split(","))
    if form not in FORMATS or binds not in ([], ["hstop"]):
        raise ValueError(f"unknown frame-check form {form!r} {binds!r}")
    terms, inlined = _inline(fast_terms(form, extra, keep_hstop=bool(binds)))
    return _wrap([f"# (inlined: {', '.join(inlined)})"], indent) + _wrap(terms, indent)


def regenerate(text: str) -> str:
    """``text`` (segments/record.py) with every marked block generated again."""
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    blocks = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        m = MARKER.match(line)
        if m is None:
            continue
        blocks += 1
        while i < len(lines) and lines[i].strip() != END:
            i += 1
        if i == len(lines):
            raise ValueError(f"frame-check block {m.group('form')!r} has no {END!r}")
        out += generate(m.group("form").strip(), m.group("extra"), m.group("indent"))
        out.append(lines[i])
        i += 1
    if not blocks:
        raise ValueError("no frame-check blocks found")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """``python -m segments.frame_rule [--check]``: rewrite record.py (``--check``: only say
    whether it is up to date; exit status 1 if not)."""
    text = RECORD_PY.read_text()
    new = regenerate(text)
    if new == text:
        return 0
    if "--check" in argv:
        sys.stderr.write(f"{RECORD_PY} is not what segments/frame_rule.py generates: run python -m segments.frame_rule\n")
        return 1
    RECORD_PY.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
