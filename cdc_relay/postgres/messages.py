"""Logical decoding messages, and who may write them (ARCHITECTURE.md, invariant 12).

Any role that may run ``pg_logical_emit_message`` writes messages into the WAL every slot
decodes, and PUBLIC may run it in every database until a superuser revokes it. A row needs
INSERT on the outbox; a message needs nothing more than that function. So:

- ``stream`` relays a message of the outbox prefix as an event only with ``--messages``, and
  with it refuses to start while any role but the writers (``--message-writer``; superusers
  aside) may run the function, saying what to revoke and grant; ``setup-slot --messages``
  checks the same, and ``status --messages`` alerts when it is open again;
- without ``--messages`` such a message stops the relay before it, nothing from it on
  confirmed, or with ``--ignore-messages`` is passed over, logged with its event id and
  counted (``cdc_relay_messages_ignored_total``);
- a resharding cut (shards.py) is honoured only when a publication of the outbox names that
  cut, at that position, in its comment: only the publication's owner can write the comment,
  and ``reshard`` writes it in the cut's own transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from psycopg.rows import dict_row

from cdc_relay.errors import PreflightError, RelayError, UsageError
from cdc_relay.events import LogicalMessage, SchemaError, envelope_event
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.metrics import MESSAGES_IGNORED
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.postgres.shards import Cut, Shard, StartAfterCut
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.queries import QUERIES

log = logging.getLogger(__name__)

FUNCTION = "pg_logical_emit_message"
DEFAULT_WRITER = "cdc_relay_writer"
"""The writer role of schema roles (cdc-relay schema show roles), which the application's
roles join."""


@dataclass(frozen=True)
class Messages:
    """What ``stream`` does with a logical decoding message of the outbox prefix: relays it
    as an event (``relay``, --messages) once only ``writers`` (and superusers) may emit one;
    otherwise stops before it, or passes it over with a warning (``ignore``)."""

    relay: bool = False
    ignore: bool = False
    writers: tuple[str, ...] = (DEFAULT_WRITER,)

    def __post_init__(self) -> None:
        if self.relay and self.ignore:
            raise UsageError(
                "--messages relays logical decoding messages and --ignore-messages passes them "
                "over: give one of them"
            )


@dataclass(frozen=True)
class EmitGrants:
    """Who may run pg_logical_emit_message besides superusers and ``writers`` (the query
    emit_message_privileges): the statements that leave it to the writers alone."""

    writers: tuple[str, ...]
    functions: str  # every overload, as GRANT and REVOKE name them
    public: bool  # PUBLIC may
    others: list[str]  # the roles that may and are no writer
    revoke: list[str]  # whom to revoke it from (quoted): PUBLIC and the grantees not writers
    grant: list[str]  # the writers to grant it to (quoted), who would not keep it otherwise
    found: bool  # a role of ``writers`` exists

    @classmethod
    def read(cls, conn: psycopg.Connection[dict[str, Any]], writers: Sequence[str]) -> EmitGrants:
        rows = conn.execute(
            QUERIES["emit_message_privileges"], {"writers": list(writers)}
        ).fetchall()
        return cls(
            writers=tuple(writers),
            functions=", ".join(str(row["signature"]) for row in rows),
            public=any(row["public"] for row in rows),
            others=sorted({name for row in rows for name in row["others"]}),
            revoke=(["PUBLIC"] if any(row["public"] for row in rows) else [])
            + sorted({name for row in rows for name in row["grantees"]}),
            grant=sorted({name for row in rows for name in row["ungranted"]}),
            found=any(row["writers"] for row in rows),
        )

    @property
    def open(self) -> bool:
        """Whether a role besides the writers and superusers may emit a message."""
        return self.public or bool(self.others)

    def statements(self) -> list[str]:
        """What a superuser runs, in this database, so that only the writers may emit."""
        if not self.revoke:
            return []
        revoke = f"REVOKE EXECUTE ON FUNCTION {self.functions} FROM {', '.join(self.revoke)}"
        if not self.grant:
            return [revoke]
        return [revoke, f"GRANT EXECUTE ON FUNCTION {self.functions} TO {', '.join(self.grant)}"]

    def problem(self) -> str | None:
        """Why roles besides the writers could publish events as messages, with the
        statements to run; None when none can."""
        if not self.open:
            return None
        named = ", ".join(self.writers) or "(none)"
        if self.public:
            missing = (
                ""
                if self.found or not self.writers
                else ", which does not exist here: create it"
                if len(self.writers) == 1
                else ", none of which exists here: create one"
            )
            who = (
                f"PUBLIC may run {FUNCTION}, so with --messages any role that can connect "
                f"could publish events, not only the writers (members of --message-writer "
                f"{named}{missing}; cdc-relay schema show roles closes it to them)"
            )
        else:
            several = len(self.others) > 1
            who = (
                f"role{'s' if several else ''} {_some(self.others)} may run {FUNCTION} and "
                f"{'are' if several else 'is'} no member of --message-writer {named}, so with "
                f"--messages {'they' if several else 'it'} could publish events (name "
                f"{'them' if several else 'it'} there if a writer)"
            )
        statements = self.statements()
        if not statements:  # through a superuser role it belongs to, whose grants it has
            return f"{who}: through membership of a superuser role; revoke that membership"
        return f"{who}; as a superuser, in this database, run: {'; '.join(statements)}"


def _some(names: Sequence[str], shown: int = 5) -> str:
    """The first ``shown`` of ``names``, and how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def check_writers(conn: psycopg.Connection[dict[str, Any]], messages: Messages) -> None:
    """With --messages: refuse (PreflightError) while others than the writers may emit."""
    if messages.relay and (problem := EmitGrants.read(conn, messages.writers).problem()):
        raise PreflightError(problem)


