"""The outbox table as the poller sees it: every query the poller runs on it, in one place.

The table is resolved once (:func:`resolve`) and named by its schema and name from then on
(:class:`Outbox`); what a database error means for the relay is decided here too
(:func:`kind`, :func:`refusal`). ``PgStore`` is the real store of ``poll``: a worker's claims
(:class:`PgClaims`: claim, mark, commit, on the worker's own connection, which holds the
outbox's advisory lock) and the counts of the progress line. The poll loop (poller.py) takes
it through the Protocols of stages.py (``OutboxStore``, ``Claims``), so that its unit tests
run it on an in-memory outbox (tests/unit/test_poll_loop.py).

The SQL itself is in sql/queries.sql, as named queries.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.rows import class_row, dict_row

from cdc_relay.errors import PreflightError, RelayError
from cdc_relay.events import TIMESTAMP_OIDS, OutboxEvent, PayloadKind, SchemaError, payload_kind
from cdc_relay.postgres.tables import OutboxTable, find_table
from cdc_relay.queries import QUERIES
from cdc_relay.tracecontext import parse as parse_trace

FENCES = "cdc_relay_handovers"
"""Schema poller's table of handovers to stream, which fence the pollers off a table."""

LOCK_CLASS = 0x43444352  # "CDCR"
"""First key of the outbox's advisory lock (``pg_locks.classid``); the second is the table's
oid (``pg_locks.objid``)."""


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """An unprocessed row, as the claim reads it."""

    id: str
    # NULL where the user's table allows it: an aggregate id makes an event without a key, an
    # aggregate_type or event_type a row that cannot be routed (event() refuses it: a dead
    # letter naming the column)
    aggregate_type: str | None
    aggregate_id: str | None
    event_type: str | None
    payload: bytes | None
    payload_type: int  # pg_type oid of the payload column when the row was read
    attempts: int
    created_at: str | None = None  # ISO 8601 (to_jsonb), when the table has the column
    payload_kind: PayloadKind = "json"
    headers: tuple[tuple[str, bytes], ...] = ()  # --header-column values (a republish's)
    seq: int | None = None  # the claim's: the row's place in the queue
    key: int | None = None  # the claim's: its aggregate's lock key (claim_aggregates)
    trace: str | None = None  # the --trace-column's text (None: no such column, or NULL)

    @property
    def aggregate(self) -> tuple[str | None, str | None]:
        return self.aggregate_type, self.aggregate_id

    def event(self) -> OutboxEvent:
        """The row as an event; SchemaError if its aggregate_type or event_type is NULL."""
        aggregate_type, event_type = self.aggregate_type, self.event_type
        if aggregate_type is None or event_type is None:
            column = "aggregate_type" if aggregate_type is None else "event_type"
            raise SchemaError(
                f"row {self.id}: its {column} is NULL, and an event needs one to be routed; "
                f"give the row an {column}, then cdc-relay dead-letters retry --id {self.id}"
            )
        return OutboxEvent(
            id=self.id,
            aggregate_type=aggregate_type,
            aggregate_id=self.aggregate_id,
            event_type=event_type,
            payload=self.payload,
            commit_lsn=0,
            xid=0,
            commit_time_us=0,
            headers=self.headers,
            created_at=None if self.created_at is None else self.created_at.encode(),
            payload_kind=self.payload_kind,
            trace=None if self.trace is None else parse_trace(self.trace.encode()),
        )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


