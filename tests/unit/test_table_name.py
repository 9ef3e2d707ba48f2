"""``outbox.table_name``: a table name read as PostgreSQL reads ``--table`` (the integration
test ``test_writers.py`` checks the common spellings against the server's to_regclass)."""

from __future__ import annotations

import pytest

from cdc_relay.outbox import table_name


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("outbox_events", ("outbox_events",)),
        ("Tenant.Outbox_Events", ("tenant", "outbox_events")),
        ('"Tenant"."Outbox ""x"""', ("Tenant", 'Outbox "x"')),
        (' app . "A.B" ', ("app", "A.B")),
        ("Zürich.T", ("zürich", "t")),  # only ASCII letters fold, as in a UTF8 database
        ("db.s.t", ("db", "s", "t")),
        ("x" * 70, ("x" * 63,)),  # cut to 63 bytes
        ("é" * 40, ("é" * 31,)),  # ... at a character's boundary
    ],
)
def test_a_name_is_read_as_postgresql_reads_it(name: str, parts: tuple[str, ...]) -> None:
    assert table_name(name) == parts


@pytest.mark.parametrize("name", ["", "a.", ".a", "a..b", '"unclosed', '""', "a b", '"a"b'])
def test_a_name_postgresql_would_refuse_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="is not a table name"):
        table_name(name)
