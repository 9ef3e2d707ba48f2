"""Failover slots (PostgreSQL 17+): what the primary and each standby need so that a standby
holds a synchronised copy of the relay's slot when it is promoted.

The relay's slot is created with ``failover = true``; a standby with
``sync_replication_slots = on`` copies it from the primary, through its ``primary_slot_name``
and a ``primary_conninfo`` naming a database, with ``hot_standby_feedback`` keeping the rows
the copy still needs. The primary's ``synchronized_standby_slots`` makes the relay wait until
the standby has received the WAL it is sent, so that the copy is never behind what Kafka holds
from the old primary's stream. ``check`` looks at every host of a (multi-host) connection
string and says, per setting, what is right and what to run when it is not.

Whether a standby's copy would serve after a promotion now (present, synchronised, persistent,
not invalidated) and how far behind the primary's slot it is: ``copy_of`` judges one standby's
row, ``Readiness`` all of them (read by failover_ready.py, for ``status`` and the relay).

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

from cdc_relay.lsn import parse as parse_lsn
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
        return dict(conn.execute(QUERIES["slot"], {"slot": slot}).fetchone() or {})


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
    problem = _copy_problem(slot, copy or None)
    if problem is None:
        out.append(
            Finding(
                node,
                "ok",
                f"holds a synchronised copy of slot {slot}, confirmed up to "
                f"{copy['confirmed_flush_lsn']}",
            )
        )
    elif not copy or copy["temporary"]:
        out.append(
            Finding(
                node,
                "note",
                f"no synchronised copy of slot {slot} yet; the standby copies it within about "
                "30 s of these settings, once it has replayed up to the slot's position",
            )
        )
    else:
        out.append(Finding(node, "note", problem))
    return out


@dataclass(frozen=True)
class Copy:
    """What one standby holds of a failover slot: ``problem`` says why a promotion now would
    not keep it usable (None when it would); the lags, how many bytes of WAL its positions are
    behind the primary's slot (None without a copy, 0 when it is level or ahead)."""

    standby: str
    problem: str | None
    row: Mapping[str, Any] | None = None
    confirmed_lag: int | None = None
    restart_lag: int | None = None

    @property
    def usable(self) -> bool:
        return self.problem is None

    def as_json(self) -> dict[str, Any]:
        row = self.row or {}
        return {
            "standby": self.standby,
            "usable": self.usable,
            "problem": self.problem,
            "present": self.row is not None,
            "synced": row.get("synced"),
            "temporary": row.get("temporary"),
            "invalidated": row.get("invalidated"),
            "confirmed_flush_lsn": row.get("confirmed_flush_lsn"),
            "restart_lsn": row.get("restart_lsn"),
            "confirmed_lag_bytes": self.confirmed_lag,
            "restart_lag_bytes": self.restart_lag,
        }


def _lag(primary: Mapping[str, Any], copy: Mapping[str, Any], key: str) -> int | None:
    if not primary.get(key) or not copy.get(key):
        return None
    return max(0, parse_lsn(str(primary[key])) - parse_lsn(str(copy[key])))


def _copy_problem(slot: str, copy: Mapping[str, Any] | None) -> str | None:
    if not copy:
        return (
            f"no copy of slot {slot} (a standby with sync_replication_slots = on copies a "
            "failover slot once its replay reaches the slot's position; setup-slot --failover "
            "checks its settings)"
        )
    if not copy.get("synced"):
        return (
            f"its slot {slot} is its own, not a synchronised copy, and slot synchronisation "
            "leaves it alone; drop it on the standby"
        )
    if copy.get("invalidated"):
        reason = copy["invalidated"]
        cause = _INVALIDATION_CAUSES.get(str(reason), f"invalidation_reason {reason}")
        return (
            f"its copy of slot {slot} was invalidated ({reason}: {cause}); with "
            "sync_replication_slots = on the standby drops it and copies the slot anew"
        )
    if copy.get("temporary"):
        return (
            f"its copy of slot {slot} is still temporary, and a promotion would drop it; the "
            "standby keeps it so until it has replayed past the slot's position and can decode "
            "from there (SELECT pg_log_standby_snapshot() on the primary hastens it)"
        )
    return None


def copy_of(
    slot: str, standby: str, primary: Mapping[str, Any], copy: Mapping[str, Any] | None
) -> Copy:
    """``standby``'s copy of ``slot`` (its row of the ``slot`` query, None when it has none)
    against ``primary``, the primary's row of the same query."""
    return Copy(
        standby,
        _copy_problem(slot, copy),
        copy,
        None if copy is None else _lag(primary, copy, "confirmed_flush_lsn"),
        None if copy is None else _lag(primary, copy, "restart_lsn"),
    )


@dataclass(frozen=True)
class Readiness:
    """Whether ``slot`` would survive a failover now: it is a failover slot and at least one
    standby holds a usable copy of it. ``copies``: each standby among the hosts of --dsn, and
    each host that did not answer (its role unknown)."""

    slot: str
    failover: bool
    copies: tuple[Copy, ...] = ()

    @property
    def ready(self) -> bool:
        return self.failover and any(copy.usable for copy in self.copies)

    @property
    def reason(self) -> str | None:
        """Why not, in one line with what to do; None when ready."""
        if self.ready:
            return None
        if not self.failover:
            return (
                f"slot {self.slot} is no failover slot, so no standby keeps a copy of it; on a "
                f'replication connection (psql "$DSN replication=database") run '
                f"ALTER_REPLICATION_SLOT {self.slot} (FAILOVER true) while no relay streams it "
                '(docs/failover.md, "Hot standby and database failover")'
            )
        if not self.copies:
            return (
                f"no standby among the hosts of --dsn to hold a copy of slot {self.slot}; list "
                "the standbys there (host=primary,standby port=P1,P2 "
                "target_session_attrs=read-write): the relay follows a promotion to those"
            )
        return f"no standby holds a usable copy of slot {self.slot}: " + "; ".join(
            f"{copy.standby}: {copy.problem}" for copy in self.copies
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "failover_slot": self.failover,
            "ready": self.ready,
            "reason": self.reason,
            "standbys": [copy.as_json() for copy in self.copies],
        }


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
        "(earlier costs only duplicates) "
        '(docs/failover.md, "Hot standby and database failover")'
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
        '(docs/failover.md, "A slot PostgreSQL gave up on")'
    )