@dataclass(frozen=True)
class Outbox:
    """The outbox table of ``--table``, resolved once (``find_table``: quoting, case folding,
    ``search_path``); every query names it by its schema and name from then on."""

    table: OutboxTable
    payload_type: int | None  # pg_type oid of the payload column; None without one
    payload_bytea: bool  # bytea, or a domain over it
    created_at: bool = False  # a created_at column of a timestamp type
    published_index: bool = False  # an index serves published_after (schema poller's)
    trace_column: str | None = None  # --trace-column, read with every row (trace_text)

    @property
    def qualified(self) -> str:
        return self.table.qualified

    @property
    def channel(self) -> str:
        """The NOTIFY channel of the trigger of cdc-relay schema poller on this table: by its
        OID, so that it fits whatever the table's names (63 bytes at most) and survives a
        rename."""
        return f"cdc_relay_{self.table.oid}"

    @property
    def listen(self) -> sql.Composed:
        """The poller's LISTEN on ``channel``."""
        return sql.SQL(QUERIES["listen"]).format(channel=sql.Identifier(self.channel))

    @property
    def fences(self) -> sql.Identifier:
        """Schema poller's table where the handover fences pollers off this table: in the
        table's own schema, where schema poller was applied for it."""
        return sql.Identifier(self.table.schema, FENCES)

    @property
    def lock(self) -> dict[str, int]:
        """The parameters of the table's advisory lock (poll_lock, handover_lock, pollers)."""
        return {"lock_class": LOCK_CLASS, "table": self.table.oid}

    def query(self, name: str, **more: sql.Composable) -> sql.Composed:
        """A named query on this table (``more`` fills its other placeholders). The payload
        expression is chosen here, once: a bytea payload goes out as the bytes stored, any other
        type as its text (the bytes pgoutput sends, so both relays publish the same value)."""
        payload = QUERIES["payload_bytes" if self.payload_bytea else "payload_text"]
        trace = (
            sql.SQL("")
            if self.trace_column is None
            else sql.SQL(QUERIES["trace_text"]).format(column=sql.Identifier(self.trace_column))
        )
        return sql.SQL(QUERIES[name]).format(
            table=self.table.identifier,
            trace=trace,
            payload=sql.SQL(payload),
            created_at=sql.SQL(QUERIES["created_at_text" if self.created_at else "no_created_at"]),
            lock_key=sql.SQL(QUERIES["lock_key"]),
            payload_kind=sql.Literal(payload_kind(self.payload_type, self.payload_bytea)),
            **more,
        )

    def check_payload(self, rows: Sequence[OutboxRow]) -> None:
        """Refuse rows read after the payload column changed type: the expression chosen at
        start would send other bytes than stored (a bytea read as text is its hex form)."""
        if rows and rows[0].payload_type != self.payload_type:
            raise RelayError(
                f"the payload column of {self.qualified} changed type while the relay ran; "
                "nothing was published from it since: start the relay again, which reads the "
                "payload by the column's type"
            )


def resolve(
    conn: psycopg.Connection[dict[str, Any]],
    table: str,
    payload_column: str = "payload",
    trace_column: str | None = None,
) -> Outbox:
    """The outbox table ``table`` names, its payload in ``payload_column``, its trace context
    in ``trace_column`` (--trace-column); PreflightError if there is no such table or column."""
    try:
        found = find_table(conn, table)
    except psycopg.OperationalError:
        raise
    except psycopg.DatabaseError as exc:  # e.g. a name with too many dots
        raise PreflightError(
            f"--table {table!r} is not a table name PostgreSQL reads: {first_line(exc)}"
        ) from None
    if found is None:
        raise PreflightError(
            f"table {table} does not exist; create it with cdc-relay schema apply outbox, "
            "or name yours with --table"
        )
    payload = (
        conn.execute(
            QUERIES["poll_payload"], {"oid": found.oid, "payload": payload_column}
        ).fetchone()
        or {}
    )
    index = conn.execute(QUERIES["published_index"], {"oid": found.oid}).fetchone() or {}
    check_trace_column(conn, found, trace_column)
    return Outbox(
        found,
        payload.get("payload_type"),
        bool(payload.get("payload_bytea")),
        payload.get("created_at_type") in TIMESTAMP_OIDS,
        bool(index.get("present")),
        trace_column,
    )


def check_trace_column(
    conn: psycopg.Connection[dict[str, Any]], table: OutboxTable, column: str | None
) -> None:
    """Refuse a ``--trace-column`` the outbox table lacks: most likely a typo, and every event
    would go out without its trace context."""
    if column is None:
        return
    found = conn.execute(QUERIES["republish_columns"], {"oid": table.oid, "columns": [column]})
    if (found.fetchone() or {}).get("missing"):
        raise PreflightError(
            f"table {table.qualified} has no column {column} (--trace-column); add it, or name "
            "the column that holds the traceparent"
        )


def check_columns(conn: psycopg.Connection[dict[str, Any]], outbox: Outbox) -> None:
    missing = conn.execute(QUERIES["poll_columns"], {"oid": outbox.table.oid})
    columns = (missing.fetchone() or {}).get("missing")
    if columns:
        raise PreflightError(
            f"table {outbox.qualified} has no column {', '.join(columns)}, which the poller "
            "needs; add them as cdc-relay schema show outbox does"
        )


