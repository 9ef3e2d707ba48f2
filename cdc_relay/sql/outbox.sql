-- The transactional outbox, as cdc-relay expects it.
-- Apply once per database (idempotent): cdc-relay schema apply outbox --dsn "$DSN", or
-- psql "$DSN" -f sql/outbox.sql in a checkout of the repository.
-- An application inserts one row per event in the same transaction as its business change.

CREATE TABLE IF NOT EXISTS outbox_events (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    -- insertion order; the polling relay publishes in this order
    seq            bigint      GENERATED ALWAYS AS IDENTITY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    attempts       integer     NOT NULL DEFAULT 0,
    retry_after    timestamptz,
    last_error     text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    processed_at   timestamptz
);

-- The polling relay's work queue: only rows not yet published, in insertion order.
CREATE INDEX IF NOT EXISTS outbox_events_unprocessed
    ON outbox_events (seq)
    WHERE processed_at IS NULL;

-- The polling relay's rows waiting out a backoff after a failed publish (few, if any): the
-- later rows of their aggregates wait for them.
CREATE INDEX IF NOT EXISTS outbox_events_retrying
    ON outbox_events (aggregate_type, aggregate_id, seq)
    WHERE processed_at IS NULL AND retry_after IS NOT NULL;

-- `cdc-relay prune` deletes old processed rows in batches, oldest first.
CREATE INDEX IF NOT EXISTS outbox_events_processed
    ON outbox_events (processed_at)
    WHERE processed_at IS NOT NULL;

-- Events `cdc-relay stream --dead-letter-topic` could not put on their topic (too large, not
-- authorised, invalid for the topic), with their whole content: the dead-letter topic carries
-- the content too when it fits, and this table always does, so no event exists nowhere.
-- A row per event, known by its id and its content: ids are unique per table only, and one
-- slot may relay several outbox tables, so two events may share an id and each keeps its own
-- row; the same event stored again (a replay) is the same row, with the latest reason.
CREATE TABLE IF NOT EXISTS cdc_relay_dead_letters (
    event_id       text        NOT NULL,
    topic          text        NOT NULL,  -- where the event should have gone
    key            bytea,
    value          bytea,
    headers        jsonb       NOT NULL,
    error_code     text        NOT NULL,
    error          text        NOT NULL,
    commit_lsn     pg_lsn      NOT NULL,
    slot           text        NOT NULL,
    dead_at        timestamptz NOT NULL DEFAULT now(),
    -- SHA-256 of topic, key, value and headers (cdc_relay/kafka/deadletter.py); empty when unknown
    content_sha256 bytea       NOT NULL DEFAULT '',
    PRIMARY KEY (event_id, content_sha256)
);
-- The same from a table made by an older version, keyed by event_id alone.
ALTER TABLE cdc_relay_dead_letters
    ADD COLUMN IF NOT EXISTS content_sha256 bytea NOT NULL DEFAULT '';
DO $$
DECLARE
    key_name name;
BEGIN
    SELECT c.conname INTO key_name
    FROM pg_constraint c
    WHERE c.conrelid = 'cdc_relay_dead_letters'::regclass AND c.contype = 'p'
      AND c.conkey = ARRAY[(SELECT attnum FROM pg_attribute
                            WHERE attrelid = c.conrelid AND attname = 'event_id')];
    IF key_name IS NOT NULL THEN
        EXECUTE format('ALTER TABLE cdc_relay_dead_letters DROP CONSTRAINT %I, '
                       'ADD PRIMARY KEY (event_id, content_sha256)', key_name);
    END IF;
END
$$;

-- A table-less outbox: the event travels in the WAL only, as a transactional logical
-- decoding message that the relay routes exactly like a row. Nothing is stored, so there is
-- nothing to clean up; the message is decoded only if the transaction commits.
-- SELECT outbox_emit('order', '42', 'order.created', '{"total": 10}');
CREATE OR REPLACE FUNCTION outbox_emit(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    id             uuid DEFAULT gen_random_uuid(),
    prefix         text DEFAULT 'outbox'
) RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    -- Envelope version 2: a NULL payload leaves "payload" out, so that the JSON value null
    -- ('null'::jsonb) reaches Kafka as the 4 bytes null, as it does from a row.
    SELECT pg_logical_emit_message(
        true,
        prefix,
        (jsonb_build_object(
            'v', 2,
            'id', id,
            'aggregate_type', aggregate_type,
            'aggregate_id', aggregate_id,
            'event_type', event_type
        ) || CASE WHEN payload IS NULL THEN '{}'::jsonb
                  ELSE jsonb_build_object('payload', payload) END)::text
    );
    SELECT id;
$$;

-- Every replication slot cdc-relay set up, and what its relays last saw (cdc_relay/postgres/lineage.py):
-- a slot that existed and is gone is never made anew without a word (setup-slot names what
-- would be skipped and asks for a remedy), and a publication changed while no relay ran is found
-- at start. setup-slot makes this table too when it is missing, from the statement below: keep
-- it the last of this file, after its name line.
-- slot_lineage --
CREATE TABLE IF NOT EXISTS cdc_relay_slots (
    slot           text        PRIMARY KEY,
    plugin         text        NOT NULL,
    system_id      text,                  -- the cluster it was made in (pg_control_system())
    timeline       integer,               -- the server's timeline then
    made           text        NOT NULL,  -- by what: setup-slot, --republish-since T, ...
    created_lsn    pg_lsn      NOT NULL,  -- where it started (or was found, if made before)
    created_at     timestamptz NOT NULL DEFAULT now(),
    -- The slot was confirmed at least this far (its relay moves it every 10 s or so), and the
    -- WAL had not passed it yet at confirmed_from: what commits after it commits later.
    confirmed_lsn  pg_lsn      NOT NULL,
    confirmed_from timestamptz,
    -- What makes the publication (NULL for wal2json) publish each outbox table, as catalog row
    -- identities, as its relay last verified them, at verified_lsn.
    publication    text,
    published      jsonb       NOT NULL DEFAULT '{}',
    verified_lsn   pg_lsn
);
