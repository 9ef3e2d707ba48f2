"""Failover slots (PostgreSQL 17+): what the primary and each standby need so that a standby
holds a synchronised copy of the relay's slot when it is promoted.

The relay's slot is created with ``failover = true``; a standby with
``sync_replication_slots = on`` copies it from the primary, through its ``primary_slot_name``
and a ``primary_conninfo`` naming a database, with ``hot_standby_feedback`` keeping the rows
the copy still needs. The primary's ``synchronized_standby_slots`` makes the relay wait until
the standby has received the WAL it is sent, so that the copy is never behind what Kafka holds
from the old primary's stream. ``check`` looks at every host of a (multi-host) connection
string and says, per setting, what is right and what to run when it is not.

When the slot is lost all the same, ``stream`` and ``status`` say how, in one line with the
remedy: gone after a promotion (``slot_gone``), or given up on by PostgreSQL
(``slot_invalidated``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from cdc_relay.queries import QUERIES

MIN_VERSION_NUM = 170000

Level = Literal["ok", "missing", "note"]

# Keys that name hosts or pick among them: replaced by the one host's values.
_PER_HOST = frozenset({"host", "hostaddr", "port", "target_session_attrs", "load_balance_hosts"})


@dataclass(frozen=True)
class Finding:
    """One line of the check: ``level`` is ok, missing (failover would not work) or note."""

    node: str
    level: Level
    text: str

    def __str__(self) -> str:
        return f"failover: {self.node}: {self.level}: {self.text}"


def hosts(dsn: str) -> list[tuple[str, str]]:
    """``(host:port, connection string of that host alone)`` for each host of ``dsn``."""
    params = conninfo_to_dict(dsn)
    names = str(params.get("host") or "").split(",")
    addresses = str(params.get("hostaddr") or "").split(",")
    ports = str(params.get("port") or "").split(",")
    out = []
    for n, name in enumerate(names):
        port = ports[n] if len(ports) > 1 else ports[0]
        address = addresses[n] if len(addresses) > 1 else addresses[0]
        label = f"{name or address or 'localhost'}:{port or '5432'}"
        alone = {
            **{k: v for k, v in params.items() if k not in _PER_HOST},
            "host": name,
            "hostaddr": address,
            "port": port,
            "connect_timeout": params.get("connect_timeout") or "5",
        }
        out.append((label, make_conninfo("", **{k: v for k, v in alone.items() if v})))
    return out


def _node(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        node = dict(conn.execute(QUERIES["failover_node"]).fetchone() or {})
        node["physical_slots"] = {
            row["slot_name"]: row["active"]
            for row in conn.execute(QUERIES["physical_slots"]).fetchall()
        }
        node["failover_slot"] = {}
        return node


def _slot(dsn: str, slot: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        return dict(conn.execute(QUERIES["failover_slot"], {"slot": slot}).fetchone() or {})


def _listed(setting: str | None) -> list[str]:
    return [name.strip().strip('"') for name in (setting or "").split(",") if name.strip()]


_PLACEHOLDER_SLOT = "'<a physical slot of the primary>'"


def _reload(setting: str, value: str) -> str:
    return f"ALTER SYSTEM SET {setting} = {value}; SELECT pg_reload_conf()"


def check(dsn: str, slot: str) -> list[Finding]:
    """What failover of ``slot`` needs, checked on every host of ``dsn`` that answers."""
    findings: list[Finding] = []
    primaries: list[dict[str, Any]] = []
    standbys: list[tuple[str, dict[str, Any]]] = []
    for label, one in hosts(dsn):
        try:
            node = _node(one)
            node["failover_slot"] = _slot(one, slot)
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no answer"
            findings.append(Finding(label, "note", f"not checked: cannot connect ({first})"))
            continue
        if node["version_num"] < MIN_VERSION_NUM:
            findings.append(
                Finding(label, "missing", "PostgreSQL 17 or newer is needed for failover slots")
            )
        elif node["standby"]:
            standbys.append((label, node))
        else:
            primaries.append(node)
            findings.extend(_primary(f"primary {label}", node, slot))
    wanted = {name for p in primaries for name in _listed(p["synchronized_standby_slots"])}
    for label, node in standbys:
        findings.extend(_standby(f"standby {label}", node, slot, wanted if primaries else None))
    if not standbys:
        findings.append(
            Finding(
                "standby",
                "note",
                "no standby among the hosts of --dsn, so none was checked; list it there "
                "(host=primary,standby port=P1,P2 target_session_attrs=read-write) to check it",
            )
        )
    return findings


def _primary(node: str, row: dict[str, Any], slot: str) -> list[Finding]:
    out = []
    found = row["failover_slot"]
    if not found:
        out.append(Finding(node, "missing", f"no slot {slot}; run setup-slot --failover"))
    elif not found["failover"]:
        out.append(
            Finding(
                node,
                "missing",
                f"slot {slot} does not fail over; on a replication connection "
                f'(psql "$DSN replication=database") run ALTER_REPLICATION_SLOT {slot} '
                "(FAILOVER true) while no relay streams it",
            )
        )
    else:
        out.append(Finding(node, "ok", f"slot {slot} has failover = true"))
    listed = _listed(row["synchronized_standby_slots"])
    physical = row["physical_slots"]
    if not listed:
        example = ", ".join(physical) or "<the standby slot>"
        example = "'" + example.replace("'", "''") + "'"
        out.append(
            Finding(
                node,
                "missing",
                "synchronized_standby_slots is empty, so the relay may get changes no standby "
                f"has yet; {_reload('synchronized_standby_slots', example)}",
            )
        )
    for name in listed:
        if name not in physical:
            out.append(
                Finding(
                    node,
                    "missing",
                    f"synchronized_standby_slots names {name}, which is no physical slot here, "
                    "and the relay waits for it forever; SELECT "
                    f"pg_create_physical_replication_slot('{name}') and set primary_slot_name "
                    f"= '{name}' on the standby",
                )
            )
        elif not physical[name]:
            out.append(
                Finding(
                    node,
                    "note",
                    f"synchronized_standby_slots names {name}, which no standby streams now: "
                    "the relay waits until one does",
                )
            )
        else:
            out.append(Finding(node, "ok", f"synchronized_standby_slots includes {name} (active)"))
    return out


def _standby(node: str, row: dict[str, Any], slot: str, wanted: set[str] | None) -> list[Finding]:
    out = []
    if row["wal_level"] != "logical":
        out.append(
            Finding(
                node,
                "missing",
                f"wal_level is '{row['wal_level']}'; ALTER SYSTEM SET wal_level = logical and "
                "restart the standby",
            )
        )
    for setting in ("sync_replication_slots", "hot_standby_feedback"):
        if row[setting]:
            out.append(Finding(node, "ok", f"{setting} = on"))
        else:
            out.append(Finding(node, "missing", f"{setting} is off; {_reload(setting, 'on')}"))
    name = row["primary_slot_name"]
    if not name:
        out.append(
            Finding(
                node,
                "missing",
                "primary_slot_name is empty; "
                f"{_reload('primary_slot_name', _PLACEHOLDER_SLOT)}, "
                "and list that slot in the primary's synchronized_standby_slots",
            )
        )
    elif wanted is not None and name not in wanted:
        out.append(
            Finding(
                node,
                "missing",
                f"primary_slot_name {name} is not in the primary's synchronized_standby_slots; "
                "add it there (ALTER SYSTEM SET synchronized_standby_slots = "
                f"'{', '.join([*sorted(wanted), name])}'; SELECT pg_reload_conf() on the primary)",
            )
        )
    else:
        out.append(Finding(node, "ok", f"primary_slot_name = {name}"))
    conninfo = row["primary_conninfo"]
    if conninfo is None:
        out.append(
            Finding(
                node,
                "note",
                "primary_conninfo not checked: reading it needs superuser or pg_read_all_settings",
            )
        )
    elif not conninfo_to_dict(conninfo).get("dbname"):
        out.append(
            Finding(
                node,
                "missing",
                "primary_conninfo names no database, which slot synchronisation needs; add "
                "dbname=postgres (any database) to it and SELECT pg_reload_conf()",
            )
        )
    else:
        out.append(Finding(node, "ok", "primary_conninfo names a database"))
    copy = row["failover_slot"]
    if copy and copy["synced"] and not copy["temporary"]:
        out.append(
            Finding(
                node,
                "ok",
                f"holds a synchronised copy of slot {slot}, confirmed up to "
                f"{copy['confirmed_flush_lsn']}",
            )
        )
    else:
        out.append(
            Finding(
                node,
                "note",
                f"no synchronised copy of slot {slot} yet; the standby copies it within about "
                "30 s of these settings, once it has replayed up to the slot's position",
            )
        )
    return out


def slot_gone(slot: str, timeline: int | None) -> str | None:
    """Why ``slot`` is missing when the server is past its first timeline (it was promoted
    from a standby, or restored), with the remedy; None on timeline 1 or when unknown."""
    if timeline is None or timeline <= 1:
        return None
    return (
        f"replication slot {slot!r} does not exist on this server, which is on timeline "
        f"{timeline}: it was promoted from a standby (or restored from a backup) and the slot, "
        "no failover slot, stayed behind; make it anew with cdc-relay setup-slot "
        "--republish-since TIME, which first publishes again the events created since TIME: the "
        "time of the old relay's last progress line less its lag and your longest transaction "
        "(earlier costs only duplicates) (README: Hot standby and database failover)"
    )


# Why PostgreSQL invalidates a slot (pg_replication_slots.invalidation_reason, 17+; the slot
# query derives the first two on older versions), in the words of its setting.
_INVALIDATION_CAUSES = {
    "wal_removed": "the WAL it held back grew past max_slot_wal_keep_size",
    "idle_timeout": "it was inactive for longer than idle_replication_slot_timeout",
    "rows_removed": "the primary removed catalog rows it still needed (on a standby: "
    "hot_standby_feedback off, or no physical slot between the two)",
    "wal_level_insufficient": "the primary's wal_level is no longer logical",
}


def slot_invalidated(slot: str, row: Mapping[str, Any]) -> str | None:
    """Why PostgreSQL gave up on ``slot`` (its row of the ``slot`` query), with the remedy;
    None while it is usable."""
    reason = row.get("invalidated")
    if not reason:
        return None
    cause = _INVALIDATION_CAUSES.get(str(reason), f"invalidation_reason {reason}")
    confirmed = row.get("confirmed_flush_lsn")
    return (
        f"replication slot {slot!r} was invalidated by PostgreSQL ({reason}: {cause}), so "
        "the changes it had not confirmed may be gone from the WAL and it can never be streamed "
        "again; drop it (cdc-relay drop-slot) and make it anew with cdc-relay setup-slot "
        "--republish-since TIME, which first publishes again the events created since TIME: the "
        "time of the old relay's last progress line less its lag and your longest transaction "
        f"(earlier costs only duplicates; the slot had confirmed {confirmed or 'nothing'}) "
        "(README: A slot PostgreSQL gave up on)"
    )
