-- server --
-- Server version and the settings logical replication depends on
SELECT current_setting('server_version_num')::int AS version_num,
       current_setting('server_version') AS version,
       current_setting('wal_level') AS wal_level,
       current_setting('max_replication_slots')::int AS max_slots,
       (SELECT count(*) FROM pg_replication_slots)::int AS slots_used,
       current_setting('max_wal_senders')::int AS max_senders,
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender')::int
           AS senders_used,
       current_database() AS database,
       current_user AS role

-- role --
-- Whether the current role may use replication connections and create publications
SELECT r.rolreplication OR r.rolsuper AS can_replicate,
       r.rolsuper AS superuser,
       has_database_privilege(current_database(), 'CREATE') AS can_create
FROM pg_roles r
WHERE r.rolname = current_user

-- table --
-- The outbox table, if it exists, and whether the current role owns it
SELECT format('%%I.%%I', n.nspname, c.relname) AS name,
       pg_has_role(c.relowner, 'USAGE') AS owned
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(%(table)s)

-- publication --
-- A publication by name, with what it publishes
SELECT p.puballtables AS all_tables,
       p.pubinsert AS inserts,
       array(SELECT format('%%I.%%I', t.schemaname, t.tablename)
             FROM pg_publication_tables t
             WHERE t.pubname = p.pubname
             ORDER BY 1) AS tables
FROM pg_publication p
WHERE p.pubname = %(publication)s

-- create_publication --
-- Publish only inserts of the outbox table: deletes by a cleaning job are not events
CREATE PUBLICATION {publication} FOR TABLE {table} WITH (publish = 'insert')

-- slot --
-- A replication slot by name, with its position and the WAL it holds back
SELECT s.plugin,
       s.slot_type,
       s.database,
       s.active,
       s.active_pid,
       s.confirmed_flush_lsn::text AS confirmed_flush_lsn,
       s.restart_lsn::text AS restart_lsn,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint AS retained_bytes
FROM pg_replication_slots s
WHERE s.slot_name = %(slot)s

-- create_slot --
-- A logical slot; waits for transactions running now to finish
SELECT lsn::text FROM pg_create_logical_replication_slot(%(slot)s, %(plugin)s)

-- drop_slot --
-- Remove the slot: the WAL it held is released
SELECT pg_drop_replication_slot(%(slot)s)

-- drop_publication --
DROP PUBLICATION IF EXISTS {publication}

-- emit_event --
-- One outbox event as a transactional logical decoding message (sql/outbox.sql)
SELECT outbox_emit(%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s, %(id)s,
                   %(prefix)s)

-- insert_event --
-- One outbox event, inside the caller's transaction
INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload)
VALUES (%(id)s, %(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s)

-- table_name --
-- The schema and name of a table as pgoutput's Relation messages spell them
SELECT n.nspname AS schema, c.relname AS name
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(%(table)s)

-- unprocessed_count --
-- Rows the polling relay has not processed yet
SELECT count(*)::bigint AS unprocessed FROM {table} WHERE processed_at IS NULL

-- dead_letter_view --
-- Whether the poller's dead-letter view exists
SELECT to_regclass('outbox_dead_letters') IS NOT NULL AS present

-- dead_letter_count --
SELECT count(*)::bigint AS dead_letters FROM outbox_dead_letters
