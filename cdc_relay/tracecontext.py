"""The W3C trace context stored with an event (``--trace-column``): the column's value read,
its ``traceparent`` checked. Pure: text in, a ``TraceContext`` out.

The column holds one of two forms, told apart by what a traceparent never holds (it is hex
digits and dashes):

- a plain ``traceparent`` (``00-<trace id>-<parent id>-<flags>``): a value with no line
  break, ``=`` or ``:`` (blanks around it aside), sent as it is stored;
- ``java.util.Properties`` text with the keys ``traceparent`` and maybe ``tracestate``:
  what Debezium's outbox extension writes into its ``tracingspancontext`` column (an
  OpenTelemetry W3C propagator's injection, stored with ``Properties.store``: a date comment
  line, then ``key=value`` lines with ``=``, ``:``, ``#`` and ``!`` escaped by ``\\``). It is
  read as ``Properties.load`` reads it; other keys (``baggage``, ``uber-trace-id``...) are
  not sent.

A traceparent that breaks the W3C rules is still sent as stored (a W3C receiver ignores it
and starts a trace of its own, and nothing the application stored is lost on the way), with
the reason in ``TraceContext.problem``, which the router logs and counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
NAMES = (TRACEPARENT, TRACESTATE)
"""The headers a trace context goes out as, in this order (W3C Trace Context's names)."""

# version 2 hex digits (not ff), trace id 32, parent id 16, flags 2, all lowercase; a later
# version may append fields after a dash (W3C Trace Context, 3.2 and 4.3).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)
_PROPERTIES_MARKS = re.compile(r"[\r\n=:]")


@dataclass(frozen=True, slots=True)
class TraceContext:
    """What an event's trace column says: the header values, as stored (None: absent), and
    why ``traceparent`` is no W3C traceparent (None: it is one)."""

    traceparent: bytes | None
    tracestate: bytes | None = None
    problem: str | None = None

    def headers(self) -> list[tuple[str, bytes]]:
        """The ``traceparent`` and ``tracestate`` headers (those present), in this order."""
        out = []
        if self.traceparent is not None:
            out.append((TRACEPARENT, self.traceparent))
            if self.tracestate is not None:
                out.append((TRACESTATE, self.tracestate))
        return out

    @property
    def valid(self) -> bool:
        """A W3C traceparent is there (the CloudEvents extension attributes require one)."""
        return self.traceparent is not None and self.problem is None


def traceparent_problem(value: str) -> str | None:
    """Why ``value`` is not a W3C traceparent (Trace Context Level 1, 3.2); None if it is."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return (
            "is not version-traceid-parentid-flags in lowercase hex (00-<32 hex>-<16 hex>-<2 hex>)"
        )
    version, trace_id, parent_id, _, more = match.groups()
    if version == "ff":
        return "has version ff, which W3C Trace Context forbids"
    if version == "00" and more is not None:
        return "has fields after the flags, which version 00 does not have"
    if trace_id == "0" * 32:
        return "has an all-zero trace id"
    if parent_id == "0" * 16:
        return "has an all-zero parent id"
    return None


def parse(value: bytes) -> TraceContext | None:
    """The trace context the column's ``value`` holds; None when it holds none (empty, or
    only blanks: nothing to send, nothing lost)."""
    text = value.decode(errors="replace")  # the database is UTF8 (checked at start-up)
    if not text.strip():
        return None
    if _PROPERTIES_MARKS.search(text.strip()) is None:
        return TraceContext(value, None, traceparent_problem(text))
    properties = load_properties(text)
    traceparent = properties.get(TRACEPARENT)
    if traceparent is None:
        keys = (
            ", ".join(
                key if key.isprintable() and len(key) <= 80 else shown(key)
                for key in sorted(properties)[:5]
            )
            or "none"
        )
        keys += ", ..." if len(properties) > 5 else ""
        return TraceContext(
            None,
            None,
            f"is java.util.Properties text without a traceparent key (keys: {keys}), so no "
            "traceparent header can be sent",
        )
    tracestate = properties.get(TRACESTATE) or None  # an empty tracestate is none
    return TraceContext(
        traceparent.encode(),
        None if tracestate is None else tracestate.encode(),
        traceparent_problem(traceparent),
    )


def shown(value: str | bytes, limit: int = 80) -> str:
    """``value`` as a log line quotes it: on one line (``repr``: a line break is ``\\n``), its
    first ``limit`` characters, so a value of any size, or one that forges a log line, is
    named without either."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    cut = text[:limit]
    return repr(cut) + (f" (first {limit} of {len(text)} characters)" if len(text) > limit else "")


# -- java.util.Properties.load ------------------------------------------------------------

_BLANK = " \t\f"
_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _logical_lines(text: str) -> list[str]:
    """The logical lines of ``text`` as Properties.load reads them: natural lines with their
    leading blanks skipped, comments (``#``, ``!``) and blank lines dropped, and a line ending
    in an odd number of backslashes joined with the next (whose leading blanks are skipped)."""
    lines = []
    current: str | None = None
    for natural in re.split(r"\r\n|\r|\n", text):
        line = natural.lstrip(_BLANK)
        if current is None and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        joined = (current or "") + (line[:-1] if trailing % 2 else line)
        if trailing % 2:
            current = joined
        else:
            lines.append(joined)
            current = None
    if current is not None:
        lines.append(current)
    return lines


def _unescape(text: str) -> str:
    """Properties.load's escapes: ``\\t \\n \\r \\f``, ``\\uXXXX``, and ``\\x`` for any other
    ``x`` (a malformed ``\\u`` is kept as written, where Java would refuse the whole text)."""
    out = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "\\" or i + 1 == len(text):
            if char != "\\":
                out.append(char)
            i += 1
            continue
        escaped = text[i + 1]
        if escaped == "u" and re.fullmatch(r"[0-9A-Fa-f]{4}", text[i + 2 : i + 6]):
            out.append(chr(int(text[i + 2 : i + 6], 16)))
            i += 6
            continue
        out.append(_ESCAPES.get(escaped, escaped))
        i += 2
    return "".join(out)


def load_properties(text: str) -> dict[str, str]:
    """``text`` read as ``java.util.Properties.load`` reads it: the last value of each key."""
    properties: dict[str, str] = {}
    for line in _logical_lines(text):
        i = 0
        while i < len(line):  # the key ends at an unescaped separator or blank
            if line[i] == "\\":
                i += 2
                continue
            if line[i] in "=:" or line[i] in _BLANK:
                break
            i += 1
        key = line[:i]
        rest = line[i:].lstrip(_BLANK)
        if rest[:1] in ("=", ":"):
            rest = rest[1:].lstrip(_BLANK)
        properties[_utf16(_unescape(key))] = _utf16(_unescape(rest))
    return properties


def _utf16(text: str) -> str:
    """``text`` as the Java string its ``\\uXXXX`` escapes make: a surrogate pair is the one
    character it encodes (Properties.store writes a character outside the BMP as its pair),
    and a lone surrogate, which has no UTF-8 form, is U+FFFD, never an error that would stop
    the relay at this event on every start."""
    if not any("\ud800" <= char <= "\udfff" for char in text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
