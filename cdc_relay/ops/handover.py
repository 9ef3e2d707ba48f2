"""A slot made where a backlog ends: publish the rows of one snapshot, then make the slot at
that snapshot, so that ``stream`` takes every transaction after it (``publish_then_slot``).

Two backlogs: the handover from the poller to ``stream`` (the rows left unprocessed, marked
processed as they go out: no gap and no overlap), and the republish after a slot was lost (the
rows created since a moment, marked nothing: a stream outbox is never marked). The snapshot
and the slot's start are one point, so nothing falls between the two in either case.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import FrameType, TracebackType
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import RowFactory, RowMaker, class_row

from cdc_relay.errors import DeliveryError, PreflightError, RelayError
from cdc_relay.events import OutboxLayout
from cdc_relay.postgres import lineage
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.slot import SlotSpec, exported_snapshot, setup
from cdc_relay.postgres.store import (
    FENCES,
    Outbox,
    OutboxRow,
    check_columns,
    counts,
    first_line,
    handover_fence,
    published_after,
    resolve,
)
from cdc_relay.postgres.tables import untrusted_message, untrusted_owner
from cdc_relay.queries import QUERIES
from cdc_relay.relay.batch import Batch, open_batch
from cdc_relay.relay.worker import PollSettings, out_of_seq_order


@dataclass
class Handover:
    """What the handover or the republish did, in sentences for the user."""

    lines: list[str]


@dataclass
class _Progress:
    """How far a backlog went, for the message that says it was undone."""

    published: int = 0  # published (and, where the backlog marks rows, marked processed)
    copying: bool = False  # making the slot permanent: done or not, every row is published
    out_of_order: int = 0  # published after a later row of their aggregate (a poller's)


_ROWS: RowFactory[OutboxRow] = class_row(OutboxRow)


@dataclass(frozen=True)
class Backlog:
    """The rows published before the slot is made, and what the messages call the job."""

    outbox: Outbox
    query: sql.Composed  # the rows, in seq order, read in the slot's snapshot
    params: dict[str, Any]
    mark: bool  # mark each published row processed (the poller's rows)
    job: str  # "the handover"
    what: str  # the rows, for the last line: "that were unprocessed at {lsn}"
    again: str  # what to do once it was undone: "run it again, or start the pollers again"
    rows: RowFactory[OutboxRow] = _ROWS
    made: str = "setup-slot --from-poller"  # what made the slot, in its lineage

    def done(self, published: int) -> str:
        marked = " and marked processed" if self.mark else ""
        return f"{published} events were published{marked}"


def handover(settings: PollSettings, spec: SlotSpec) -> Handover:
    """Switch from the poller to ``stream`` with no gap and no overlap.

    Publishes the rows still unprocessed in the slot's snapshot and marks them processed
    (``publish_then_slot``). Throughout, the outbox's advisory lock keeps pollers out. What was
    marked was published, so the pollers can take over again after a failure.
    """

    def backlog(guard: psycopg.Connection[dict[str, Any]]) -> Backlog:
        outbox = _check_handover(guard, settings, spec)
        return Backlog(
            outbox,
            outbox.query("unprocessed"),
            {},
            mark=True,
            job="the handover",
            what="that were unprocessed at {lsn}",
            again="run it again, or start the pollers again",
        )

    return publish_then_slot(settings, spec, backlog)


def republish(
    settings: PollSettings, spec: SlotSpec, since: datetime | timedelta, layout: OutboxLayout
) -> Handover:
    """Make ``spec.slot`` anew after it was lost (a promotion without failover slots, an
    invalidation), publishing first every row created at or after ``since`` (a moment, or an
    age by the server's clock) that is committed in its snapshot; nothing is marked.

    A row committed before the snapshot is published here if it is recent enough, one committed
    after it is decoded from the slot: no gap, whatever commits meanwhile. ``since`` must reach
    back to the oldest transaction the lost slot had not confirmed; what it reaches further back
    is sent twice, which consumers deduplicate on the id.
    """

    def backlog(guard: psycopg.Connection[dict[str, Any]]) -> Backlog:
        outbox, moment, headers = _check_republish(guard, settings, spec, since, layout)
        columns = {
            field: sql.Identifier(layout.column(field))
            for field in ("id", "aggregate_type", "aggregate_id", "event_type")
        }
        aliases = [sql.Identifier(f"header_{i}") for i in range(len(headers))]
        values = [
            sql.SQL(", ")
            + sql.SQL(QUERIES["header_value"]).format(column=sql.Identifier(name), alias=alias)
            for name, alias in zip(headers, aliases, strict=True)
        ]
        query = outbox.query(
            "republish",
            payload_column=sql.Identifier(layout.payload),
            header_values=sql.Composed(values),
            headers=sql.Composed([sql.SQL(", t.") + alias for alias in aliases]),
            trace_column=sql.SQL("")
            if layout.trace_column is None
            else sql.SQL(", s.") + sql.Identifier(layout.trace_column),
            **columns,
        )
        return Backlog(
            outbox,
            query,
            {"since": moment},
            mark=False,
            job="the republish",
            what=f"created since {moment.isoformat()} (or without created_at), committed before "
            "{lsn}",
            again="run it again",
            rows=_with_headers(headers),
            made=f"setup-slot --republish-since {moment.isoformat()}",
        )

    return publish_then_slot(settings, spec, backlog)


def _with_headers(names: tuple[str, ...]) -> RowFactory[OutboxRow]:
    """Rows of a query whose last columns are the values of header columns ``names``: each
    becomes a header of its column's name, left out when NULL (as ``stream`` does)."""

    def factory(cursor: psycopg.Cursor[Any]) -> RowMaker[OutboxRow]:
        fields = [column.name for column in cursor.description or ()]
        own = len(fields) - len(names)

        def make(values: Sequence[Any]) -> OutboxRow:
            headers = tuple(
                (name, bytes(value))
                for name, value in zip(names, values[own:], strict=True)
                if value is not None
            )
            return OutboxRow(**dict(zip(fields[:own], values[:own], strict=True)), headers=headers)

        return make

    return factory


def publish_then_slot(
    settings: PollSettings,
    spec: SlotSpec,
    checked: Callable[[psycopg.Connection[dict[str, Any]]], Backlog],
) -> Handover:
    """Create a temporary slot with an exported snapshot, publish the backlog ``checked``
    returns (read in that snapshot; ``checked`` gets the connection that lives as long as
    the job, checks what the job needs and may hold locks on it), wait for every
    acknowledgement, then copy the temporary slot to ``spec.slot``: ``stream`` takes every
    transaction after the snapshot.

    Until the copy nothing can stream the slot, and a failure or a stop at any point before it
    (a refused row, a lost connection, SIGTERM, Ctrl-C, even SIGKILL) leaves no slot:
    PostgreSQL drops a temporary slot with its session. What was published stays published:
    duplicates for consumers at worst when the job is run again.
    """
    progress = _Progress()
    with _Interrupts() as interrupts, connect(settings.dsn) as guard:
        backlog = checked(guard)
        spec = dataclasses.replace(spec, table=backlog.outbox.qualified)
        report = setup(settings.dsn, spec, create_slot=False)
        lines = [f"exists: {line}" for line in report.existing] + report.done
        # Seen before the slot's snapshot, as set-up sees it (lineage.py): the slot is made
        # where the backlog ends, so whatever its name had relayed before leaves no gap.
        usable, _ = lineage.prepare(guard, dry_run=False)
        table = [backlog.outbox.table]
        before = lineage.look(guard, spec.plugin, spec.publication, table) if usable else None
        publisher = open_batch(settings)
        try:
            publisher.sink.check_reachable(settings.kafka_timeout)
            lsn = _switch(settings, spec, backlog, publisher, guard, progress, interrupts)
        except (psycopg.Error, KeyboardInterrupt) as exc:
            raise _undone(exc, spec, backlog, progress, interrupts.received) from None
        except RelayError as exc:
            if progress.copying:  # could not look the slot up
                raise _undone(exc, spec, backlog, progress, None) from None
            raise
        finally:
            publisher.sink.close()
        if before is not None:
            lineage.made(guard, spec.slot, spec.plugin, before, backlog.made, lsn, before.at)
    lines.append(f"created slot {spec.slot} ({spec.plugin}) at {lsn}")
    marked = " and marked them processed" if backlog.mark else ""
    late = (
        f" ({progress.out_of_order} of them out of seq order: a poller had published a later "
        "event of their aggregate, their transaction committing after it)"
        if progress.out_of_order
        else ""
    )
    lines.append(
        f"published {progress.published} events {backlog.what.format(lsn=lsn)}{marked}{late}; "
        f"start cdc-relay stream --slot {spec.slot} for everything after it"
    )
    return Handover(lines)


def _check_handover(
    conn: psycopg.Connection[dict[str, Any]], settings: PollSettings, spec: SlotSpec
) -> Outbox:
    """Take the outbox's lock for the whole handover and check what it needs; the outbox."""
    outbox = resolve(conn, settings.table, trace_column=settings.trace_column)
    if not (conn.execute(QUERIES["handover_lock"], outbox.lock).fetchone() or {}).get("locked"):
        holders = conn.execute(QUERIES["pollers"], outbox.lock).fetchall()
        pids = ", ".join(str(r["pid"]) for r in holders)
        if any(r["handover"] for r in holders):
            raise PreflightError(
                f"another handover is running on {outbox.qualified} (pid {pids}); let it finish"
            )
        if not holders:  # released since
            raise PreflightError(f"the lock of {outbox.qualified} was busy; run the handover again")
        raise PreflightError(
            f"{len(holders)} poller sessions are connected (pid {pids}); stop every "
            "cdc-relay poll (SIGTERM) and run the handover again"
        )
    check_columns(conn, outbox)
    if not (
        conn.execute(QUERIES["handover_fences"], {"schema": outbox.table.schema}).fetchone() or {}
    ).get("present"):
        raise PreflightError(
            f"the handover fences the pollers off {outbox.qualified} in table "
            f"{outbox.table.schema}.{FENCES} of schema poller, which is not there; apply it "
            f"(cdc-relay schema apply poller, in schema {outbox.table.schema}), then run the "
            "handover again"
        )
    fences = f"{outbox.table.schema}.{FENCES}"
    owner = untrusted_owner(conn, sql.Identifier(outbox.table.schema, FENCES).as_string(conn))
    if owner is not None:
        raise PreflightError(
            untrusted_message(fences, owner, "the handover fences the pollers off the table")
        )
    earlier = handover_fence(conn, outbox)
    if earlier is not None:
        raise PreflightError(
            f"{outbox.qualified} was handed over to stream before (slot {earlier['slot']}): "
            "no row since is marked processed, and a handover now would publish them all "
            f"again; stream it with slot {earlier['slot']}, or make a lost slot anew with "
            "setup-slot --republish-since"
        )
    if conn.execute(QUERIES["slot"], {"slot": spec.slot}).fetchone():
        raise PreflightError(
            f"slot {spec.slot} exists already, so it cannot start at the poller's last "
            "row; drop it (cdc-relay drop-slot) or choose another --slot"
        )
    _check_room(conn, "the handover")
    pending = counts(conn, outbox.table)
    if pending.get("dead_letters"):
        raise PreflightError(
            f"{pending['dead_letters']} dead letters are in {outbox.qualified}; retry them "
            "(cdc-relay dead-letters retry, with a poller running) or delete them, then "
            "run the handover again"
        )
    return outbox


def _check_room(conn: psycopg.Connection[dict[str, Any]], job: str) -> None:
    server = conn.execute(QUERIES["server"]).fetchone() or {}
    if server["slots_used"] + 2 > server["max_slots"]:
        raise PreflightError(
            f"{server['slots_used']} of {server['max_slots']} replication slots are in use; "
            f"{job} needs two for a moment (a temporary one while it publishes, then the "
            "slot): raise max_replication_slots in postgresql.conf and restart, or drop an "
            "unused slot"
        )


def _check_republish(
    conn: psycopg.Connection[dict[str, Any]],
    settings: PollSettings,
    spec: SlotSpec,
    since: datetime | timedelta,
    layout: OutboxLayout,
) -> tuple[Outbox, datetime, tuple[str, ...]]:
    """Check what the republish needs; the outbox, the moment ``since`` means, and the header
    columns the table has (one that is not there is left out, as ``stream`` does)."""
    outbox = resolve(conn, settings.table, layout.payload, layout.trace_column)
    if conn.execute(QUERIES["slot"], {"slot": spec.slot}).fetchone():
        raise PreflightError(
            f"slot {spec.slot} exists already, so it cannot start where the republish ends; "
            "if it was lost (invalidated), drop it first (cdc-relay drop-slot), or choose "
            "another --slot"
        )
    columns = [layout.column(field) for field in ("id", "aggregate_type", "aggregate_id")]
    columns += [layout.event_type, layout.payload, "seq", "created_at"]
    found = conn.execute(
        QUERIES["republish_columns"], {"oid": outbox.table.oid, "columns": columns}
    )
    missing = (found.fetchone() or {}).get("missing")
    if missing:
        raise PreflightError(
            f"table {outbox.qualified} has no column {', '.join(missing)}, which "
            "--republish-since reads (seq for the order, created_at for the age; --column "
            "maps the others); add them as cdc-relay schema show outbox does"
        )
    if not outbox.created_at:
        raise PreflightError(
            f"the created_at column of {outbox.qualified} is not a timestamp, so "
            "--republish-since cannot tell which rows are recent; make it timestamptz"
        )
    _check_room(conn, "the republish")
    found = conn.execute(
        QUERIES["republish_columns"],
        {"oid": outbox.table.oid, "columns": list(layout.header_columns)},
    )
    absent = set((found.fetchone() or {}).get("missing") or ())
    headers = tuple(name for name in layout.header_columns if name not in absent)
    at, age = (since, None) if isinstance(since, datetime) else (None, since)
    moment = conn.execute(QUERIES["since"], {"at": at, "age": age}).fetchone() or {}
    if moment["since"] > moment["now"]:
        raise PreflightError(
            f"--republish-since {moment['since'].isoformat()} is in the future (the server's "
            f"clock reads {moment['now'].isoformat()}): it would republish nothing; give a "
            "moment before the oldest event the lost slot may not have relayed"
        )
    return outbox, moment["since"], headers


def _switch(
    settings: PollSettings,
    spec: SlotSpec,
    backlog: Backlog,
    publisher: Batch,
    guard: psycopg.Connection[dict[str, Any]],
    progress: _Progress,
    interrupts: _Interrupts,
) -> str:
    """Publish the backlog as of the slot's start, then make the slot; returns its position."""
    temporary = f"{spec.slot[:40]}_handover_{os.getpid()}"
    with exported_snapshot(settings.dsn, dataclasses.replace(spec, slot=temporary)) as (
        lsn,
        snapshot,
    ):
        with psycopg.connect(settings.dsn, row_factory=class_row(OutboxRow)) as reader:
            reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            reader.read_only = True
            reader.execute(sql.SQL(QUERIES["set_snapshot"]).format(snapshot=sql.Literal(snapshot)))
            with reader.cursor(name="cdc_relay_handover", row_factory=backlog.rows) as rows:
                rows.execute(backlog.query, backlog.params)
                _publish_all(settings, backlog, publisher, rows, guard, progress)
        # Every row is published (and marked): the job is complete once the copy is made, so
        # a signal no longer undoes it.
        interrupts.hold()
        if backlog.mark:  # before the slot exists: it fences pollers while the slot exists
            outbox = backlog.outbox
            guard.execute(
                outbox.query("fence_pollers", fences=outbox.fences),
                {"oid": outbox.table.oid, "table_name": outbox.qualified, "slot": spec.slot},
            )
        progress.copying = True
        try:
            guard.execute(QUERIES["copy_slot"], {"source": temporary, "slot": spec.slot})
        except psycopg.OperationalError:
            # The answer was lost, not necessarily the copy.
            if not _slot_exists(settings.dsn, spec.slot):
                raise
            if backlog.mark:
                with connect(settings.dsn) as again:
                    _handed_over(again, backlog.outbox, lsn)
        else:
            if backlog.mark:
                _handed_over(guard, backlog.outbox, lsn)
    return lsn


def _handed_over(conn: psycopg.Connection[dict[str, Any]], outbox: Outbox, lsn: str) -> None:
    """The handover's slot is made: its fence holds from now on, whatever becomes of the
    slot (before, it fenced the pollers off only while the slot existed)."""
    conn.execute(
        outbox.query("handed_over", fences=outbox.fences), {"oid": outbox.table.oid, "lsn": lsn}
    )


def _slot_exists(dsn: str, slot: str) -> bool:
    with connect(dsn) as conn:
        return conn.execute(QUERIES["slot"], {"slot": slot}).fetchone() is not None


def _publish_all(
    settings: PollSettings,
    backlog: Backlog,
    publisher: Batch,
    rows: psycopg.ServerCursor[OutboxRow],
    marker: psycopg.Connection[dict[str, Any]],
    progress: _Progress,
) -> None:
    """Publish every row of the cursor, batch by batch, each batch acknowledged (and marked
    processed, if the backlog marks) before the next is read."""
    mark = backlog.outbox.query("mark_processed")

    def publish(batch: Sequence[OutboxRow]) -> None:
        # A row a poller published a later row of its aggregate before goes out after it.
        late = published_after(marker, backlog.outbox, [row.id for row in batch])
        publisher.publish(batch)
        acked = [batch[i].id for i in sorted(publisher.delivered)]
        if acked and backlog.mark:
            marker.execute(mark, {"ids": acked})
        progress.published += len(acked)
        for i in sorted(publisher.delivered):
            if batch[i].id in late:
                progress.out_of_order += 1
                out_of_seq_order(batch[i], late[batch[i].id], "handover")

    while batch := rows.fetchmany(settings.batch_size):
        backlog.outbox.check_payload(batch)
        publish(batch)
        if publisher.failures:
            raise _refused(publisher, batch, publish, backlog, progress)


def _refused(
    publisher: Batch,
    batch: Sequence[OutboxRow],
    publish: Callable[[Sequence[OutboxRow]], None],
    backlog: Backlog,
    progress: _Progress,
) -> DeliveryError:
    """The error of a batch Kafka refused rows of, naming the row it refuses. Rows refused
    among others are only suspects (refusals.py): they go again, each alone, so that the
    error names that row, not a neighbour of it. The job stops all the same: rows held behind
    a refused one of their aggregate were not published."""
    refused = dict(publisher.failures)
    suspects = batch
    if not publisher.own:
        suspects = [
            dataclasses.replace(batch[i], attempts=max(1, batch[i].attempts))
            for i in sorted(refused)
        ]
        publish(suspects)
    own = [i for i in publisher.failures if i in publisher.own]
    if own:
        named, error = suspects[own[0]], publisher.failures[own[0]]
    else:  # none refused alone: the broker's answer was about no one row
        first = next(iter(refused))
        named, error = batch[first], f"refused with other events: {refused[first]}"
    return DeliveryError(
        f"Kafka refused event {named.id} ({named.event_type}, aggregate {named.aggregate_id}): "
        f"{error}; {backlog.job} was undone (no slot was created; "
        f"{backlog.done(progress.published)}): fix the cause and {backlog.again}"
    )


def _undone(
    exc: BaseException,
    spec: SlotSpec,
    backlog: Backlog,
    progress: _Progress,
    signal_name: str | None,
) -> RelayError:
    """The one-line error of a job that stopped before its end."""
    if isinstance(exc, KeyboardInterrupt):
        cause = f"it was interrupted ({signal_name or 'SIGINT'})"
    elif isinstance(exc, psycopg.Error):
        cause = f"PostgreSQL failed: {first_line(exc)}"
    else:
        cause = first_line(exc)
    done = backlog.done(progress.published)
    if progress.copying:
        otherwise = "start the pollers again" if backlog.mark else f"{backlog.again}"
        return RelayError(
            f"{backlog.job} stopped while it created slot {spec.slot}: {cause}; {done} (all of "
            f"them); if cdc-relay status shows slot {spec.slot}, start cdc-relay stream, "
            f"otherwise {otherwise}"
        )
    return RelayError(
        f"{backlog.job} stopped before it finished: {cause}; it was undone (no slot was "
        f"created; {done}): {backlog.again}"
    )


class _Interrupts:
    """SIGTERM as Ctrl-C while the handover runs, so that a stop undoes it like a failure
    (KeyboardInterrupt); both are ignored once it is making the slot, which completes it."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._held = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def hold(self) -> None:
        self._held = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._held:
            self.received = signal.Signals(signum).name
            raise KeyboardInterrupt
