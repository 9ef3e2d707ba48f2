"""The pure parts of cdc_relay/postgres/lineage.py and gaps.py: what counts as a change of a
publication between two looks, and which moment the watcher records with the slot's position."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from cdc_relay import schema
from cdc_relay.postgres import gaps, lineage


def _seen(*identity: int | None, table: str = "public.outbox_events") -> dict[str, Any]:
    return {"table": table, "identity": list(identity), "publish": "insert"}


BEFORE = {"16400": _seen(16392, 726, 16393, 726, None, None)}


def test_the_same_identities_are_no_change_whatever_else_differs() -> None:
    now = {"16400": {**_seen(16392, 726, 16393, 726, None, None), "publish": "update"}}
    assert lineage.change(BEFORE, now, "p") is None


def test_each_catalog_row_made_anew_or_altered_is_a_change_named_for_what_it_is() -> None:
    cases = {
        (16500, 800, 16501, 800, None, None): "dropped and made again",
        (16392, 731, 16393, 726, None, None): "ALTER PUBLICATION altered it",
        (16392, 726, 16396, 729, None, None): "its entry for public.outbox_events was made again",
        (16392, 726, 16393, 730, None, None): "its entry for public.outbox_events was altered",
        (16392, 726, 16393, 726, 16397, 740): "its entry for the schema of public.outbox_events",
    }
    for identity, words in cases.items():
        what = lineage.change(BEFORE, {"16400": _seen(*identity)}, "p")
        assert what is not None and words in what, (identity, what)


def test_a_table_seen_at_one_look_only_is_not_compared() -> None:
    now = {**BEFORE, "16500": _seen(16392, 726, None, None, None, None, table="t.new")}
    assert lineage.change(BEFORE, now, "p") is None
    assert lineage.change({}, now, "p") is None


def test_the_moment_recorded_with_a_position_is_the_newest_look_at_or_before_it() -> None:
    watch = gaps.Watch("s", "p")
    start = datetime(2026, 1, 5, 9, tzinfo=UTC)
    for second, lsn in enumerate((100, 200, 200, 300)):
        watch.passed(lsn, start + timedelta(seconds=second))
    watch.passed(250, start + timedelta(seconds=9))  # never back: a look of a standby behind
    assert watch._moment(99) is None  # no look knows when the WAL had not passed it
    assert watch._moment(100) == start
    assert watch._moment(250) == start + timedelta(seconds=2)
    assert watch._moment(10**9) == start + timedelta(seconds=3)


def test_set_up_makes_the_table_from_the_last_statement_of_schema_outbox() -> None:
    assert lineage.DDL.startswith("CREATE TABLE IF NOT EXISTS cdc_relay_slots (")
    assert schema.text("outbox").rstrip().endswith(lineage.DDL.rstrip())
