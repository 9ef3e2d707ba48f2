"""What every relay (stream, poll) is configured with, whatever its feed: the database, where
and how it publishes (the topic template, the CloudEvents headers), how it stops and reports.

Each relay's settings add their own to these (stream_settings.StreamSettings,
worker.PollSettings); the commands fill them in from the options that cdc_relay.config names
and parses.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from cdc_relay.kafka.cloudevents import CloudEvents
from cdc_relay.kafka.topics import TopicSpec


@dataclass(frozen=True, kw_only=True)
class RelaySettings:
    """What every relay (stream, poll) is configured with: the database, where and how it
    publishes, how it stops and reports. Each relay's settings add their own to these."""

    dsn: str
    kafka_config: dict[str, str]
    topic_template: str
    tombstone_on_empty: bool = False
    cloudevents: CloudEvents | None = None  # the CloudEvents headers, when asked for
    kafka_timeout: float = 15.0  # seconds for a broker to answer at start-up
    topic_creation: TopicSpec | None = None  # --create-topics: how a missing topic is made
    shutdown_timeout: float = 30.0  # seconds to wait for Kafka's acks when stopping
    progress_interval: float = 10.0  # seconds between progress lines

    def shared(self) -> dict[str, Any]:
        """These settings as keywords, for a relay's own settings to start from."""
        return {f.name: getattr(self, f.name) for f in fields(RelaySettings)}
