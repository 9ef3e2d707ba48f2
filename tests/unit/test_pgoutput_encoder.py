"""The test encoder of pgoutput (pgoutput_encoder.py) writes what PostgreSQL writes: every
message captured from PostgreSQL 15 (tests/unit/data, bench/data) comes out of it byte for
byte, so the messages test_simulation synthesizes are the real format.

The records the relay decodes are written from the decoder's own records
(``encode(decode(b)) == b``); updates, deletes and truncates, which it reads through and
ignores, from their fields as the decoder's tuple reader finds them.
"""

from __future__ import annotations

import struct

import pytest
from capture import DATA, messages
from pgoutput_encoder import delete, encode, truncate, update
from test_stream_loop import backlog

from cdc_relay.events import Ignored
from cdc_relay.postgres import pgoutput

CAPTURES = {
    **{path.stem: messages(path.stem) for path in sorted(DATA.glob("*pgoutput*.jsonl"))},
    "backlog": backlog(),
}


def rewritten(data: bytes) -> bytes:
    """``data`` decoded, then written again by the encoder."""
    record = pgoutput.decode(data)
    if not isinstance(record, Ignored):
        return encode(record)
    (relid,) = struct.unpack_from("!I", data, 1)
    if record.kind == "truncate":
        count, options = struct.unpack_from("!IB", data, 1)
        return truncate(struct.unpack_from(f"!{count}I", data, 6), options)
    marker, pos = chr(data[5]), 6
    old, pos = pgoutput._values(data, pos) if marker in "KO" else (None, pos)
    if record.kind == "delete":
        assert old is not None
        return delete(relid, old, marker)
    if old is not None:
        assert chr(data[pos]) == "N"
        pos += 1
    new, _ = pgoutput._values(data, pos)
    return update(relid, new, old, marker)


def test_the_captures_hold_every_kind_the_simulation_writes() -> None:
    assert len(CAPTURES) >= 5  # pgoutput, bytea, cut, positions, the backlog
    kinds = {data[:1] for capture in CAPTURES.values() for data in capture}
    assert kinds >= {b"B", b"C", b"R", b"I", b"M", b"U", b"D", b"T"}


@pytest.mark.parametrize("capture", CAPTURES)
def test_every_captured_message_is_written_back_byte_for_byte(capture: str) -> None:
    for number, data in enumerate(CAPTURES[capture]):
        assert rewritten(data) == data, f"message {number} of {capture}"
