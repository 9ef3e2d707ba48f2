"""Handing over from the poller to ``stream`` with no gap and no overlap: publish what the
poller left in one snapshot, then make the slot at that snapshot (see ``handover``)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import class_row

from cdc_relay.errors import DeliveryError, PreflightError, RelayError
from cdc_relay.poller import (
    Outbox,
    OutboxRow,
    PollSettings,
    check_columns,
    first_line,
    resolve,
)
from cdc_relay.publisher import Publisher
from cdc_relay.queries import QUERIES
from cdc_relay.slot import SlotSpec, connect, exported_snapshot, setup


@dataclass
class Handover:
    """What the handover did, in sentences for the user."""

    lines: list[str]


@dataclass
class _Progress:
    """How far a handover went, for the message that says it was undone."""

    published: int = 0  # published and marked processed
    copying: bool = False  # making the slot permanent: done or not, all rows are marked


def handover(settings: PollSettings, spec: SlotSpec) -> Handover:
    """Switch from the poller to ``stream`` with no gap and no overlap.

    Creates a temporary slot with an exported snapshot, publishes the rows still unprocessed in
    that snapshot and marks them processed, then copies the temporary slot to ``spec.slot``:
    ``stream`` takes every transaction after the snapshot. Throughout, the outbox's advisory
    lock keeps pollers out. Until the copy nothing can stream the slot, and a failure or a stop
    at any point before it (a refused row, a lost connection, SIGTERM, Ctrl-C, even SIGKILL)
    leaves no slot: PostgreSQL drops a temporary slot with its session. What was marked was
    published, so the pollers can take over again.
    """
    progress = _Progress()
    with _Interrupts() as interrupts, connect(settings.dsn) as guard:
        outbox = _check_handover(guard, settings, spec)
        spec = dataclasses.replace(spec, table=outbox.qualified)
        report = setup(settings.dsn, spec, create_slot=False)
        lines = [f"exists: {line}" for line in report.existing] + report.done
        publisher = Publisher(settings)
        try:
            publisher.sink.check_reachable(settings.kafka_timeout)
            lsn = _switch(settings, spec, outbox, publisher, guard, progress, interrupts)
        except (psycopg.Error, KeyboardInterrupt) as exc:
            raise _undone(exc, spec, progress, interrupts.received) from None
        except RelayError as exc:
            if progress.copying:  # could not look the slot up
                raise _undone(exc, spec, progress, None) from None
            raise
        finally:
            publisher.sink.close()
    lines.append(f"created slot {spec.slot} ({spec.plugin}) at {lsn}")
    lines.append(
        f"published {progress.published} events that were unprocessed at {lsn} and marked "
        f"them processed; start cdc-relay stream --slot {spec.slot} for everything after it"
    )
    return Handover(lines)


def _check_handover(
    conn: psycopg.Connection[dict[str, Any]], settings: PollSettings, spec: SlotSpec
) -> Outbox:
    """Take the outbox's lock for the whole handover and check what it needs; the outbox."""
    outbox = resolve(conn, settings.table)
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
    if conn.execute(QUERIES["slot"], {"slot": spec.slot}).fetchone():
        raise PreflightError(
            f"slot {spec.slot} exists already, so it cannot start at the poller's last "
            "row; drop it (cdc-relay drop-slot) or choose another --slot"
        )
    server = conn.execute(QUERIES["server"]).fetchone() or {}
    if server["slots_used"] + 2 > server["max_slots"]:
        raise PreflightError(
            f"{server['slots_used']} of {server['max_slots']} replication slots are in use; the "
            "handover needs two for a moment (a temporary one while it publishes, then the "
            "slot): raise max_replication_slots in postgresql.conf and restart, or drop an "
            "unused slot"
        )
    counts = conn.execute(outbox.query("pending_counts")).fetchone() or {}
    if counts.get("dead_letters"):
        raise PreflightError(
            f"{counts['dead_letters']} dead letters are in {outbox.qualified}; retry them "
            "(cdc-relay dead-letters retry, with a poller running) or delete them, then "
            "run the handover again"
        )
    return outbox