# -- what a database error means ------------------------------------------------------------
#
# Three kinds. The connection and the server's passing state (class 08 and the rest of
# psycopg's OperationalError: shutdown, too many connections, a cancelled query; 40:
# serialization failure, deadlock) are retried with backoff on a new connection.
#
# A read-only server (25006) is waited out the same way, with a warning that says so. After a
# failover the old primary comes back as a standby, or --dsn (a DNS name, a virtual IP, a
# multi-host DSN) reaches the new primary only after a reconnect; a database made read-only
# for maintenance becomes writable again. Waiting loses nothing: the claim is the first
# statement of its transaction and FOR UPDATE is refused before any row is read, so nothing
# was published, and a transaction that got past its claim is read-write to its end. Stopping
# would only need someone to start the relay again once the cluster has settled.
#
# Anything else the server refuses (a dropped column or table, a revoked privilege, a
# constraint) stays refused until someone changes the database: the relay stops with one line
# that says what to do. The refused transaction is rolled back, so nothing is marked that
# Kafka did not acknowledge; rows acknowledged but not marked are published again later.

RETRY, READ_ONLY, REFUSED = "retry", "read-only", "refused"


def kind(exc: psycopg.DatabaseError) -> str:
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return READ_ONLY
    if isinstance(exc, psycopg.OperationalError | psycopg.errors.TransactionRollback):
        return RETRY
    return REFUSED


def refusal(exc: psycopg.DatabaseError, outbox: Outbox, doing: str) -> RelayError:
    """The one-line error for a database error the user must act on."""
    code = exc.sqlstate or ""
    if code == "42501":
        remedy = "grant the role of --dsn what cdc-relay schema show roles grants the poller"
    elif code[:2] in ("42", "0A"):
        remedy = f"make {outbox.qualified} as cdc-relay schema show outbox does"
    elif code == "25006":
        remedy = "run it against the primary"
    elif kind(exc) == RETRY:
        remedy = "check --dsn and the server"
    else:
        remedy = "fix the cause"
    sqlstate = f" (SQLSTATE {code})" if code else ""
    return RelayError(
        f"PostgreSQL refused {doing} on {outbox.qualified}: {first_line(exc)}{sqlstate}; "
        f"{remedy}, then run it again"
    )


@contextlib.contextmanager
def refused(outbox: Outbox, doing: str) -> Iterator[None]:
    """Database errors of a housekeeping command (dead letters, prune) as one line each."""
    try:
        yield
    except psycopg.DatabaseError as exc:
        raise refusal(exc, outbox, doing) from None


def check_lock_room(
    conn: psycopg.Connection[dict[str, Any]], workers: int, batch_size: int
) -> None:
    """Each worker's claim locks up to --batch-size aggregates in PostgreSQL's shared lock
    table; refuse a configuration that would take over half of it."""
    room = int((conn.execute(QUERIES["lock_room"]).fetchone() or {})["room"])
    need = workers * batch_size
    if need > room // 2:
        raise PreflightError(
            f"--workers x --batch-size = {need} aggregate locks at once, over half of "
            f"PostgreSQL's lock table ({room}: max_locks_per_transaction x (max_connections + "
            "max_prepared_transactions)); "
            "lower --batch-size or --workers, or raise max_locks_per_transaction"
        )


def take_poll_lock(conn: psycopg.Connection[Any], outbox: Outbox) -> None:
    """Take the outbox's advisory lock, shared, for as long as the session lasts; a
    PreflightError if a handover holds it.

    Session-level: behind a pooler in transaction mode it would not stay with the session, so
    pollers must connect to PostgreSQL directly (or through session pooling).
    """
    with conn.cursor(row_factory=dict_row) as cur:
        if (cur.execute(QUERIES["poll_lock"], outbox.lock).fetchone() or {}).get("locked"):
            return
        pids = [
            str(r["pid"]) for r in cur.execute(QUERIES["pollers"], outbox.lock) if r["handover"]
        ]
    by = f" (pid {', '.join(pids)})" if pids else ""
    raise PreflightError(
        f"a handover to stream (cdc-relay setup-slot --from-poller) is running on "
        f"{outbox.qualified}{by}; a poller must not run beside it: when the handover has "
        "finished, run cdc-relay stream; if it failed, start the poller again"
    )


