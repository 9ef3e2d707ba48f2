"""Log sequence numbers: PostgreSQL's 64-bit WAL positions, written ``X/Y`` in hex."""

from __future__ import annotations

import re

from cdc_relay.errors import UsageError

_LSN = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")

Lsn = int
"""A WAL position is a plain ``int``: cheap to compare, and what the wire protocol carries."""


def parse(text: str) -> Lsn:
    """Parse ``"16/B374D848"`` into an integer position."""
    match = _LSN.match(text.strip())
    if match is None:
        raise UsageError(f"{text!r} is not an LSN; write it as two hex numbers, like 0/16B3748")
    return (int(match.group(1), 16) << 32) | int(match.group(2), 16)


def format_lsn(lsn: Lsn) -> str:
    """Format an integer position the way PostgreSQL prints it."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
