"""Resharding (``cdc-relay reshard``): which slots of a name the relays stream now (the
generation the cut names), the new shards made, then the cut written at which the old
shards' relays stop and the new ones start (shards.py; ARCHITECTURE.md, "Shards and
resharding")."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from cdc_relay.errors import PreflightError
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.postgres.connection import connect, one_row
from cdc_relay.postgres.shards import (
    CUT_PREFIX,
    Cut,
    Shard,
    StartAfterCut,
    every_shard,
    shard_named,
)
from cdc_relay.postgres.slot import SlotSpec, comment_statement, setup
from cdc_relay.queries import QUERIES


def reshard(dsn: str, spec: SlotSpec, before: int, after: int) -> list[str]:
    """Create the ``after`` new shards of ``spec``, then write the cut at which the ``before``
    old ones stop and the new ones start (shards.py); return what was done, and what to do."""
    plan = prepare_reshard(dsn, spec, before, after)
    with connect(dsn) as conn, conn.transaction():
        at = write_cut(conn, plan)
    old = plan.old
    return [
        *plan.done,
        f"wrote resharding cut {at.cut} at {format_lsn(at.lsn or 0)}: the relays of "
        f"{', '.join(each.slot for each in old)} stop at it once they have delivered "
        "everything before it",
        f"start one relay per new shard: cdc-relay stream --shard K/{after} (K from 0 to "
        f"{after - 1}); they relay what comes after the cut",
        "once every old relay has stopped (exit 0, 'reached resharding cut' in its log), drop "
        "the old shards: cdc-relay drop-slot"
        + (f" --shards {before}" if old[0].shard is not None else "")
        + " --yes",
    ]


@dataclass(frozen=True)
class ReshardPlan:
    """A reshard whose new shards exist, its cut not yet written."""

    cut: StartAfterCut
    old: list[SlotSpec]
    new: dict[Shard, SlotSpec]
    done: list[str]


def prepare_reshard(dsn: str, spec: SlotSpec, before: int, after: int) -> ReshardPlan:
    """Check that the ``before`` shards of ``spec`` can be resharded, and create the ``after``
    new ones; the cut is written next (:func:`write_cut`)."""
    new = {shard: spec.sharded(shard) for shard in every_shard(after)}
    lines = []
    with connect(dsn) as conn:
        old = _streamed(conn, spec, before, after)
        for each in old:
            slot = one_row(conn, "slot", slot=each.slot)
            if not slot:
                raise PreflightError(
                    f"slot {each.slot} does not exist, so the relays do not stream {before} "
                    "shard(s) of it; check --from and --slot"
                )
            if slot["plugin"] != "pgoutput":
                raise PreflightError(
                    f"slot {each.slot} uses {slot['plugin']}; shards need pgoutput slots: "
                    "move to one first (setup-slot --plugin pgoutput, then stream it)"
                )
            # The new publications publish --table alone: another table's rows after the cut
            # would be in no slot's stream.
            table = one_row(conn, "table", table=spec.table).get("name")
            published = one_row(conn, "publication", publication=each.publication).get("tables")
            others = [name for name in published or () if name != table]
            if others:
                raise PreflightError(
                    f"publication {each.publication} publishes {', '.join(others)} beside "
                    f"{table or spec.table}; reshard moves one outbox table to new shards, so "
                    "the rows of the others would be in no shard's stream after the cut: "
                    "reshard a publication of one table only"
                )
        for shard, each in new.items():
            if not (
                one_row(conn, "slot", slot=each.slot)
                or one_row(conn, "publication", publication=each.publication)
            ):
                continue
            comment = one_row(conn, "publication_comment", publication=each.publication)
            done = StartAfterCut.from_comment(comment.get("comment"), shard)
            if done is not None and done.lsn is not None:
                raise PreflightError(
                    f"the {after} shards exist and start after resharding cut {done.cut}, "
                    f"written at {format_lsn(done.lsn)}: this reshard is done. Run their relays "
                    f"(stream --shard K/{after}); do not drop them, they hold the events after "
                    "the cut"
                )
            raise PreflightError(
                f"{each.slot} or its publication exists already, from a reshard that stopped "
                f"before writing its cut (no relay uses them): drop them (cdc-relay drop-slot "
                f"--shards {after} --yes) and run reshard again"
            )
    cut = StartAfterCut(str(uuid.uuid4()), None)
    for shard, each in new.items():
        report = setup(dsn, replace(each, comment=cut.comment(shard)), gap="cut")
        lines += report.done
    return ReshardPlan(cut, old, new, lines)


def write_cut(conn: psycopg.Connection[dict[str, Any]], plan: ReshardPlan) -> StartAfterCut:
    """Write the cut of ``plan`` in the open transaction of ``conn``: the message, then its
    position in the new publications' comments. The cut's place among the transactions is
    this transaction's commit, not the message's LSN: transactions that commit between the
    two are before the cut (the relays wait for the cut's commit, ARCHITECTURE.md)."""
    # The new slots exist: every transaction that commits from now on is in their streams.
    message = Cut(plan.cut.cut, tuple(each.slot for each in plan.old))
    row = conn.execute(
        QUERIES["emit_cut"], {"prefix": CUT_PREFIX, "content": message.content()}
    ).fetchone()
    at = StartAfterCut(plan.cut.cut, parse_lsn(str((row or {})["lsn"])))
    for shard, each in plan.new.items():
        conn.execute(comment_statement(each.publication, at.comment(shard)))
    return at


@dataclass(frozen=True)
class _Generation:
    """The slots of one shard count of a base name (``count`` 0: the slot without shards), and
    the resharding cut they start after: its position once written (``since``), whether one is
    named (``pending``: a reshard that stopped before writing it; no relay streams them)."""

    count: int
    specs: list[SlotSpec]
    since: Lsn | None
    pending: bool

    def __str__(self) -> str:
        slots = ", ".join(each.slot for each in self.specs)
        return f"the slot without shards ({slots})" if not self.count else f"{slots}"


def _streamed(
    conn: psycopg.Connection[dict[str, Any]], spec: SlotSpec, before: int, after: int
) -> list[SlotSpec]:
    """The slots ``reshard --from before`` cuts: those of ``before`` shards (1: the slot
    without shards, or the one shard a reshard --to 1 made, whichever came later). PreflightError
    when the relays stream another generation of slots of this name, made by a later reshard
    (or when which one they stream cannot be told): a cut naming slots they left would stop no
    relay, and the new shards would relay what follows it too."""
    counts = {0, 1} if before == 1 else {before}
    for name in _rows(conn, "slots_named_after", base=spec.slot):
        shard = shard_named(name["slot_name"], spec.slot)
        if shard is not None:
            counts.add(shard.count)
    generations = []
    for count in sorted(counts - {after}):
        specs = [spec] if not count else [spec.sharded(s) for s in every_shard(count)]
        if not any(one_row(conn, "slot", slot=each.slot) for each in specs):
            continue
        cuts = [
            StartAfterCut.from_comment(
                one_row(conn, "publication_comment", publication=each.publication).get("comment"),
                each.shard,
            )
            for each in specs
            if each.shard is not None
        ]
        cut = next((c for c in cuts if c is not None), None)
        since = cut.lsn if cut is not None else None
        pending = cut is not None and since is None
        generations.append(_Generation(count, specs, since, pending))
    mine = [g for g in generations if g.count in ((0, 1) if before == 1 else (before,))]
    if not mine:
        return [spec] if before == 1 else [spec.sharded(s) for s in every_shard(before)]
    chosen = max(mine, key=lambda g: -1 if g.since is None else g.since)
    for other in generations:
        if other is chosen or other.pending:
            continue
        if other.since is not None and (chosen.since is None or other.since > chosen.since):
            raise PreflightError(
                f"the relays stream {other} now (they start after the resharding cut at "
                f"{format_lsn(other.since)}), not {chosen}: a cut naming those would stop none "
                "of the relays, and old and new shards would both relay what follows it; run "
                f"reshard --from {other.count} --to {after}, and drop {chosen} once its relays "
                "have stopped (cdc-relay drop-slot)"
            )
        if other.since is None and chosen.since is None:
            raise PreflightError(
                f"{chosen} and {other} both exist, neither made by a reshard, so which the "
                "relays stream cannot be told; drop the one no relay streams (cdc-relay "
                "drop-slot) and run reshard again"
            )
    return chosen.specs


def _rows(
    conn: psycopg.Connection[dict[str, Any]], name: str, **params: Any
) -> list[dict[str, Any]]:
    return conn.execute(QUERIES[name], params).fetchall()