def handover_fence(conn: psycopg.Connection[Any], outbox: Outbox) -> dict[str, Any] | None:
    """The handover that took ``outbox`` over to ``stream`` (its row of schema poller's
    cdc_relay_handovers, the slot made or being made): None when none did, or when a
    handover was undone before it made its slot. None too when the table has no such table
    beside it: a handover refuses to run without one."""
    with conn.cursor(row_factory=dict_row) as cur:
        found = cur.execute(QUERIES["handover_fences"], {"schema": outbox.table.schema})
        if not (found.fetchone() or {}).get("present"):
            return None
        try:
            fence = cur.execute(
                sql.SQL(QUERIES["handover_fence"]).format(fences=outbox.fences),
                {"oid": outbox.table.oid},
            ).fetchone()
        except psycopg.errors.InsufficientPrivilege:
            raise PreflightError(
                f"the role of --dsn may not read {outbox.table.schema}.{FENCES}, where a "
                f"handover to stream fences the pollers off {outbox.qualified}; grant it "
                "SELECT there, as cdc-relay schema show roles does for the poller role"
            ) from None
    if fence is None or (fence["lsn"] is None and not fence["slot_exists"]):
        return None
    return fence


def published_after(
    conn: psycopg.Connection[Any], outbox: Outbox, ids: list[str]
) -> dict[str, int]:
    """Of the rows ``ids``, those a later row of their aggregate was published before (their
    transaction committed after it went out): by id, that row's seq. Empty without an index
    to look them up by (``Outbox.published_index``): a look-up would read the whole table."""
    if not outbox.published_index or not ids:
        return {}
    with conn.cursor(row_factory=dict_row) as cur:
        found = cur.execute(outbox.query("published_after"), {"ids": ids})
        return {row["id"]: int(row["after"]) for row in found}


def check_fence(conn: psycopg.Connection[Any], outbox: Outbox) -> None:
    """Refuse to poll a table handed over to ``stream``: stream marks no row processed, so
    a poller would publish again every event since. Read on every poller connection, after
    the outbox's lock is taken: a handover holds that lock exclusively until its fence is
    written, so no poller claims between a handover and its fence."""
    fence = handover_fence(conn, outbox)
    if fence is None:
        return
    at = fence["handed_over_at"]
    when = "" if at is None else f" at {at.isoformat(timespec='seconds')}"
    start = "its start" if fence["lsn"] is None else fence["lsn"]
    raise PreflightError(
        f"table {outbox.qualified} was handed over to stream (cdc-relay setup-slot "
        f"--from-poller){when}: slot {fence['slot']} relays every event committed after "
        f"{start}, and stream marks no row processed, so a poller would publish them all "
        f"again; run cdc-relay stream --slot {fence['slot']}, not poll (to poll the table "
        'again instead, follow docs/polling.md, "Back from stream to poll")'
    )


# -- what the commands beside the relay ask of it ---------------------------------------------


def counts(
    conn: psycopg.Connection[dict[str, Any]], table: OutboxTable, dead_letters: bool = True
) -> dict[str, int]:
    """The ``unprocessed`` rows of ``table`` and the ``dead_letters`` among them, for the
    progress line, the handover and ``cdc-relay status``; ``unprocessed`` alone when
    ``dead_letters`` is False (status, on a table without ``retry_after``, which marks them)."""
    query = sql.SQL(QUERIES["pending_counts" if dead_letters else "unprocessed_count"])
    return conn.execute(query.format(table=table.identifier)).fetchone() or {}


def pending_counts(conninfo: str, outbox: Outbox) -> dict[str, int] | None:
    """The outbox's unprocessed rows and dead letters; None when the database cannot say (the
    workers meet the same error and report it)."""
    try:
        with psycopg.connect(conninfo, autocommit=True, row_factory=dict_row) as conn:
            return counts(conn, outbox.table) or None
    except psycopg.DatabaseError:
        return None


def dead_letters(
    conn: psycopg.Connection[dict[str, Any]], outbox: Outbox, limit: int
) -> list[dict[str, Any]]:
    """The oldest ``limit`` rows the poller gave up on."""
    return conn.execute(outbox.query("dead_letters"), {"limit": limit}).fetchall()


def retry_dead_letters(
    conn: psycopg.Connection[dict[str, Any]], outbox: Outbox, ids: Sequence[str] | None
) -> list[str]:
    """Put dead letters (those of ``ids``, or all) back in the queue and wake the pollers, in
    one transaction; the ids queued again."""
    with conn.transaction():
        rows = conn.execute(
            outbox.query("retry_dead_letters"), {"ids": list(ids) if ids else None}
        ).fetchall()
        if rows:
            conn.execute(QUERIES["notify"], {"channel": outbox.channel})
    return [row["id"] for row in rows]


