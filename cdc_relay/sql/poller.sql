-- What the polling relay (cdc-relay poll) adds to the outbox of schema outbox.
-- Apply once per database after it (idempotent): cdc-relay schema apply poller --dsn "$DSN".
-- The CDC relay (cdc-relay stream) needs none of it.

-- Wake the pollers when events are written, instead of waiting for their poll interval.
-- One notification per writing transaction: PostgreSQL folds identical ones together.
-- The channel is cdc_relay_ and the table's OID (the poller listens on the same): it fits
-- whatever the table's names (pg_notify refuses a channel of 64 bytes or more, which would
-- fail every INSERT) and follows the table through renames. Under very high commit rates the
-- notification queue's commit-time lock shows; then drop the trigger and poll more often.
-- PostgreSQL refuses to PREPARE a transaction that sent a notification: applications that
-- write events with two-phase commit drop the trigger too.
CREATE OR REPLACE FUNCTION outbox_events_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('cdc_relay_' || TG_RELID::text, '');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER outbox_events_notify
    AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_events_notify();

-- Each aggregate's published rows by seq: the poller (and the handover) look up whether a row
-- they are about to publish has a later row of its aggregate already published (its
-- transaction committed after that one went out), which they count as out of seq order
-- (docs/how-it-works.md, "Order per aggregate on each path"). Only rows marked processed are
-- in it, so an outbox relayed by stream, which marks none, keeps it empty. On a large table,
-- create it beforehand with CREATE INDEX CONCURRENTLY, so that writes are not blocked while it
-- is built.
CREATE INDEX IF NOT EXISTS outbox_events_published
    ON outbox_events (aggregate_type, aggregate_id, seq)
    WHERE processed_at IS NOT NULL;

-- Rows the poller gave up on: it failed to publish them --max-attempts times.
-- The poller parks them at retry_after = 'infinity'; `cdc-relay dead-letters retry`
-- puts them back in the queue.
CREATE OR REPLACE VIEW outbox_dead_letters AS
    SELECT id, seq, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at
    FROM outbox_events
    WHERE processed_at IS NULL AND retry_after = 'infinity';

-- Where `cdc-relay setup-slot --from-poller` fences the pollers off a table it hands over to
-- `cdc-relay stream`, which marks no row processed: a poller running afterwards (one frozen
-- through the handover, one an orchestrator starts again) would publish every event since
-- again. Every poller connection reads its table's row here, in the table's schema, and stops
-- on it. The handover writes the row before it makes its slot (lsn NULL: it fences only while
-- that slot exists, so a handover undone before it fences nothing) and sets lsn once the slot
-- is made: from then on the fence holds, slot or no slot. A way back to polling:
-- docs/polling.md, "Back from stream to poll".
CREATE TABLE IF NOT EXISTS cdc_relay_handovers (
    table_oid      oid         PRIMARY KEY,  -- the outbox table handed over
    table_name     text        NOT NULL,     -- its name at the handover
    slot           text        NOT NULL,     -- the slot stream relays it from
    lsn            pg_lsn,                   -- where that slot starts; NULL until it exists
    started_at     timestamptz NOT NULL DEFAULT now(),
    handed_over_at timestamptz
);
