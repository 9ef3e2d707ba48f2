"""What stream and status say of a slot PostgreSQL invalidated, for each of its reasons."""

from __future__ import annotations

import pytest

from cdc_relay import metrics
from cdc_relay.postgres import failover


def test_a_usable_slot_has_nothing_to_say() -> None:
    assert failover.slot_invalidated("s", {"invalidated": None, "wal_status": "reserved"}) is None
    assert failover.slot_invalidated("s", {}) is None


@pytest.mark.parametrize(
    ("reason", "cause"),
    [
        ("wal_removed", "max_slot_wal_keep_size"),
        ("idle_timeout", "idle_replication_slot_timeout"),
        ("rows_removed", "hot_standby_feedback off"),
        ("wal_level_insufficient", "wal_level is no longer logical"),
        ("a_future_reason", "invalidation_reason a_future_reason"),
    ],
)
def test_each_reason_is_named_with_its_setting_and_the_remedy_in_one_line(
    reason: str, cause: str
) -> None:
    text = failover.slot_invalidated("s", {"invalidated": reason, "confirmed_flush_lsn": "0/1"})
    assert text is not None
    assert "\n" not in text
    assert text.startswith(f"replication slot 's' was invalidated by PostgreSQL ({reason}: ")
    assert cause in text
    assert "drop it (cdc-relay drop-slot) and make it anew with cdc-relay setup-slot " in text
    assert "--republish-since TIME" in text
    assert "less its lag and your longest transaction" in text
    assert "the slot had confirmed 0/1)" in text


def test_the_gauges_follow_the_slot_row() -> None:
    metrics.observe_slot({"retained_bytes": 10, "safe_wal_bytes": None, "invalidated": None})
    assert metrics.SLOT_SAFE_WAL._value.get() == float("inf")  # no max_slot_wal_keep_size
    assert metrics.SLOT_INVALIDATED._value.get() == 0
    metrics.observe_slot({"retained_bytes": 10, "safe_wal_bytes": -5, "invalidated": None})
    assert metrics.SLOT_SAFE_WAL._value.get() == -5  # past it, not yet invalidated
    metrics.observe_slot({"retained_bytes": None, "safe_wal_bytes": None, "invalidated": "x"})
    assert (metrics.SLOT_SAFE_WAL._value.get(), metrics.SLOT_INVALIDATED._value.get()) == (0, 1)
    assert metrics.WAL_RETAINED._value.get() == 10  # unknown once lost: the last value stays