class PgClaims:
    """One worker's claims on the outbox (cdc_relay.relay.stages.Claims), on its own connection.

    The connection is made at the first transaction after start or after ``close``, and takes
    the outbox's advisory lock before its first claim. A database error propagates as
    psycopg raises it: what it means (retry, wait, stop) is the loop's to decide.
    """

    def __init__(self, conninfo: str, outbox: Outbox) -> None:
        self.conninfo = conninfo
        self.outbox = outbox
        self._conn: psycopg.Connection[Any] | None = None
        self._claim_aggregates = outbox.query("claim_aggregates")
        self._claim = outbox.query("claim")
        self._claim_skipped = outbox.query("claim_skipped")
        self._mark_processed = outbox.query("mark_processed")
        self._mark_failed = outbox.query("mark_failed")

    def open(self) -> None:
        """Connect, if not connected; a new connection takes the outbox's lock first."""
        self._connection()

    def _connection(self) -> psycopg.Connection[Any]:
        """The worker's connection; a new one takes the outbox's lock before its first claim."""
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(self.conninfo, autocommit=True, row_factory=class_row(OutboxRow))
            try:
                take_poll_lock(conn, self.outbox)
                check_fence(conn, self.outbox)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One cycle's transaction: committed at the end, rolled back on an exception (which
        releases every claim and lock it took)."""
        with self._connection().transaction():
            yield

    def _require(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            raise RuntimeError("a claim outside a transaction")
        return self._conn

    def claim_aggregates(self, limit: int, shard: int, shards: int, skip: list[int]) -> list[int]:
        # Two statements: the second's snapshot sees what the aggregates' last holders
        # committed before their locks came free (see claim_aggregates in queries.sql).
        with self._require().cursor(row_factory=dict_row) as cur:
            locked = cur.execute(
                self._claim_aggregates,
                {
                    "limit": limit,
                    "shard": shard,
                    "shards": shards,
                    "table_oid": self.outbox.table.oid,
                    "skip": skip,
                },
            ).fetchone()
        return list(locked["keys"]) if locked else []

    def claim(self, limit: int, keys: list[int]) -> list[OutboxRow]:
        return self._require().execute(self._claim, {"limit": limit, "keys": keys}).fetchall()

    def claim_skipped(self, keys: list[int], last: int, ids: list[str]) -> dict[int, int]:
        with self._require().cursor(row_factory=dict_row) as cur:
            return {
                row["key"]: row["seq"]
                for row in cur.execute(
                    self._claim_skipped, {"keys": keys, "last": last, "ids": ids}
                )
            }

    def published_after(self, ids: list[str]) -> dict[str, int]:
        return published_after(self._require(), self.outbox, ids)

    def lost(self) -> bool:
        """Whether the session is gone. PostgreSQL tells a session it ends (a FATAL message,
        then the socket closes), so the socket turns readable: read what is there, without
        blocking and without a query (which would restart idle_in_transaction_session_timeout
        and take the server's time)."""
        conn = self._conn
        if conn is None:
            return False
        if conn.closed:
            return True
        pgconn = conn.pgconn
        try:
            waiting = select.poll()  # not select(): no limit on the descriptor's number
            waiting.register(pgconn.socket, select.POLLIN)
            if waiting.poll(0):
                pgconn.consume_input()
        except (OSError, psycopg.OperationalError):
            return True
        return pgconn.status != pq.ConnStatus.OK

    def mark_processed(self, ids: list[str]) -> None:
        self._require().execute(self._mark_processed, {"ids": ids})

    def mark_failed(
        self,
        ids: list[str],
        errors: list[str],
        delays: list[float],
        own: list[bool],
        max_attempts: int,
    ) -> dict[str, dict[str, Any]]:
        params = {
            "ids": ids,
            "errors": errors,
            "delays": delays,
            "own": own,
            "max_attempts": max_attempts,
        }
        with self._require().cursor(row_factory=dict_row) as cur:
            return {r["id"]: r for r in cur.execute(self._mark_failed, params).fetchall()}

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class PgStore:
    """The outbox in PostgreSQL (cdc_relay.relay.stages.OutboxStore): each worker's claims, and the
    counts the progress line reports."""

    def __init__(self, conninfo: str, outbox: Outbox) -> None:
        self.conninfo = conninfo
        self.outbox = outbox

    def claims(self) -> PgClaims:
        return PgClaims(self.conninfo, self.outbox)

    def pending_counts(self) -> dict[str, int] | None:
        return pending_counts(self.conninfo, self.outbox)