def writers_problem(dsn: str, writers: Sequence[str]) -> str | None:
    """Why others than ``writers`` may emit messages in the database of ``dsn`` (setup-slot
    --messages, status --messages); None when they may not."""
    with connect(dsn) as conn:
        return EmitGrants.read(conn, writers).problem()


def unrelayed(record: LogicalMessage, messages: Messages, shard: Shard | None) -> None:
    """A message of the outbox prefix that ``stream`` does not relay (no --messages): stop
    before it (RelayError; nothing from it on is confirmed), or with --ignore-messages log it
    and count it. A shard acts on its own messages only, when it can tell."""
    try:
        event = envelope_event(record, None)
    except SchemaError:
        event = None  # not an envelope: whose it is cannot be told
    if event is not None and shard is not None and not shard.owns(event.aggregate_id):
        return
    what = (
        f"a logical decoding message with the outbox prefix {record.prefix!r}"
        + (f" (event {event.id})" if event is not None else "")
        + f" at {format_lsn(record.lsn)}"
    )
    if not messages.ignore:
        raise RelayError(
            f"{what}: stream relays such messages as events only with --messages. If your "
            "application writes events so, start with --messages (it checks first that only "
            "the writers may emit them); if not, --ignore-messages passes them over, each "
            "logged. Nothing from it on was confirmed"
        )
    MESSAGES_IGNORED.inc()
    log.warning(
        "ignored %s: without --messages it is no event (--ignore-messages)",
        what,
        extra={
            "action": "message_ignored",
            "lsn": format_lsn(record.lsn),
            **({"event_id": event.id} if event is not None else {}),
        },
    )


class SlotRelay(Protocol):
    """What ``genuine_cut`` reads of a relay's settings (stream_settings.StreamSettings)."""

    @property
    def dsn(self) -> str: ...

    @property
    def slot(self) -> str: ...


def genuine_cut(
    relay: SlotRelay,
    cut: Cut,
    lsn: Lsn,
    tables: Sequence[OutboxTable],
    awaited: StartAfterCut | None,
) -> bool:
    """Whether the relay of ``relay.slot`` may act on resharding cut ``cut``, whose message is
    at ``lsn``: True when the cut is none of its business (it names neither the slot nor the
    cut ``awaited``), or when a publication of ``tables`` names this cut at ``lsn`` in its comment
    (reshard's, written in the cut's own transaction: committed, since a transactional message
    is decoded at its commit). Otherwise it is forged (any role that may run
    pg_logical_emit_message can write one): logged, and False."""
    if relay.slot not in cut.slots and (awaited is None or awaited.cut != cut.cut):
        return True
    try:
        with psycopg.connect(relay.dsn, autocommit=True, row_factory=dict_row) as conn:
            rows = conn.execute(
                QUERIES["cut_comments"], {"oids": [table.oid for table in tables]}
            ).fetchall()
    except psycopg.OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        raise ConnectionLost(
            f"cannot read the publications to check resharding cut {cut.cut}: {first}"
        ) from None
    for row in rows:
        found = StartAfterCut.of_comment(row["comment"])
        if found is not None and found[1].cut == cut.cut and found[1].lsn == lsn:
            return True
    log.warning(
        "ignored a resharding cut message at %s naming cut %s and slots %s: no publication of "
        "the outbox names that cut at that position, so reshard did not write it (any role "
        "that may run %s can write such a message: see cdc-relay schema show roles)",
        format_lsn(lsn),
        cut.cut,
        ", ".join(cut.slots),
        FUNCTION,
        extra={"action": "cut_forged", "lsn": format_lsn(lsn), "slot": relay.slot},
    )
    return False
