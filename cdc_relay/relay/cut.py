"""A shard's resharding cut as its stream meets it (reshard writes the cut;
cdc_relay.postgres.shards says what it is).

A new shard whose slot has not passed its cut waits for it: what comes before the cut is the
old shards', skipped and never confirmed. At the cut it waits until the old shards have
delivered everything before it, then relays from there. An old shard stops at a cut naming its
slot, having delivered and confirmed everything before it. ``ShardCut`` holds where the stream
stands to the cut, and decides at the cut's message; what the relay confirms meanwhile is
StreamRelay._send_status's, what it skips records.Records'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from cdc_relay.events import Begin, LogicalMessage
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.messages import genuine_cut
from cdc_relay.postgres.shards import Cut, Shard, StartAfterCut
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.queries import QUERIES
from cdc_relay.relay.lsn_tracker import Transaction
from cdc_relay.relay.pipeline import Pipeline, Stopping
from cdc_relay.relay.stream_settings import StreamSettings

# The stream relay's lines, under one logger whichever of its parts writes them.
log = logging.getLogger("cdc_relay.relay.stream")

# How the relay has a new shard decide from its slot's position, on a connection, at start and
# once the slot is held (StreamRelay._start_after_cut, with ``ShardCut.start_after``).
AfterCut = Callable[[psycopg.Connection[dict[str, Any]], Shard, str], None]


class ShardCut:
    """Where a shard's stream stands to a resharding cut; a relay of a whole slot, or an old
    shard before its cut, is not ``waiting``.

    ``commit`` commits what exactly once produced (nothing otherwise), ``stop`` asks the relay
    to stop: both for an old shard at its cut.
    """

    def __init__(
        self,
        settings: StreamSettings,
        pipeline: Pipeline,
        *,
        commit: Callable[[], None],
        stop: Callable[[], None],
    ) -> None:
        self._settings = settings
        self._pipeline = pipeline
        self._commit = commit
        self._stop = stop
        # A new shard after a resharding cut: what comes before the cut is the old shards',
        # skipped and never confirmed (shards.py); None for any other relay.
        self.after: StartAfterCut | None = None
        self.waiting = False  # still before the cut
        self.transaction: Transaction | None = None  # the cut's, passed but not committed
        self.at: Lsn | None = None  # an old shard's cut, reached: confirmed on stopping

    def start_after(
        self, conn: psycopg.Connection[dict[str, Any]], shard: Shard, confirmed: str
    ) -> bool:
        """A new shard whose slot has not passed its resharding cut waits for it; True when
        the publication names a cut for ``shard`` (its slot confirmed up to ``confirmed``)."""
        row = conn.execute(
            QUERIES["publication_comment"], {"publication": self._settings.publication}
        ).fetchone()
        after = StartAfterCut.from_comment((row or {}).get("comment"), shard)
        if after is None:
            return False
        waited = self.waiting
        self.after = after
        self.waiting = after.lsn is None or parse_lsn(confirmed) < after.lsn
        if self.waiting and not waited:
            log.info(
                "shard %s starts after resharding cut %s: skipping what comes before it, which "
                "the old shards deliver",
                shard,
                after.cut,
                extra={"action": "cut_waiting", "slot": self._settings.slot},
            )
        return True

    def rebase(self, confirmed: Lsn) -> bool:
        """The stream starts again from ``confirmed``, the slot's position on a new timeline:
        True when that is before the cut of a new shard that had passed it, which waits for
        the cut again (as on a restart, ``start_after``): what precedes it is the old shards'
        again."""
        after = self.after
        if after is not None and not self.waiting and (after.lsn is None or confirmed < after.lsn):
            self.waiting = True
            self.transaction = None
            return True
        return False

    def restart(self) -> bool:
        """The stream starts again from the confirmed position: True when that is before the
        cut passed, whose transaction was not committed yet (the replay meets the cut again)."""
        if self.transaction is None:
            return False
        self.transaction = None
        self.waiting = True
        return True

    def met(
        self,
        record: LogicalMessage,
        begin: Begin | None,
        transaction: Transaction | None,
        tables: Sequence[OutboxTable],
    ) -> bool:
        """A resharding cut's message: a new shard waiting for it starts after it (True: it
        passed the cut, in ``transaction``); an old shard stops at it, having delivered and
        confirmed everything before it (raises Stopping)."""
        cut = Cut.from_content(record.content)
        if cut is None:
            return False
        if not record.transactional or begin is None:
            log.warning(
                "ignored a resharding cut at %s that is not in a transaction: reshard writes "
                "its cut in one",
                format_lsn(record.lsn),
                extra={"action": "cut_ignored", "lsn": format_lsn(record.lsn)},
            )
            return False
        # The cut's place among the transactions is its transaction's commit: one committed
        # between the message and that commit is before the cut. Every transaction before
        # the cut ends at or before the commit record's start, so an old slot confirmed that
        # far has delivered all of them.
        commit = begin.final_lsn
        if not genuine_cut(self._settings, cut, record.lsn, tables, self.after):
            return False
        slot = self._settings.slot
        if self.waiting and self.after is not None and cut.cut == self.after.cut:
            # Nothing after the cut goes out before the old shards have delivered everything
            # before it: an aggregate's events must not overtake its earlier ones.
            self._wait_for_old_shards(cut, commit)
            self.waiting = False
            self.transaction = transaction
            log.info(
                "passed resharding cut %s at %s: the old shards delivered what came before "
                "it; relaying from here",
                cut.cut,
                format_lsn(record.lsn),
                extra={"action": "cut_passed", "slot": slot, "lsn": format_lsn(record.lsn)},
            )
            return True
        if not self.waiting and slot in cut.slots:
            # Everything before the cut answered first: a refusal among it rewinds (or stops
            # the relay with its one line) instead of a stop that says all went out.
            self._commit()
            self._pipeline.settle()
            log.info(
                "reached resharding cut %s at %s: every event of slot %s before it goes to "
                "Kafka and is confirmed, the new shards relay the rest; stopping (drop this "
                "slot once every old shard has stopped: cdc-relay drop-slot)",
                cut.cut,
                format_lsn(record.lsn),
                slot,
                extra={"action": "cut_reached", "slot": slot, "lsn": format_lsn(record.lsn)},
            )
            self.at = commit
            self._stop()
            raise Stopping
        return False

    def _wait_for_old_shards(self, cut: Cut, lsn: Lsn) -> None:
        """Wait until every slot of ``cut`` is confirmed up to ``lsn``, the start of the cut's
        commit record (its relay stopped at the cut, having delivered everything before it),
        or is gone (dropped: the user's call)."""
        logged = False
        with connect(self._settings.dsn) as conn:
            while True:
                rows = conn.execute(QUERIES["slots_confirmed"], {"slots": list(cut.slots)})
                behind = [
                    row["slot_name"]
                    for row in rows.fetchall()
                    if row["confirmed"] is None or parse_lsn(row["confirmed"]) < lsn
                ]
                if not behind:
                    return
                if not logged:
                    logged = True
                    log.info(
                        "at resharding cut %s: waiting for the relays of %s to deliver what "
                        "came before it (start them if they are not running)",
                        cut.cut,
                        ", ".join(behind),
                        extra={"action": "cut_waiting_for_old", "slot": self._settings.slot},
                    )
                for _ in range(10):
                    self._pipeline.wait_for_kafka()
