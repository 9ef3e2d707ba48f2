"""Errors a user can meet: each message says what to do. The CLI prints them without a traceback."""

from __future__ import annotations


class RelayError(Exception):
    """A failure the user can act on; ``str()`` is the one-line remedy."""

    exit_code = 1


class UsageError(RelayError):
    """A bad option or argument."""

    exit_code = 2


class PreflightError(RelayError):
    """The database is not set up for logical replication of the outbox."""


class SlotInUseError(RelayError):
    """Another process is streaming the slot."""


class DeliveryError(RelayError):
    """Kafka refused an event for good; nothing past it was confirmed."""


class KafkaUnavailableError(RelayError):
    """The broker could not be reached."""


class DecodeError(Exception):
    """Plugin output that the decoder cannot read (a bug or a protocol mismatch, not user input)."""
