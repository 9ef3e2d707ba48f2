"""What a stream relay is configured with (stream.StreamRelay): its slot and publication, the
outbox tables, and the options that shape its feed (a shard, exactly once, dead letters, a
standby, logical messages). One frozen object, read by the relay and each of its parts."""

from __future__ import annotations

from dataclasses import dataclass, field

from cdc_relay.events import OutboxLayout
from cdc_relay.kafka.exactly_once import ExactlyOnce
from cdc_relay.postgres.messages import Messages
from cdc_relay.postgres.shards import Shard
from cdc_relay.relay.settings import RelaySettings


@dataclass(frozen=True, kw_only=True)
class StreamSettings(RelaySettings):
    slot: str
    publication: str
    # The outbox tables, one or more, all in the slot's publication (or wal2json's add-tables).
    tables: tuple[str, ...]
    status_interval: float = 10.0
    layout: OutboxLayout = field(default_factory=OutboxLayout)
    message_prefix: str = "outbox"
    dead_letter_topic: str | None = None
    standby: bool = False  # wait while another relay holds the slot, then take over
    # Skip rows of other tables in the publication (logged) instead of stopping at the first.
    ignore_other_tables: bool = False
    shard: Shard | None = None  # slot and publication are then the shard's (shards.py)
    exactly_once: ExactlyOnce | None = None  # Kafka transactions with a checkpoint
    messages: Messages = field(default_factory=Messages)  # --messages and its writers
