"""What the loop says when the server ends the stream with an error, on the loop's in-memory
stages (test_stream_loop)."""

from __future__ import annotations

import pytest
from test_stream_loop import Wal, backlog, relay_on

from cdc_relay.errors import RelayError

# What ReplicationConnection raised, word for word, when PostgreSQL 15 ended the stream at a
# row its publication's row filter could not evaluate (a table published beside the outbox,
# passed over with --ignore-other-tables, filtered WHERE (10 / (n - 5) > 0), a row with
# n = 5): libpq's message holds the walsender's CONTEXT line after the ERROR, on every try.
SERVER_ERROR = (
    'ERROR:  division by zero\nCONTEXT:  slot "s", output plugin "pgoutput", in the change '
    "callback, associated LSN 0/151A3D0"
)


def test_the_error_that_stops_the_relay_after_the_same_server_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay stops after the same server error 8 times in a row, with "one line naming
    the error": the line holds the server's message, which PostgreSQL sends on two lines
    (ERROR, then CONTEXT), so the user gets two, the second without the remedy."""
    wal = Wal(backlog())
    relay, _ = relay_on(wal, ignore_other_tables=True)
    monkeypatch.setattr(relay._connection, "pause", lambda seconds: None)
    wal.error = SERVER_ERROR

    with pytest.raises(RelayError) as failure:
        relay.stream(wal.tables)

    message = str(failure.value)
    assert "8 times in a row" in message
    assert "division by zero" in message
    assert "\n" not in message, message
