"""A bytea payload goes to Kafka as the stored bytes, from both plugins' text forms.

The messages are real: captured from PostgreSQL 15 for a table whose payload is bytea, with
``bytea_output`` hex (the default) and escape.
"""

from __future__ import annotations

import pytest
from capture import messages

from cdc_relay.events import Begin, Insert, Relation, RowMapper, SchemaError, bytea_from_text
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.wal2json import Wal2JsonDecoder

STORED = {
    "hex output": b"\x0a\x0b\x0c\x00\xff",
    "escape output": b"\x0a\x5c\x0c\x00\xff\x27",
    "empty bytea": b"",
}


def _payloads(plugin: str, step: str) -> list[bytes | None]:
    decode = Wal2JsonDecoder().decode if plugin == "wal2json" else lambda m: [pgoutput.decode(m)]
    mappers: dict[int, RowMapper] = {}
    begin = Begin(final_lsn=1, commit_time_us=0, xid=1)
    payloads = []
    for raw in messages(f"bytea-{plugin}", step):
        for record in decode(raw):
            if isinstance(record, Relation):
                mappers[record.relid] = RowMapper.for_relation(record)
            elif isinstance(record, Insert):
                payloads.append(mappers[record.relid].event(record, begin).payload)
    return payloads


# wal2json prints hex without its \\x, so its escape form would be ambiguous: the relay sets
# bytea_output = hex on its replication connection, and only pgoutput is checked in escape form.
CASES = [("pgoutput", step) for step in STORED] + [
    ("wal2json", step) for step in STORED if step != "escape output"
]


@pytest.mark.parametrize(("plugin", "step"), CASES)
def test_bytea_payload_is_the_stored_bytes(plugin: str, step: str) -> None:
    assert _payloads(plugin, step) == [STORED[step]]


def test_text_forms_of_bytea() -> None:
    assert bytea_from_text(b"\\x") == b""
    assert bytea_from_text(b"\\xdeadBEEF") == b"\xde\xad\xbe\xef"
    assert bytea_from_text(b"a\\\\b\\000\\377") == b"a\\b\x00\xff"
    with pytest.raises(SchemaError, match="malformed"):
        bytea_from_text(b"\\xabc")
