"""``cdc-relay status``: the slot (of every shard) and the outbox, as a table or one JSON
object, with the thresholds that make it a check (exit 3)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from cdc_relay.commands.kafka_options import CHECKPOINT_TOPIC, kafka_options
from cdc_relay.commands.options import (
    MESSAGE_WRITERS,
    SHARDS,
    Seconds,
    database_options,
    env_option,
    messages_option,
    slot_specs,
)
from cdc_relay.config import kafka_settings
from cdc_relay.errors import UsageError
from cdc_relay.kafka.exactly_once import ExactlyOnce, checkpoint_status
from cdc_relay.kafka.exactly_once import transactional_id as eos_id
from cdc_relay.kafka.sink import producer_config
from cdc_relay.ops.status import status
from cdc_relay.postgres.messages import writers_problem


@click.command("status")
@database_options
@SHARDS
@env_option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
@env_option(
    "--max-wal-retained",
    type=int,
    metavar="BYTES",
    help="Exit 3 when the slot holds back more WAL than this.",
)
@env_option(
    "--max-unprocessed", type=int, metavar="N", help="Exit 3 above N unprocessed rows (poller)."
)
@env_option(
    "--max-unconfirmed",
    type=int,
    metavar="N",
    help="Exit 3 above N rows the slot has not confirmed (stream), or when it cannot tell.",
)
@env_option(
    "--max-dead-letters", type=int, metavar="N", help="Exit 3 above N dead letters (poller)."
)
@env_option("--require-active", is_flag=True, help="Exit 3 when no relay streams the slot.")
@env_option(
    "--require-failover-ready",
    is_flag=True,
    help="Exit 3 unless the slot is a failover slot and a standby among the hosts of --dsn "
    "holds a usable copy of it (synchronised, persistent, not invalidated): a failover now "
    "would lose the slot otherwise.",
)
@env_option(
    "--wait",
    type=Seconds(0, 3600),
    default=5.0,
    show_default=True,
    help="Seconds to wait for the slot to confirm the WAL position status starts at, to tell "
    "confirmed rows from unconfirmed ones (stream).",
)
@env_option(
    "--exactly-once",
    is_flag=True,
    help="The slot is streamed with --exactly-once: show the checkpoint its committed Kafka "
    "transactions reach (read_committed) beside the slot's position; needs --kafka-bootstrap.",
)
@env_option(
    "--transactional-id",
    metavar="ID",
    help="The transactional id of --exactly-once.  [default: cdc-relay-SLOT]",
)
@CHECKPOINT_TOPIC
@messages_option(
    "The slot is streamed with --messages: alert when others than the writers "
    "(--message-writer) may emit logical decoding messages."
)
@MESSAGE_WRITERS
@kafka_options(required=False, topics=False, wire=False)
def status_command(
    dsn: str,
    slot: str,
    publication: str,
    table: str,
    shards: int | None,
    as_json: bool,
    max_wal_retained: int | None,
    max_unprocessed: int | None,
    max_unconfirmed: int | None,
    max_dead_letters: int | None,
    require_active: bool,
    require_failover_ready: bool,
    wait: float,
    exactly_once: bool,
    transactional_id: str | None,
    checkpoint_topic: str,
    messages: bool,
    message_writers: tuple[str, ...],
    kafka_bootstrap: str | None,
    kafka_config: tuple[str, ...],
    kafka_config_file: Path | None,
    kafka_timeout: float,
) -> None:
    """Show the slot and the outbox: active, confirmed LSN, WAL retained, pending rows.

    A stream outbox's rows are told apart: confirmed by the slot (on Kafka) or not yet. A
    failover slot's copy on each standby of --dsn is shown, usable or why not. With
    --shards N, every shard's slot. With --exactly-once, the checkpoint in Kafka too. With
    --messages, who may emit logical decoding messages. With thresholds it is a check for
    scripts and cron: exit 3 when one is crossed.
    """
    kafka = None
    if exactly_once:
        if not kafka_bootstrap:
            raise UsageError("status --exactly-once reads the checkpoint: give --kafka-bootstrap")
        kafka = producer_config(kafka_bootstrap, kafka_settings(kafka_config, kafka_config_file))
    states, alerts = [], []
    for spec in slot_specs(slot, publication, table, shards):
        state = status(dsn, spec.slot, table, spec.publication, wait, spec.shard)
        if kafka is not None:
            eos = ExactlyOnce(transactional_id or eos_id(spec.slot), checkpoint_topic)
            state["checkpoint"] = checkpoint_status(kafka, eos, kafka_timeout).as_json()
        mine = []
        if not state["exists"]:
            mine.append(f"slot {spec.slot} does not exist")
        if state["slot_problem"]:
            mine.append(state["slot_problem"])
        if state["publication_problem"]:
            mine.append(state["publication_problem"])
        if state["lineage_problem"]:
            mine.append(state["lineage_problem"])
        if require_active and not state["active"]:
            mine.append(f"no relay is streaming slot {spec.slot}")
        if require_failover_ready and state["failover"] and not state["failover"]["ready"]:
            mine.append(state["failover"]["reason"])
        if max_unconfirmed is not None and state["confirmed_rows_unknown"]:
            mine.append(f"cannot tell unconfirmed rows: {state['confirmed_rows_unknown']}")
        for key, limit, what in (
            (
                "wal_retained_bytes",
                max_wal_retained,
                "bytes of WAL retained" + ("" if shards is None else f" by {spec.slot}"),
            ),
            ("unprocessed_rows", max_unprocessed, "unprocessed rows"),
            ("unconfirmed_rows", max_unconfirmed, "unconfirmed rows"),
            ("dead_letters", max_dead_letters, "dead letters"),
        ):
            if limit is not None and (state[key] or 0) > limit:
                mine.append(f"{state[key]} {what} (limit {limit})")
        states.append((spec, state))
        alerts += [alert for alert in mine if alert not in alerts]
    if messages and (problem := writers_problem(dsn, message_writers)):
        alerts.append(problem)
    if as_json:
        found = [state for _, state in states]
        click.echo(
            json.dumps({**(found[0] if shards is None else {"shards": found}), "alerts": alerts})
        )
    else:
        for spec, state in states:
            if spec.shard is not None:
                click.echo(f"-- shard {spec.shard}")
            rows = [
                ("slot", spec.slot if state["exists"] else f"{spec.slot} (missing)"),
                ("WAL status", state["wal_status"] or "-"),
                ("active", f"yes (pid {state['active_pid']})" if state["active"] else "no"),
                ("plugin", state["plugin"] or "-"),
                ("confirmed LSN", state["confirmed_flush_lsn"] or "-"),
                *(
                    [("checkpoint", state["checkpoint"]["summary"])]
                    if "checkpoint" in state
                    else []
                ),
                ("WAL retained", _bytes(state["wal_retained_bytes"])),
                ("outbox table", state["table"]),
                ("publication", _publication(state)),
                ("lineage", _lineage(state["lineage"])),
                *_failover(state["failover"]),
            ]
            if state["slot_relays_table"]:
                unknown = state["confirmed_rows_unknown"]
                confirmed = f"- ({unknown})" if unknown else _count(state["confirmed_rows"])
                rows += [
                    ("confirmed rows", confirmed),
                    ("unconfirmed rows", _count(state["unconfirmed_rows"])),
                ]
            else:
                rows.append(("unprocessed rows", _count(state["unprocessed_rows"])))
            rows.append(("dead letters", _count(state["dead_letters"])))
            for name, value in rows:
                click.echo(f"{name:<17} {value}")
        for alert in alerts:
            click.echo(f"ALERT: {alert}", err=True)
    if alerts:
        sys.exit(3)


def _failover(found: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The failover line, then a line per standby of --dsn (none without a slot)."""
    if found is None:
        return []
    if not found["failover_slot"]:
        return [("failover", "no (not a failover slot)")]
    if not found["standbys"]:
        return [("failover", f"NOT READY: {found['reason']}")]
    rows = [("failover", "ready" if found["ready"] else "NOT READY")]
    for copy in found["standbys"]:
        if copy["usable"]:
            text = (
                f"usable copy, confirmed {copy['confirmed_flush_lsn']}, "
                f"{_bytes(copy['confirmed_lag_bytes'])} behind the primary's slot "
                f"(restart {_bytes(copy['restart_lag_bytes'])} behind)"
            )
        else:
            text = copy["problem"]
        rows.append(("standby", f"{copy['standby']}: {text}"))
    return rows


def _publication(state: dict[str, Any]) -> str:
    if not state["publication_exists"]:
        return f"{state['publication']} (missing)"
    if state["publication_problem"]:
        return f"{state['publication']} (does not cover the table)"
    return str(state["publication"])


def _lineage(found: dict[str, Any] | None) -> str:
    if found is None:
        return "-"
    return (
        f"made by {found['made']} at {found['created_lsn']}, "
        f"{found['created_at'][:19].replace('T', ' ')}; confirmed up to {found['confirmed_lsn']} "
        "at least"
    )


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)
