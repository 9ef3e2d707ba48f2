"""A failover slot's readiness, judged from rows of the ``slot`` query: a standby's copy is
usable when present, synchronised, persistent and not invalidated, and the slot is ready when
one standby holds such a copy."""

from __future__ import annotations

from typing import Any

import pytest

from cdc_relay.commands.status import _failover
from cdc_relay.postgres.failover import Copy, Readiness, copy_of

PRIMARY = {"failover": True, "confirmed_flush_lsn": "0/3000100", "restart_lsn": "0/3000028"}


def copy(**changes: Any) -> dict[str, Any]:
    """A usable copy, 0x40 bytes behind the primary's confirmed position, level at restart."""
    row = {
        "synced": True,
        "temporary": False,
        "invalidated": None,
        "confirmed_flush_lsn": "0/30000C0",
        "restart_lsn": "0/3000028",
    }
    return {**row, **changes}


def test_a_synchronised_persistent_copy_is_usable_with_its_lag_in_bytes() -> None:
    found = copy_of("s", "db-2:5432", PRIMARY, copy())
    assert found.usable and found.problem is None
    assert (found.confirmed_lag, found.restart_lag) == (0x40, 0)
    assert found.as_json()["confirmed_lag_bytes"] == 0x40


def test_a_copy_read_after_the_primary_moved_on_is_never_ahead() -> None:
    found = copy_of("s", "db-2:5432", PRIMARY, copy(confirmed_flush_lsn="0/4000000"))
    assert found.usable and found.confirmed_lag == 0


@pytest.mark.parametrize(
    ("row", "words"),
    [
        (None, "no copy of slot s (a standby with sync_replication_slots = on copies"),
        (copy(temporary=True), "its copy of slot s is still temporary, and a promotion would"),
        (copy(synced=False), "its slot s is its own, not a synchronised copy"),
        (
            copy(invalidated="wal_removed", restart_lsn=None),
            "its copy of slot s was invalidated (wal_removed: the WAL it held back grew past "
            "max_slot_wal_keep_size); with sync_replication_slots = on the standby drops it",
        ),
        (
            copy(invalidated="rows_removed", temporary=True),
            "its copy of slot s was invalidated (rows_removed:",
        ),
    ],
    ids=["missing", "temporary", "not-synced", "invalidated", "invalidated-before-temporary"],
)
def test_a_copy_that_would_not_survive_a_promotion_says_why(
    row: dict[str, Any] | None, words: str
) -> None:
    found = copy_of("s", "db-2:5432", PRIMARY, row)
    assert not found.usable
    assert found.problem is not None and found.problem.startswith(words), found.problem
    assert "\n" not in found.problem
    if row is None:
        assert (found.confirmed_lag, found.restart_lag) == (None, None)
    if row is not None and row["restart_lsn"] is None:
        assert found.restart_lag is None and found.confirmed_lag == 0x40


def test_ready_when_one_standby_of_several_holds_a_usable_copy() -> None:
    usable = copy_of("s", "db-3:5432", PRIMARY, copy())
    temporary = copy_of("s", "db-2:5432", PRIMARY, copy(temporary=True))
    ready = Readiness("s", failover=True, copies=(temporary, usable))
    assert ready.ready and ready.reason is None
    assert ready.as_json()["standbys"][1]["usable"] is True


def test_not_ready_names_every_standby_and_its_problem_in_one_line() -> None:
    silent = Copy("db-3:5432", "no answer (connection refused)")
    temporary = copy_of("s", "db-2:5432", PRIMARY, copy(temporary=True))
    found = Readiness("s", failover=True, copies=(temporary, silent))
    assert not found.ready
    assert found.reason is not None and "\n" not in found.reason
    assert found.reason.startswith(
        "no standby holds a usable copy of slot s: db-2:5432: its copy of slot s is still temporary"
    )
    assert found.reason.endswith("; db-3:5432: no answer (connection refused)")


def test_no_standby_in_the_dsn_and_no_failover_slot_are_never_ready() -> None:
    alone = Readiness("s", failover=True)
    assert not alone.ready
    assert alone.reason is not None
    assert alone.reason.startswith("no standby among the hosts of --dsn to hold a copy of slot s")
    plain = Readiness("s", failover=False, copies=(copy_of("s", "db-2", PRIMARY, copy()),))
    assert not plain.ready
    assert plain.reason is not None
    assert plain.reason.startswith("slot s is no failover slot, so no standby keeps a copy")
    assert "ALTER_REPLICATION_SLOT s (FAILOVER true)" in plain.reason


def test_status_shows_the_verdict_then_a_line_per_standby() -> None:
    found = Readiness(
        "s",
        failover=True,
        copies=(
            copy_of("s", "db-2:5432", PRIMARY, copy(temporary=True)),
            copy_of("s", "db-3:5432", PRIMARY, copy()),
        ),
    )
    rows = _failover(found.as_json())
    assert rows[0] == ("failover", "ready")
    assert rows[1][0] == "standby" and rows[1][1].startswith("db-2:5432: its copy of slot s is")
    assert rows[2] == (
        "standby",
        "db-3:5432: usable copy, confirmed 0/30000C0, 64 B behind the primary's slot "
        "(restart 0 B behind)",
    )
    assert _failover(Readiness("s", failover=False).as_json()) == [
        ("failover", "no (not a failover slot)")
    ]
    assert _failover(None) == []
