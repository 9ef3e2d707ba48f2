"""What stream does with a logical decoding message of the outbox prefix without
--messages (cdc_relay/postgres/messages.py), and the comments a resharding cut is checked
against (shards.py)."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import REGISTRY

from cdc_relay.errors import RelayError, UsageError
from cdc_relay.events import LogicalMessage
from cdc_relay.postgres.messages import Messages, unrelayed
from cdc_relay.postgres.shards import Shard, StartAfterCut, shard_named

EVENT_ID = "6f1c9a53-1b7e-4c1e-9a55-7d0c3f0e5b11"


def message(aggregate_id: str | None = "42", content: bytes | None = None) -> LogicalMessage:
    body = json.dumps(
        {
            "v": 2,
            "id": EVENT_ID,
            "aggregate_type": "payments",
            "aggregate_id": aggregate_id,
            "event_type": "refund.approved",
            "payload": {"amt": 1000000},
        }
    ).encode()
    return LogicalMessage(
        True, (1 << 32) | 0x16B3748, "outbox", body if content is None else content
    )


def ignored() -> float:
    return REGISTRY.get_sample_value("cdc_relay_messages_ignored_total") or 0.0


def test_without_messages_a_message_stops_the_relay_in_one_line_naming_it() -> None:
    with pytest.raises(RelayError) as stopped:
        unrelayed(message(), Messages(), None)
    line = str(stopped.value)
    assert "\n" not in line
    assert EVENT_ID in line and "1/16B3748" in line
    assert "start with --messages" in line and "--ignore-messages" in line
    # Not an envelope: still stopped, at its position.
    with pytest.raises(RelayError, match="at 1/16B3748: stream relays"):
        unrelayed(message(content=b"\xff not json"), Messages(), None)


def test_ignore_messages_logs_each_with_its_event_id_and_counts_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = ignored()
    with caplog.at_level(logging.WARNING, logger="cdc_relay.postgres.messages"):
        unrelayed(message(), Messages(ignore=True), None)
    assert ignored() == before + 1
    (record,) = caplog.records
    assert EVENT_ID in record.getMessage() and "1/16B3748" in record.getMessage()
    assert record.__dict__["event_id"] == EVENT_ID
    assert record.__dict__["action"] == "message_ignored"


def test_a_shard_acts_on_its_own_messages_only() -> None:
    owner = next(k for k in range(4) if Shard(k, 4).owns("42"))
    unrelayed(message(), Messages(), Shard((owner + 1) % 4, 4))  # another shard's: nothing
    with pytest.raises(RelayError):
        unrelayed(message(), Messages(), Shard(owner, 4))
    with pytest.raises(RelayError):  # whose, it cannot tell: every shard stops
        unrelayed(message(content=b"[]"), Messages(), Shard((owner + 1) % 4, 4))


def test_messages_and_ignore_messages_exclude_each_other() -> None:
    with pytest.raises(UsageError, match="give one of them"):
        Messages(relay=True, ignore=True)


def test_a_publication_comment_names_its_shard_and_cut() -> None:
    shard = Shard(2, 3)
    written = StartAfterCut("5b0c", (3 << 32) | 0xA0)
    assert StartAfterCut.of_comment(written.comment(shard)) == (shard, written)
    pending = StartAfterCut("5b0c", None)
    assert StartAfterCut.of_comment(pending.comment(shard)) == (shard, pending)
    assert StartAfterCut.from_comment(written.comment(shard), Shard(1, 3)) is None
    assert StartAfterCut.of_comment("cdc-relay: shard 3/3 starts after cut 5b0c") is None
    assert StartAfterCut.of_comment(None) is None


def test_a_shards_slot_name_is_read_back_exactly() -> None:
    assert shard_named("cdc_relay_1of4", "cdc_relay") == Shard(1, 4)
    assert shard_named("cdc_relay_0of1", "cdc_relay") == Shard(0, 1)
    for other in ("cdc_relay", "cdc_relay_01of4", "cdc_relay_4of4", "cdc_relayx_1of4", "x_1of4"):
        assert shard_named(other, "cdc_relay") is None, other
    assert shard_named("a.b_0of2", "a.b") == Shard(0, 2)  # the base is no pattern
    assert shard_named("axb_0of2", "a.b") is None
