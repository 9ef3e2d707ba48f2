"""cdc-relay: transactional-outbox events from PostgreSQL to Kafka through logical replication."""

from __future__ import annotations

__version__ = "0.1.0"
