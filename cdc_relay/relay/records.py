"""The slot's records as the stream relay reads them (StreamRelay.pump decodes each message
of the stream into records, pgoutput's or wal2json's): which relations are outbox tables and
each one's row mapper, the WAL's transactions and logical messages as the LSN tracker's
transactions (and exactly once's units), and each outbox event handed to the pipeline, or
skipped while the stream is quiet: before a new shard's resharding cut (cut.py), or replaying
what Kafka has already under exactly once. The plugin's start options and its decoder, fresh
with each connection, are here too.

Single-threaded, as the relay is: the tracker needs no locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cdc_relay.errors import RelayError
from cdc_relay.events import (
    BYTEA_OID,
    Begin,
    Commit,
    Insert,
    LogicalMessage,
    OutboxEvent,
    Record,
    Relation,
    RowMapper,
    envelope_event,
)
from cdc_relay.kafka.checkpoints import MESSAGE, TRANSACTION, Unit
from cdc_relay.kafka.exactly_once import Committer
from cdc_relay.postgres import pgoutput, wal2json
from cdc_relay.postgres.messages import unrelayed
from cdc_relay.postgres.shards import CUT_PREFIX
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.postgres.wal2json import Wal2JsonDecoder
from cdc_relay.relay.cut import ShardCut
from cdc_relay.relay.lsn_tracker import LsnTracker, Transaction
from cdc_relay.relay.rewinds import Rewinds, Token
from cdc_relay.relay.stream_settings import StreamSettings

# The stream relay's lines, under one logger whichever of its parts writes them.
log = logging.getLogger("cdc_relay.relay.stream")


@dataclass
class Progress:
    """What the relay relayed so far, for its progress lines (and readiness: moving)."""

    events: int = 0
    transactions: int = 0
    acknowledged: int = 0  # events Kafka acknowledged, as of the last tick
    started: float = field(default_factory=time.monotonic)


def _pgoutput(data: bytes) -> Sequence[Record]:
    return (pgoutput.decode(data),)


def _tables(tables: Sequence[OutboxTable]) -> str:
    """``table a`` or ``tables a, b``, for messages."""
    names = ", ".join(table.qualified for table in tables)
    return f"table{'s' if len(tables) > 1 else ''} {names}"


class Records:
    """Handles the stream's records in their order; ``publish`` is the pipeline's.

    ``tables`` are the outbox tables by identity, as named at start (the topics' {schema} and
    {table}), ``plugin`` the slot's; ``quiet``: events may be skipped (waiting for a cut, or
    replaying), else none is looked at for it. Events and transactions are counted in
    ``progress``, the ids of the events sent go to ``unacknowledged`` (the relay takes them out
    as Kafka acknowledges them).
    """

    def __init__(
        self,
        settings: StreamSettings,
        tracker: LsnTracker,
        cut: ShardCut,
        eos: Committer | None,
        rewinds: Rewinds,
        publish: Callable[[OutboxEvent, Token, bool], None],
        progress: Progress,
        unacknowledged: set[str],
    ) -> None:
        self._settings = settings
        self._tracker = tracker
        self._cut = cut
        self._eos = eos
        self._rewinds = rewinds
        self._publish = publish
        self._unacknowledged = unacknowledged
        self.progress = progress
        self.plugin = "pgoutput"
        self.decode: Callable[[bytes], Sequence[Record]] = _pgoutput
        self.tables: tuple[OutboxTable, ...] = ()
        self._relations: dict[int, str] = {}  # relid -> name, for messages about other tables
        self.bytea_types: frozenset[int] = frozenset({BYTEA_OID})  # and its domains
        self._mappers: dict[int, RowMapper | None] = {}
        self._begin: Begin | None = None
        self._transaction: Transaction | None = None
        self.quiet = False  # events may be skipped: waiting for a cut, or replaying

    def start_options(self) -> dict[str, str]:
        """The plugin's options for a new connection, whose decoder starts afresh."""
        if self.plugin == "wal2json":
            self.decode = Wal2JsonDecoder(self.bytea_types).decode
            return {
                **wal2json.START_OPTIONS,
                "add-tables": ",".join(
                    wal2json.table_filter(table.schema, table.name) for table in self.tables
                ),
                "add-msg-prefixes": self._settings.message_prefix,
            }
        self.decode = _pgoutput
        return {
            "proto_version": "1",
            "publication_names": pgoutput.publication_names(self._settings.publication),
            "messages": "true",
        }

    def restart(self) -> None:
        """Forget open transactions: the stream starts again from the confirmed position,
        decoded from scratch (invariant 7; the relay resets the tracker)."""
        self._mappers.clear()
        self._begin = None
        self._transaction = None
        if self._eos is not None:  # what the committed transactions hold is skipped
            self._eos.restart()
            self.quiet = True
        if self._cut.restart():  # the replay starts before the cut again
            self.quiet = True

    def handle(self, record: Record) -> None:
        if isinstance(record, Insert):
            if record.relid not in self._mappers or self._begin is None:
                raise RelayError(
                    f"insert into relation {record.relid} arrived before its Relation or Begin "
                    "message; this is a bug, please report it"
                )
            mapper = self._mappers[record.relid]
            if mapper is None:
                self._other_table(record.relid)
                return
            if self._transaction is None or (self.quiet and self._skip()):
                return
            self._send(mapper.event(record, self._begin), self._transaction)
        elif isinstance(record, Begin):
            self._begin = record
            self._transaction = self._tracker.begin(record.commit_time_us)
            if self._eos is not None:
                self._unit_begins(self._eos, Unit(record.final_lsn, TRANSACTION))
        elif isinstance(record, Commit):
            if self._transaction is not None:
                self._tracker.commit(self._transaction, record.end_lsn)
                self.progress.transactions += 1
                if self._transaction is self._cut.transaction:
                    self._cut.transaction = None  # past the cut for good: confirm again
                if self._eos is not None:
                    self._eos.unit_ends()
            self._begin = None
            self._transaction = None
        elif isinstance(record, Relation):
            self._relation(record)
        elif isinstance(record, LogicalMessage):
            self._message(record)

    def _relation(self, record: Relation) -> None:
        """Whether the rows of ``record`` are outbox events, and of which outbox table: a
        table is known by its OID (pgoutput), which follows renames and schema moves, or by
        its name (wal2json, and rows written before the table was dropped and made again).
        The OID decides first: two outbox tables that swapped names stay apart."""
        name = (record.namespace, record.name)
        table = next(
            (t for t in self.tables if self.plugin == "pgoutput" and record.relid == t.oid),
            None,
        ) or next((t for t in self.tables if (t.schema, t.name) == name), None)
        self._relations[record.relid] = record.qualified_name
        self._mappers[record.relid] = (
            None
            if table is None
            else RowMapper.for_relation(
                record, self._settings.layout, self.bytea_types, (table.schema, table.name)
            )
        )
        if table is not None and (table.schema, table.name) != name:
            log.info(
                "rows of the outbox table %s arrive as %s (renamed); following it by identity",
                table.qualified,
                record.qualified_name,
                extra={"action": "table_renamed", "table": record.qualified_name},
            )

    def _other_table(self, relid: int) -> None:
        name = self._relations.get(relid, str(relid))
        if not self._settings.ignore_other_tables:
            raise RelayError(
                f"a row of table {name} arrived: publication {self._settings.publication} "
                f"publishes it beside the outbox {_tables(self.tables)}, and cdc-relay "
                f"relays the outbox only. If it is an outbox too, restart with --table {name} "
                "added (nothing from its first row on was confirmed); if not, remove it (ALTER "
                f"PUBLICATION {self._settings.publication} DROP TABLE {name}) and restart with "
                "--ignore-other-tables to pass its rows already written, or give it its own "
                "publication"
            )
        log.warning(
            "skipped a row of table %s, which is not the outbox table",
            name,
            extra={"action": "other_table", "table": name},
        )

    def _message(self, record: LogicalMessage) -> None:
        """A logical decoding message with our prefix is an event, routed like a row; a shard
        keeps its own (publications do not filter messages). A cut message ends an old
        shard's stream and starts a new one's."""
        if record.prefix != self._settings.message_prefix:
            if record.prefix == CUT_PREFIX and self._cut.met(
                record, self._begin, self._transaction, self.tables
            ):
                self.quiet = self._eos is not None and self._eos.replaying
            return  # another application's message
        if not self._settings.messages.relay:  # no event without --messages (messages.py)
            if not self._cut.waiting:  # before a new shard's cut, the old shards' to act on
                unrelayed(record, self._settings.messages, self._settings.shard)
            return
        shard = self._settings.shard
        if record.transactional:
            if self._transaction is None or self._begin is None:
                raise RelayError("transactional message outside a transaction; please report it")
            event = envelope_event(record, self._begin)
            if shard is not None and not shard.owns(event.aggregate_id):
                return
            if self.quiet and self._skip():
                return
            self._send(event, self._transaction)
        else:
            # Sent at once, even if its transaction rolls back: its own unit in the tracker.
            event = envelope_event(record, None)
            if shard is not None and not shard.owns(event.aggregate_id):
                return
            if self._eos is not None:
                # Its own unit, at its LSN, before a transaction committing there (Unit).
                self._unit_begins(self._eos, Unit(record.lsn, MESSAGE))
            if self.quiet and self._skip():
                if self._eos is not None:
                    self._eos.unit_ends()
                return
            transaction = self._tracker.begin(time.time_ns() // 1000)
            self._send(event, transaction)
            self._tracker.commit(transaction, record.lsn)
            if self._eos is not None:
                self._eos.unit_ends()

    def _skip(self) -> bool:
        """Whether to skip an event: before a resharding cut, or in Kafka already (a replay in
        exactly-once mode)."""
        if self._cut.waiting:
            return True
        return self._eos is not None and self._eos.skip()

    def _unit_begins(self, eos: Committer, unit: Unit) -> None:
        """Exactly once: a unit of the stream starts; the replay may be over."""
        eos.unit_begins(unit)
        if not eos.replaying:
            self.quiet = self._cut.waiting

    def _send(self, event: OutboxEvent, transaction: Transaction) -> None:
        self._tracker.sent(transaction)
        self._unacknowledged.add(event.id)
        suspects = self._rewinds.suspects
        self._publish(event, (transaction, event.id), bool(suspects) and event.id in suspects)
        if self._eos is not None:
            # Counted once produced (a checkpoint taken while it waited must not count it).
            self._eos.produced()
        self.progress.events += 1