def _switch(
    settings: PollSettings,
    spec: SlotSpec,
    outbox: Outbox,
    publisher: Publisher,
    marker: psycopg.Connection[dict[str, Any]],
    progress: _Progress,
    interrupts: _Interrupts,
) -> str:
    """Publish and mark the rows unprocessed as of the slot's start, then make the slot;
    returns its position."""
    temporary = f"{spec.slot[:40]}_handover_{os.getpid()}"
    with exported_snapshot(settings.dsn, dataclasses.replace(spec, slot=temporary)) as (
        lsn,
        snapshot,
    ):
        with psycopg.connect(settings.dsn, row_factory=class_row(OutboxRow)) as reader:
            reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            reader.read_only = True
            reader.execute(sql.SQL(QUERIES["set_snapshot"]).format(snapshot=sql.Literal(snapshot)))
            with reader.cursor(name="cdc_relay_handover") as rows:
                rows.execute(outbox.query("unprocessed"))
                _publish_all(settings, outbox, publisher, rows, marker, progress)
        # Every row is published and marked: the switch is complete once the copy is made, so
        # a signal no longer undoes it.
        interrupts.hold()
        progress.copying = True
        try:
            marker.execute(QUERIES["copy_slot"], {"source": temporary, "slot": spec.slot})
        except psycopg.OperationalError:
            # The answer was lost, not necessarily the copy.
            if not _slot_exists(settings.dsn, spec.slot):
                raise
    return lsn


def _slot_exists(dsn: str, slot: str) -> bool:
    with connect(dsn) as conn:
        return conn.execute(QUERIES["slot"], {"slot": slot}).fetchone() is not None


def _publish_all(
    settings: PollSettings,
    outbox: Outbox,
    publisher: Publisher,
    rows: psycopg.ServerCursor[OutboxRow],
    marker: psycopg.Connection[dict[str, Any]],
    progress: _Progress,
) -> None:
    """Publish every row of the cursor, batch by batch, marking each batch processed."""
    mark = outbox.query("mark_processed")
    while batch := rows.fetchmany(settings.batch_size):
        outbox.check_payload(batch)
        publisher.publish(batch, lambda: False)
        acked = [batch[i].id for i in sorted(publisher.acked)]
        if acked:
            marker.execute(mark, {"ids": acked})
            progress.published += len(acked)
        if publisher.refused:
            index, error = next(iter(publisher.refused.items()))
            raise DeliveryError(
                f"Kafka refused event {batch[index].id} ({batch[index].event_type}, "
                f"aggregate {batch[index].aggregate_id}): {error}; the handover was undone "
                f"(no slot was created; {progress.published} events were published and "
                "marked processed): fix the cause and run it again, or start the pollers again"
            )


def _undone(
    exc: BaseException, spec: SlotSpec, progress: _Progress, signal_name: str | None
) -> RelayError:
    """The one-line error of a handover that stopped before its end."""
    if isinstance(exc, KeyboardInterrupt):
        cause = f"it was interrupted ({signal_name or 'SIGINT'})"
    elif isinstance(exc, psycopg.Error):
        cause = f"PostgreSQL failed: {first_line(exc)}"
    else:
        cause = first_line(exc)
    done = f"{progress.published} events were published and marked processed"
    if progress.copying:
        return RelayError(
            f"the handover stopped while it created slot {spec.slot}: {cause}; {done} (all of "
            f"them); if cdc-relay status shows slot {spec.slot}, start cdc-relay stream, "
            "otherwise start the pollers again"
        )
    return RelayError(
        f"the handover stopped before it finished: {cause}; it was undone (no slot was "
        f"created; {done}): run it again, or start the pollers again"
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
