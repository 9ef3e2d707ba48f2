"""The neutral records every decoder yields, and the outbox event they become."""

from __future__ import annotations

from dataclasses import dataclass

from cdc_relay.errors import RelayError
from cdc_relay.lsn import Lsn

# Microseconds between the Unix epoch and PostgreSQL's (2000-01-01 UTC).
PG_EPOCH_OFFSET_US = 946_684_800_000_000


@dataclass(frozen=True, slots=True)
class Begin:
    """A transaction starts; ``final_lsn`` is the LSN of its commit record."""

    final_lsn: Lsn
    commit_time_us: int  # Unix microseconds
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    """A transaction ends; ``end_lsn`` is the position to confirm once its events are acked."""

    commit_lsn: Lsn
    end_lsn: Lsn
    commit_time_us: int


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int


@dataclass(frozen=True, slots=True)
class Relation:
    """A table's layout, sent before its first row and again after a schema change."""

    relid: int
    namespace: str
    name: str
    columns: tuple[Column, ...]

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}"


class _Unchanged:
    """A TOASTed value the plugin did not send because it did not change."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = _Unchanged()

Value = bytes | None | _Unchanged
"""A column value as the plugin sent it: text-format bytes, NULL, or unchanged TOAST."""


@dataclass(frozen=True, slots=True)
class Insert:
    relid: int
    values: tuple[Value, ...]


@dataclass(frozen=True, slots=True)
class Ignored:
    """A message the relay does not act on (update, delete, truncate, origin, type, ...)."""

    kind: str


Record = Begin | Commit | Relation | Insert | Ignored


@dataclass(frozen=True, slots=True)
class OutboxEvent:
    """One committed outbox row, ready for routing."""

    id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: bytes | None
    commit_lsn: Lsn
    xid: int
    commit_time_us: int


class SchemaError(RelayError):
    """The outbox table lacks a column the relay needs."""


REQUIRED_COLUMNS = ("id", "aggregate_type", "aggregate_id", "event_type", "payload")


@dataclass(frozen=True, slots=True)
class RowMapper:
    """Turns an Insert into an OutboxEvent, by the column positions of one Relation."""

    relid: int
    id: int
    aggregate_type: int
    aggregate_id: int
    event_type: int
    payload: int

    @classmethod
    def for_relation(cls, relation: Relation) -> RowMapper:
        positions = {column.name: i for i, column in enumerate(relation.columns)}
        missing = [name for name in REQUIRED_COLUMNS if name not in positions]
        if missing:
            raise SchemaError(
                f"table {relation.qualified_name} has no column {', '.join(missing)}; "
                "restore it (see sql/outbox.sql) and restart the relay"
            )
        return cls(relation.relid, *(positions[name] for name in REQUIRED_COLUMNS))

    def event(self, row: Insert, begin: Begin) -> OutboxEvent:
        values = row.values
        return OutboxEvent(
            id=_text(values[self.id], "id"),
            aggregate_type=_text(values[self.aggregate_type], "aggregate_type"),
            aggregate_id=_text(values[self.aggregate_id], "aggregate_id"),
            event_type=_text(values[self.event_type], "event_type"),
            payload=_payload(values[self.payload]),
            commit_lsn=begin.final_lsn,
            xid=begin.xid,
            commit_time_us=begin.commit_time_us,
        )


def _text(value: Value, column: str) -> str:
    if not isinstance(value, bytes):
        raise SchemaError(f"outbox column {column} is NULL in a new row; make it NOT NULL")
    return value.decode()


def _payload(value: Value) -> bytes | None:
    if isinstance(value, _Unchanged):
        # An INSERT always carries every value; UNCHANGED here means a plugin bug.
        raise SchemaError("the payload of a new outbox row arrived without its value")
    return value
