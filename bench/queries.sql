-- The benchmark's SQL, as named queries (the format of cdc_relay/sql/queries.sql): each starts
-- with a "-- name --" line and a line of description. {placeholders} take identifiers.

-- insert_function --
-- Insert `count` events numbered from `first` in the caller's transaction; return their ids.
-- Both writers use it: every event has the same shape, about 150 bytes of JSON payload.
CREATE OR REPLACE FUNCTION bench_insert(count int, first bigint) RETURNS SETOF text
LANGUAGE sql AS $$
    INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
    SELECT t.aggregate_type,
           (random() * 999)::int::text,
           t.aggregate_type || '.changed',
           jsonb_build_object(
               'n', n,
               'customer', 'c' || lpad((random() * 9999)::int::text, 5, '0'),
               'total', round((random() * 1000)::numeric, 2)::text,
               'items', (SELECT jsonb_agg(jsonb_build_object(
                             'sku', 'sku-' || lpad((random() * 9999)::int::text, 4, '0'),
                             'qty', 1 + (random() * 2)::int))
                         FROM generate_series(1, 3) AS item))
    FROM generate_series(first, first + count - 1) AS n,
         LATERAL (SELECT (ARRAY['order', 'customer', 'payment'])[1 + n % 3]
                  AS aggregate_type) AS t
    RETURNING id::text
$$

-- backlog_procedure --
-- The backlog writer: `events` events in transactions of `per_transaction`, all server-side
CREATE OR REPLACE PROCEDURE bench_backlog(events bigint, per_transaction int)
LANGUAGE plpgsql AS $$
DECLARE
    done bigint := 0;
BEGIN
    WHILE done < events LOOP
        PERFORM bench_insert(least(per_transaction, events - done)::int, done);
        done := done + per_transaction;
        COMMIT;
    END LOOP;
END
$$

-- backlog --
-- Write the backlog
CALL bench_backlog(%(events)s, %(per_transaction)s)

-- insert_events --
-- One transaction's worth of the steady writer's events
SELECT * FROM bench_insert(%(count)s, %(first)s)

-- insert_warmup --
-- The warm-up event
INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
VALUES ('warmup', '0', 'warmup.changed', '{}')

-- wal_lsn --
-- The current end of WAL
SELECT pg_current_wal_lsn()::text AS lsn

-- wal_bytes_since --
-- WAL written since an LSN
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %(lsn)s::pg_lsn)::bigint AS bytes

-- event_ids --
-- Every event in the outbox but the warm-up event
SELECT id::text FROM outbox_events WHERE aggregate_type <> 'warmup'

-- create_publication --
-- A publication on the outbox table alone
CREATE PUBLICATION {publication} FOR TABLE outbox_events

-- create_slot --
-- A logical replication slot
SELECT lsn::text FROM pg_create_logical_replication_slot(%(slot)s, %(plugin)s)

-- slot_active --
-- Whether a process streams the slot
SELECT active FROM pg_replication_slots WHERE slot_name = %(slot)s

-- slot_sent_past --
-- Whether the walsender of a slot has sent everything up to an LSN
SELECT pg_wal_lsn_diff(r.sent_lsn, %(lsn)s::pg_lsn) >= 0 AS done
FROM pg_replication_slots s
JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.slot_name = %(slot)s

-- slot_confirmed_past --
-- Whether a slot's confirmed position has reached an LSN
SELECT pg_wal_lsn_diff(confirmed_flush_lsn, %(lsn)s::pg_lsn) >= 0 AS done
FROM pg_replication_slots
WHERE slot_name = %(slot)s

-- create_database --
-- A database for one trial
CREATE DATABASE {database}

-- terminate_sessions --
-- End the sessions of a database, walsenders included
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE datname = %(database)s AND pid <> pg_backend_pid()

-- database_slots --
-- The replication slots of a database
SELECT slot_name, active FROM pg_replication_slots WHERE database = %(database)s

-- drop_slot --
-- Drop a replication slot
SELECT pg_drop_replication_slot(%(slot)s)

-- drop_database --
-- Drop a trial's database
DROP DATABASE IF EXISTS {database} WITH (FORCE)

-- checkpoint --
-- Start every trial right after a checkpoint: the same full-page writes for every contestant
CHECKPOINT

-- server --
-- The server's version and the settings that shape the figures
SELECT name, current_setting(name) AS value FROM pg_settings
WHERE name IN ('server_version', 'wal_level', 'shared_buffers', 'max_wal_size',
               'checkpoint_timeout', 'fsync', 'synchronous_commit', 'wal_compression',
               'autovacuum', 'full_page_writes')
ORDER BY name
