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
       current_user AS role,
       current_setting('server_encoding') AS encoding

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
-- Publish only inserts of the outbox tables: deletes by a cleaning job are not events. Rows of
-- a partitioned outbox are published as the root's, so the relay knows them whatever partition
-- holds them, partitions attached later included. {tables}: one outbox table, or several.
CREATE PUBLICATION {publication} FOR TABLE {tables}
    WITH (publish = 'insert', publish_via_partition_root = true)

-- outbox_table --
-- The outbox table by identity: its OID, its names now, and whether it is partitioned
SELECT c.oid::bigint AS oid, n.nspname AS schema, c.relname AS name,
       c.relkind = 'p' AS partitioned
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(%(table)s)

-- outbox_table_by_oid --
-- The same, found by OID after renames and schema moves; no row once it is dropped
SELECT c.oid::bigint AS oid, n.nspname AS schema, c.relname AS name,
       c.relkind = 'p' AS partitioned
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = %(oid)s::oid

-- coverage --
-- Whether the publication publishes inserts of the table itself (a partitioned table only with
-- publish_via_partition_root: otherwise its rows come under the names of its partitions).
-- pg_get_publication_tables gives OIDs, and needs no privilege on the tables' schemas.
SELECT p.pubinsert AS inserts,
       p.pubviaroot AS via_root,
       EXISTS (SELECT 1 FROM pg_get_publication_tables(p.pubname::text) AS g
               WHERE g.relid = %(oid)s::oid) AS covered
FROM pg_publication p
WHERE p.pubname = %(publication)s

-- published_part --
-- What of the table the publication publishes, when not all of it (PostgreSQL 15 and later):
-- its row filter (WHERE) as PostgreSQL prints it, NULL when it has none; the columns its
-- column list leaves out, empty when it has none (attrs: NULL on 15 without a list, and on
-- 16 and later the columns published)
SELECT pg_get_expr(g.qual, g.relid) AS filter,
       array(SELECT a.attname::text
             FROM pg_attribute a
             WHERE a.attrelid = g.relid AND a.attnum > 0 AND NOT a.attisdropped
               AND a.attgenerated = '' AND g.attrs IS NOT NULL
               AND a.attnum <> ALL (g.attrs::int2[])
             ORDER BY a.attnum) AS left_out
FROM pg_publication p, pg_get_publication_tables(p.pubname::text) AS g
WHERE p.pubname = %(publication)s AND g.relid = %(oid)s::oid

-- publication_identity --
-- What makes the publication publish each of the tables, as the catalog rows that say so, by
-- OID and xmin: the publication's own (its publish options), the table's entry in it (its row
-- filter and column list) and its schema's (FOR TABLES IN SCHEMA). A row made again has a new
-- OID and a row altered a new xmin, and neither comes back: the same identities at two looks
-- mean that nothing of it changed in between (cdc_relay/postgres/lineage.py). The rest is for people.
-- {schemas}: pg_publication_namespace, or on PostgreSQL 14 (which has none) a stand-in
SELECT t.oid::bigint AS oid,
       p.oid::bigint AS publication, p.xmin::text::bigint AS publication_xmin,
       r.oid::bigint AS entry, r.xmin::text::bigint AS entry_xmin,
       s.oid::bigint AS schema_entry, s.xmin::text::bigint AS schema_entry_xmin,
       concat_ws(', ', CASE WHEN p.pubinsert THEN 'insert' END,
                 CASE WHEN p.pubupdate THEN 'update' END, CASE WHEN p.pubdelete THEN 'delete' END,
                 CASE WHEN p.pubtruncate THEN 'truncate' END) AS publish,
       p.pubviaroot AS via_root, p.puballtables AS all_tables,
       to_jsonb(r) ->> 'prqual' IS NOT NULL AS filtered, to_jsonb(r) ->> 'prattrs' AS columns
FROM unnest(%(oids)s::oid[]) AS t(oid)
LEFT JOIN pg_class c ON c.oid = t.oid
LEFT JOIN pg_publication p ON p.pubname = %(publication)s
LEFT JOIN pg_publication_rel r ON r.prpubid = p.oid AND r.prrelid = t.oid
LEFT JOIN {schemas} AS s ON s.pnpubid = p.oid AND s.pnnspid = c.relnamespace
ORDER BY t.oid

-- published_besides --
-- The tables the publication publishes besides the given ones (a wal2json slot's outbox
-- tables, which it selects by name): empty when there are none, or no such publication
SELECT array(SELECT format('%%I.%%I', n.nspname, c.relname)
             FROM pg_publication p,
                  pg_get_publication_tables(p.pubname::text) AS g
                  JOIN pg_class c ON c.oid = g.relid
                  JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE p.pubname = %(publication)s AND g.relid <> ALL(%(oids)s::oid[])
             ORDER BY 1) AS tables

-- inheritors --
-- The tables that inherit from the given outbox tables, at any depth, besides those tables
-- (partitions are not among them: their rows come under their root's name). A SELECT of an
-- outbox table shows their rows, but logical decoding sends them under their own names, and
-- only if the publication publishes them, which a table made after the publication it does not.
-- `outbox`: the outbox table it descends from; `published`: whether the publication publishes
-- it (false when there is no such publication)
WITH RECURSIVE heirs (oid, outbox) AS (
    SELECT i.inhrelid, i.inhparent FROM pg_inherits i WHERE i.inhparent = ANY(%(oids)s::oid[])
  UNION
    SELECT i.inhrelid, h.outbox FROM pg_inherits i JOIN heirs h ON i.inhparent = h.oid
)
SELECT DISTINCT ON (c.oid)
       format('%%I.%%I', n.nspname, c.relname) AS name,
       format('%%I.%%I', pn.nspname, p.relname) AS outbox,
       EXISTS (SELECT 1
               FROM pg_publication pub, pg_get_publication_tables(pub.pubname::text) AS g
               WHERE pub.pubname = %(publication)s AND g.relid = c.oid) AS published
FROM heirs h
JOIN pg_class c ON c.oid = h.oid
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_class p ON p.oid = h.outbox
JOIN pg_namespace pn ON pn.oid = p.relnamespace
WHERE NOT c.relispartition AND c.oid <> ALL(%(oids)s::oid[])
ORDER BY c.oid

-- create_shard_publication --
-- A shard's publication: create_publication's, with the shard's row filter on each table
-- ({tables}: `table WHERE (filter)`, one or several)
CREATE PUBLICATION {publication} FOR TABLE {tables}
    WITH (publish = 'insert', publish_via_partition_root = true)

-- emit_cut --
-- A resharding cut: a transactional logical decoding message every slot decodes at the same
-- place among the transactions (cdc_relay/postgres/shards.py); returns its position
SELECT pg_logical_emit_message(true, %(prefix)s, %(content)s)::text AS lsn

-- slots_confirmed --
-- How far the named slots are confirmed (a new shard waits for the old ones at the cut)
SELECT slot_name, confirmed_flush_lsn::text AS confirmed
FROM pg_replication_slots
WHERE slot_name = ANY(%(slots)s::text[])

-- publication_comment --
-- The comment on a publication (reshard notes there where a new shard starts)
SELECT obj_description(p.oid, 'pg_publication') AS comment
FROM pg_publication p
WHERE p.pubname = %(publication)s

-- cut_comments --
-- The comments of the publications that publish any of the given tables (OIDs): reshard notes
-- on each new shard's publication the cut it starts after and where the cut's message is. Only
-- a publication's owner may comment on it, and only an owner of a table (or a superuser) may
-- publish the table, so these are the word of the outbox's owner, not of any role that may emit
-- a message
SELECT obj_description(p.oid, 'pg_publication') AS comment
FROM pg_publication p
WHERE obj_description(p.oid, 'pg_publication') IS NOT NULL
  AND EXISTS (SELECT 1 FROM pg_get_publication_tables(p.pubname::text) AS g
              WHERE g.relid = ANY(%(oids)s::oid[]))

-- slots_named_after --
-- The replication slots whose names are the given one and an underscore, then anything: the
-- shards' slots of a base name (`base_KofN`), of every shard count
SELECT slot_name::text AS slot_name
FROM pg_replication_slots
WHERE left(slot_name::text, length(%(base)s) + 1) = %(base)s || '_'
ORDER BY 1

-- emit_message_privileges --
-- Who may run pg_logical_emit_message, which writes a logical decoding message into the WAL
-- every slot decodes: a row per overload (text and bytea content; PostgreSQL 17 added `flush`
-- to both), named as GRANT and REVOKE take it. `public`: PUBLIC may (the default, in every new
-- database). `others`: the roles that may, through PUBLIC, a grant, or a role they belong to,
-- and are neither superusers (who may run anything) nor writers (members of a role `writers`
-- names). `grantees`: the roles its ACL grants EXECUTE that are neither, to revoke it from.
-- `ungranted`: the writers `writers` names that exist, are no superusers and would not keep it
-- through a grant to themselves or to a writer role they belong to, to grant it to. Those two
-- quoted as identifiers, for the statements. `writers`: those of `writers` that exist.
WITH fn AS (
    SELECT p.oid, p.oid::regprocedure::text AS signature,
           coalesce(p.proacl, acldefault('f', p.proowner)) AS acl
    FROM pg_proc p
    WHERE p.proname = 'pg_logical_emit_message'
      AND p.pronamespace = 'pg_catalog'::regnamespace
), writer AS (
    SELECT r.oid FROM pg_roles r WHERE r.rolname = ANY(%(writers)s::text[])
), role AS (
    SELECT r.oid, r.rolname::text AS name, r.rolsuper AS superuser,
           EXISTS (SELECT 1 FROM writer w WHERE pg_has_role(r.oid, w.oid, 'MEMBER')) AS writer
    FROM pg_roles r
)
SELECT fn.signature,
       EXISTS (SELECT 1 FROM aclexplode(fn.acl) AS a
               WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE') AS public,
       array(SELECT r.name FROM role r
             WHERE NOT r.superuser AND NOT r.writer
               AND has_function_privilege(r.oid, fn.oid, 'EXECUTE')
             ORDER BY 1) AS others,
       array(SELECT quote_ident(r.name)
             FROM aclexplode(fn.acl) AS a JOIN role r ON r.oid = a.grantee
             WHERE a.privilege_type = 'EXECUTE' AND NOT r.superuser AND NOT r.writer
             ORDER BY 1) AS grantees,
       array(SELECT quote_ident(r.name) FROM writer w JOIN role r ON r.oid = w.oid
             WHERE NOT r.superuser
               AND NOT EXISTS (SELECT 1 FROM aclexplode(fn.acl) AS a JOIN role g
                                   ON g.oid = a.grantee
                               WHERE a.privilege_type = 'EXECUTE' AND g.writer
                                 AND pg_has_role(r.oid, g.oid, 'USAGE'))
             ORDER BY 1) AS ungranted,
       array(SELECT r.name FROM writer w JOIN role r ON r.oid = w.oid ORDER BY 1) AS writers
FROM fn
ORDER BY fn.signature

-- bytea_types --
-- bytea and every domain over it, however deep: their values are sent as bytea's text
WITH RECURSIVE b(oid) AS (
    SELECT 'bytea'::regtype::oid
    UNION
    SELECT t.oid FROM pg_type t JOIN b ON t.typbasetype = b.oid WHERE t.typtype = 'd'
)
SELECT array_agg(oid::bigint) AS oids FROM b

-- wal_lsn --
-- The WAL insert position now; on a standby (decoding there, PostgreSQL 16+), the position it
-- has replayed up to, which is as far as its walsenders decode. `at`: the statement's start,
-- when the WAL had not passed that position yet
SELECT coalesce(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                     ELSE pg_current_wal_lsn() END, '0/0')::text AS lsn,
       now() AS at, pg_is_in_recovery() AS standby

-- store_dead_letter --
-- An event Kafka refused for good, with its content, before the slot moves past it
INSERT INTO cdc_relay_dead_letters
    (event_id, topic, key, value, headers, error_code, error, commit_lsn, slot, content_sha256)
VALUES (%(event_id)s, %(topic)s, %(key)s, %(value)s, %(headers)s, %(error_code)s, %(error)s,
        %(commit_lsn)s::pg_lsn, %(slot)s, %(content_sha256)s)
ON CONFLICT (event_id, content_sha256) DO UPDATE
SET error_code = excluded.error_code, error = excluded.error, dead_at = now()

-- dead_letter_table --
-- Whether the stream's dead-letter table exists and this role may write it, and whether it
-- is keyed by content too (an older schema outbox keyed it by event id alone)
SELECT to_regclass('cdc_relay_dead_letters') IS NOT NULL
       AND has_table_privilege('cdc_relay_dead_letters', 'INSERT, UPDATE') AS writable,
       EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass('cdc_relay_dead_letters')
                 AND attname = 'content_sha256' AND NOT attisdropped) AS current

-- slot --
-- A replication slot by name, with its position and the WAL it holds back (on a standby, up to
-- the position it has replayed). `invalidated` says why PostgreSQL gave up on the slot, NULL
-- while it is usable: invalidation_reason on 17+ (idle_timeout on 18), before that `conflicting`
-- on a standby (16) and wal_status 'lost' (max_slot_wal_keep_size); read through to_jsonb,
-- so that one query serves every version. safe_wal_size: WAL that may still be written before
-- the slot is at risk (NULL without max_slot_wal_keep_size, and once lost). `failover`: a
-- failover slot (17+); `synced`: on a standby, a copy slot synchronisation keeps of the
-- primary's (17+); `temporary`: a session's slot, or a copy the standby has not made
-- persistent yet (a promotion drops it).
SELECT s.plugin,
       s.slot_type,
       s.database,
       s.active,
       s.active_pid,
       s.confirmed_flush_lsn::text AS confirmed_flush_lsn,
       s.restart_lsn::text AS restart_lsn,
       pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                            ELSE pg_current_wal_lsn() END, s.restart_lsn)::bigint AS retained_bytes,
       s.wal_status,
       s.safe_wal_size::bigint AS safe_wal_bytes,
       coalesce(to_jsonb(s) ->> 'invalidation_reason',
                CASE WHEN (to_jsonb(s) ->> 'conflicting')::bool THEN 'rows_removed' END,
                CASE WHEN s.wal_status = 'lost' THEN 'wal_removed' END) AS invalidated,
       coalesce((to_jsonb(s) ->> 'failover')::bool, false) AS failover,
       coalesce((to_jsonb(s) ->> 'synced')::bool, false) AS synced,
       s.temporary
FROM pg_replication_slots s
WHERE s.slot_name = %(slot)s

-- standby --
-- Whether the server is a standby, and what decoding there (PostgreSQL 16+) needs of it
SELECT pg_is_in_recovery() AS standby,
       current_setting('hot_standby_feedback')::bool AS hot_standby_feedback,
       current_setting('primary_slot_name') AS primary_slot_name

-- create_slot --
-- A logical slot; waits for transactions running now to finish
SELECT lsn::text FROM pg_create_logical_replication_slot(%(slot)s, %(plugin)s)

-- drop_slot --
-- Remove the slot: the WAL it held is released
SELECT pg_drop_replication_slot(%(slot)s)

-- drop_publication --
DROP PUBLICATION IF EXISTS {publication}

-- emit_event --
-- One outbox event as a transactional logical decoding message (outbox_emit() of schema outbox)
SELECT outbox_emit(%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s, %(id)s,
                   %(prefix)s)

-- insert_event --
-- One outbox event, inside the caller's transaction
INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload)
VALUES (%(id)s, %(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s)

-- unprocessed_count --
-- Rows the polling relay has not processed yet
SELECT count(*)::bigint AS unprocessed FROM {table} WHERE processed_at IS NULL

-- poll_columns --
-- Columns the polling relay needs that the outbox table lacks
SELECT array(
    SELECT unnest(ARRAY['id', 'seq', 'aggregate_type', 'aggregate_id', 'event_type', 'payload',
                        'attempts', 'retry_after', 'last_error', 'processed_at'])
    EXCEPT
    SELECT attname::text FROM pg_attribute
    WHERE attrelid = %(oid)s::oid AND attnum > 0 AND NOT attisdropped
) AS missing

-- poll_trigger --
-- Whether a trigger of schema poller notifies the pollers of new rows in the table, and
-- whether it is this version's, which names the channel by the table's OID (an older one
-- named it by the table's names: the poller no longer listens there)
SELECT coalesce(bool_or(true), false) AS present,
       coalesce(bool_or(p.prosrc LIKE '%%TG_RELID%%'), false) AS current
FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
WHERE t.tgrelid = %(oid)s::oid AND p.proname = 'outbox_events_notify'

-- listen --
LISTEN {channel}

-- notify --
-- Wake the pollers (schema poller's trigger does the same on insert)
SELECT pg_notify(%(channel)s, '')

-- claim_aggregates --
-- A claim's first step: walk the rows to publish, oldest first, and lock the aggregates of the
-- next `limit` of them for the rest of the transaction; returns the lock keys it got. A row
-- whose aggregate another poller (of this process or another) is publishing is walked past:
-- one transaction at a time publishes an aggregate, so its rows go out in order even with many
-- pollers. Rows waiting out a backoff and dead letters (retry_after = 'infinity') are not
-- due, nor are the rows behind a row of their aggregate that waits. Worker `shard` of
-- `shards` takes only its share of the aggregates (int4eq() rather than `=`: the planner then
-- guesses a third of the rows pass, not one in 200, and keeps walking the index in seq order
-- instead of sorting the whole backlog). The key is a hash of the aggregate: two aggregates
-- that share one are published one after the other, never out of order. Type and id are read
-- as text (a user's enum, uuid or integer column hashes as its text, as `||` made it), and a
-- NULL as '': the row is claimed, and one without a type is refused as its own fault (a dead
-- letter), never left unclaimed without a word. `skip`: the keys of
-- the aggregates the worker's last claim found held up by a row another transaction locks
-- (claim_skipped), walked past this once.
-- The locks are tried outside the ordered subquery (OFFSET 0 keeps the planner from merging
-- the two, and a volatile condition is never pushed into it), on the rows it hands out in seq
-- order until `limit` got one: inside, a plan that sorts would try a lock on every row before
-- the first comes out, and hold every aggregate of the backlog. The waiting test comes first
-- (CASE), so only a row otherwise due takes a lock: a transaction holds at most `limit` (the
-- poller checks at start that PostgreSQL's lock table has room for them).
SELECT coalesce(array_agg(DISTINCT d.key), '{{}}') AS keys
FROM (
    SELECT head.key
    FROM (
        SELECT t.seq, t.aggregate_type, t.aggregate_id,
               {lock_key} AS key
        FROM {table} AS t
        WHERE t.processed_at IS NULL
          AND (t.retry_after IS NULL OR t.retry_after <= now())
          AND int4eq(mod(hashtext(coalesce(t.aggregate_id::text, '')) & 2147483647, %(shards)s),
                     %(shard)s)
          AND {lock_key} <> ALL(%(skip)s::int4[])
        ORDER BY t.seq
        OFFSET 0
    ) AS head
    WHERE CASE WHEN EXISTS (
                   SELECT 1 FROM {table} AS w
                   WHERE w.processed_at IS NULL AND w.retry_after > now()
                     AND w.retry_after < 'infinity'
                     AND w.aggregate_type = head.aggregate_type
                     AND w.aggregate_id = head.aggregate_id
                     AND w.seq < head.seq)
               THEN false
               ELSE pg_try_advisory_xact_lock(%(table_oid)s::oid::int4, head.key)
          END
    LIMIT %(limit)s
) AS d

-- claim --
-- A claim's second step, in a new snapshot taken once the aggregates are locked (so what the
-- previous holder of each committed is seen): the next rows of those aggregates, oldest first,
-- due as in claim_aggregates, locked until the transaction ends. Only a poller holding an
-- aggregate's key locks its rows, so a row locked by anything else (a transaction deleting or
-- updating it, maybe a prepared one, which holds its locks until COMMIT or ROLLBACK PREPARED,
-- however long that takes) is not waited for: it is skipped, and claim_skipped tells the
-- poller which aggregates lost a row so, since the rows behind it must not go first.
-- {payload} is payload_bytes or payload_text, chosen by the column's type at start; its type
-- comes along, so a column retyped while the poller runs is noticed before a row is published.
-- {created_at} is created_at_text or no_created_at, {payload_kind} the kind of the payload
-- column (routing needs both for --cloudevents); {trace} is trace_text (--trace-column) or
-- nothing.
SELECT t.id::text AS id, t.aggregate_type, t.aggregate_id, t.event_type,
       {payload} AS payload, pg_typeof(t.payload)::oid AS payload_type, t.attempts,
       {created_at} AS created_at, {payload_kind} AS payload_kind, t.seq,
       {lock_key} AS key{trace}
FROM {table} AS t
WHERE t.processed_at IS NULL
  AND (t.retry_after IS NULL OR t.retry_after <= now())
  AND {lock_key} = ANY(%(keys)s::int4[])
  AND NOT EXISTS (
      SELECT 1 FROM {table} AS w
      WHERE w.processed_at IS NULL AND w.retry_after > now() AND w.retry_after < 'infinity'
        AND w.aggregate_type = t.aggregate_type AND w.aggregate_id = t.aggregate_id
        AND w.seq < t.seq)
ORDER BY t.seq
LIMIT %(limit)s
FOR UPDATE OF t SKIP LOCKED

-- claim_skipped --
-- After claim, in the same transaction: for each of the claimed aggregates (their keys), the
-- first row due before the last row claimed that claim did not return, locked by another
-- transaction (or committed since claim's snapshot). The poller publishes none of that
-- aggregate's rows from there on, and walks past the aggregate in its next claim, so that
-- the other aggregates are not held up behind it.
SELECT {lock_key} AS key,
       min(t.seq) AS seq
FROM {table} AS t
WHERE t.processed_at IS NULL
  AND (t.retry_after IS NULL OR t.retry_after <= now())
  AND {lock_key} = ANY(%(keys)s::int4[])
  AND t.seq < %(last)s
  AND t.id <> ALL(%(ids)s::uuid[])
GROUP BY 1

-- published_index --
-- Whether an index serves published_after (schema poller's outbox_events_published, or one
-- like it): on aggregate_type, aggregate_id and seq first, over every row or the processed
-- ones. Without one, each look-up would read the whole table
SELECT EXISTS (
    SELECT 1 FROM pg_index i
    WHERE i.indrelid = %(oid)s::oid AND i.indisvalid
      AND (i.indkey::int2[])[0:2] = ARRAY(
          SELECT a.attnum
          FROM unnest(ARRAY['aggregate_type', 'aggregate_id', 'seq']) WITH ORDINALITY AS c(name, n)
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attname = c.name
          ORDER BY c.n)
      AND (i.indpred IS NULL
           OR pg_get_expr(i.indpred, i.indrelid) = '(processed_at IS NOT NULL)')
) AS present

-- published_after --
-- Of the rows `ids`, those whose aggregate has a row of a higher seq already published
-- (processed): each one's transaction committed after that row went out, and it goes out after
-- it, out of seq order. `after`: the highest such seq. One probe of published_index a row
SELECT t.id::text AS id, l.seq AS after
FROM {table} AS t
CROSS JOIN LATERAL (
    SELECT p.seq FROM {table} AS p
    WHERE p.processed_at IS NOT NULL
      AND p.aggregate_type = t.aggregate_type AND p.aggregate_id = t.aggregate_id
      AND p.seq > t.seq
    ORDER BY p.seq DESC
    LIMIT 1
) AS l
WHERE t.id = ANY(%(ids)s::uuid[])

-- mark_processed --
-- Rows Kafka acknowledged, in one statement, found by primary key (a condition on
-- processed_at could lure the planner onto the partial index of every unprocessed row)
UPDATE {table} SET processed_at = now()
WHERE id = ANY(%(ids)s::uuid[])

-- mark_failed --
-- Rows Kafka refused: one more attempt counted, due again after their backoff; a row out of
-- attempts whose failure was its own (batch.py: refused alone, or by the client) is
-- parked as a dead letter; one refused among others is tried again, alone. The backoff counts
-- from now, the failure (clock_timestamp()), not from the claim (now(), the transaction's
-- start: a batch may have waited long for Kafka, and the wait would be over already)
UPDATE {table} AS t
SET attempts = t.attempts + 1,
    last_error = f.error,
    retry_after = CASE WHEN f.own AND t.attempts + 1 >= %(max_attempts)s
                       THEN 'infinity'::timestamptz
                       ELSE clock_timestamp() + make_interval(secs => f.delay) END
FROM unnest(%(ids)s::uuid[], %(errors)s::text[], %(delays)s::float8[], %(own)s::bool[])
     AS f(id, error, delay, own)
WHERE t.id = f.id
RETURNING t.id::text AS id, t.attempts, t.retry_after = 'infinity' AS dead

-- pending_counts --
-- Rows not yet published, and how many of them are dead letters
SELECT count(*)::bigint AS unprocessed,
       count(*) FILTER (WHERE retry_after = 'infinity')::bigint AS dead_letters
FROM {table}
WHERE processed_at IS NULL

-- dead_letters --
-- Rows the poller gave up on, oldest first
SELECT id::text AS id, aggregate_type, aggregate_id, event_type, attempts, last_error,
       created_at
FROM {table}
WHERE processed_at IS NULL AND retry_after = 'infinity'
ORDER BY seq
LIMIT %(limit)s

-- retry_dead_letters --
-- Put dead letters back in the queue (all of them when ids is NULL); last_error stays
UPDATE {table} SET attempts = 0, retry_after = NULL
WHERE processed_at IS NULL AND retry_after = 'infinity'
  AND (%(ids)s::uuid[] IS NULL OR id = ANY(%(ids)s::uuid[]))
RETURNING id::text AS id

-- prune_before --
-- The cut-off of a prune: processed before this moment
SELECT now() - %(age)s::interval AS before

-- prune --
-- Delete up to `limit` processed rows older than the cut-off, oldest first. The condition is
-- checked again on each row the DELETE reaches by ctid: a ctid names a row of one table, and
-- each partition of a partitioned outbox has rows at the same ctids.
DELETE FROM {table}
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {table}
    WHERE processed_at < %(before)s
    ORDER BY processed_at
    LIMIT %(limit)s
))
  AND processed_at < %(before)s

-- snapshot_xmin --
-- The oldest transaction running now, as a 64-bit id (xid8): every transaction with a lower id
-- has ended, committed or rolled back (horizon.py)
SELECT pg_snapshot_xmin(pg_current_snapshot())::text AS xmin

-- wal_insert_lsn --
-- The WAL insert position now: past every record already inserted, the commit record of every
-- transaction that has ended included, flushed or not (synchronous_commit = off)
SELECT pg_current_wal_insert_lsn()::text AS lsn

-- advance_wal --
-- An empty transaction with an id: its commit record follows every position read before, and
-- the WAL writer flushes it soon, so that a slot can pass those positions on an idle database
SELECT pg_current_xact_id()

-- in_recovery --
-- Whether the server is a standby, which has no WAL insert position of its own
SELECT pg_is_in_recovery() AS standby

-- confirmed_row --
-- Whether row t was inserted by a transaction whose id precedes `xmin` (the low 32 bits of a
-- horizon's snapshot xmin): t.xmin - xmin, modulo 2^32, is negative as a signed 32-bit number.
-- PostgreSQL compares its 32-bit ids so; exact for ids under 2^31 apart (horizon.py).
((t.xmin::text::bigint - %(xmin)s::bigint) & 4294967295) >= 2147483648

-- prune_confirmed --
-- Delete up to `limit` rows created before the cut-off whose transaction the slot has
-- confirmed ({confirmed}: confirmed_row). The condition is checked again on each row the
-- DELETE reaches by ctid: a ctid names a row of one table, and each partition of a partitioned
-- outbox has rows at the same ctids.
DELETE FROM {table} AS t
WHERE t.ctid = ANY(ARRAY(
    SELECT t.ctid FROM {table} AS t
    WHERE t.created_at < %(before)s AND {confirmed}
    LIMIT %(limit)s
))
  AND t.created_at < %(before)s AND {confirmed}

-- confirmed_counts --
-- The outbox's rows whose transaction the slot has confirmed ({confirmed}: confirmed_row), and
-- the others
SELECT count(*) FILTER (WHERE {confirmed})::bigint AS confirmed,
       count(*) FILTER (WHERE NOT {confirmed})::bigint AS unconfirmed
FROM {table} AS t

-- created_at_column --
-- Whether the table has the created_at column prune --slot reads a row's age from
SELECT EXISTS (
    SELECT 1 FROM pg_attribute
    WHERE attrelid = %(oid)s::oid AND attname = 'created_at' AND attnum > 0 AND NOT attisdropped
) AS present

-- pollers --
-- Other sessions holding the advisory lock of the outbox table (poll_lock): pollers hold it
-- shared, a handover exclusive
SELECT l.pid, l.mode = 'ExclusiveLock' AS handover
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %(lock_class)s::int4::oid AND l.objid = %(table)s::oid AND l.objsubid = 2
  AND l.pid <> pg_backend_pid()
ORDER BY l.pid

-- set_snapshot --
-- Read as of a snapshot another session exported (first statement of the transaction)
SET TRANSACTION SNAPSHOT {snapshot}

-- unprocessed --
-- Every row not yet published, oldest first, as of the transaction's snapshot; {payload},
-- {created_at}, {payload_kind} and {trace} as in claim
SELECT t.id::text AS id, t.aggregate_type, t.aggregate_id, t.event_type,
       {payload} AS payload, pg_typeof(t.payload)::oid AS payload_type, t.attempts,
       {created_at} AS created_at, {payload_kind} AS payload_kind, t.seq{trace}
FROM {table} AS t
WHERE t.processed_at IS NULL
ORDER BY t.seq

-- republish --
-- Every row created at or after `since`, and every one whose created_at is NULL (its age is
-- unknown: sent rather than risked), oldest first, as of the transaction's snapshot. The inner
-- SELECT names the columns of --column as the fields ({id}, ...: identifiers), and reads the
-- --header-column values ({header_values}: header_value, each after a comma) that the outer
-- one passes on ({headers}); a table without the poller's columns has no attempts.
-- {payload}, {created_at}, {payload_kind} and {trace} as in claim; {trace_column} passes the
-- --trace-column on (nothing without one).
SELECT t.id, t.aggregate_type, t.aggregate_id, t.event_type,
       {payload} AS payload, pg_typeof(t.payload)::oid AS payload_type, 0 AS attempts,
       {created_at} AS created_at, {payload_kind} AS payload_kind{trace}{headers}
FROM (SELECT s.{id}::text AS id, s.{aggregate_type}::text AS aggregate_type,
             s.{aggregate_id}::text AS aggregate_id, s.{event_type}::text AS event_type,
             s.{payload_column} AS payload, s.created_at, s.seq{trace_column}{header_values}
      FROM {table} AS s) AS t
WHERE t.created_at >= %(since)s::timestamptz OR t.created_at IS NULL
ORDER BY t.seq

-- trace_text --
-- The --trace-column of a row, after a comma: its text, as pgoutput sends it (NULL: none)
, t.{column}::text AS trace

-- header_value --
-- A --header-column of a republish: its text in the database's encoding, the bytes pgoutput
-- sends (NULL: no header)
convert_to(s.{column}::text, getdatabaseencoding()) AS {alias}

-- republish_columns --
-- Which of the columns `columns` the outbox table lacks (the republish's, --trace-column)
SELECT array(
    SELECT unnest(%(columns)s::text[])
    EXCEPT
    SELECT attname::text FROM pg_attribute
    WHERE attrelid = %(oid)s::oid AND attnum > 0 AND NOT attisdropped
) AS missing

-- since --
-- The moment a --republish-since age (an interval) points at, and now, by the server's clock
SELECT coalesce(%(at)s::timestamptz, now() - %(age)s::interval) AS since, now() AS now

-- claim_event --
-- Record that a consumer handles an event; no row back when it was handled before
INSERT INTO processed_events (consumer, event_id)
VALUES (%(consumer)s, %(event_id)s)
ON CONFLICT DO NOTHING
RETURNING event_id

-- The polling relay's payload expression, its advisory lock, the handover's slot.

-- poll_payload --
-- The payload column of the outbox table (named `payload` but where --column maps it): its
-- declared type, and whether that is bytea or a domain over it (the poller chooses
-- payload_bytes or payload_text by it, once); and the declared type of its created_at column,
-- if it has one
WITH RECURSIVE payload (declared, type) AS (
    SELECT a.atttypid, a.atttypid
    FROM pg_attribute a
    WHERE a.attrelid = %(oid)s::oid AND a.attname = %(payload)s AND NOT a.attisdropped
  UNION ALL
    SELECT p.declared, t.typbasetype
    FROM payload p JOIN pg_type t ON t.oid = p.type
    WHERE t.typtype = 'd'
)
SELECT (SELECT declared::bigint FROM payload LIMIT 1) AS payload_type,
       coalesce((SELECT bool_or(type = 'bytea'::regtype) FROM payload), false) AS payload_bytea,
       (SELECT a.atttypid::bigint FROM pg_attribute a
        WHERE a.attrelid = %(oid)s::oid AND a.attname = 'created_at' AND NOT a.attisdropped)
           AS created_at_type

-- payload_bytes --
-- The payload of a bytea column, for claim and unprocessed: the bytes as stored
t.payload

-- payload_text --
-- The payload of any other column (text, json, jsonb, ...), for claim and unprocessed: its
-- text in the database's encoding, the bytes pgoutput sends
convert_to(t.payload::text, getdatabaseencoding())

-- lock_key --
-- The key of a row's aggregate, for claim_aggregates, claim and claim_skipped (each takes it as
-- {lock_key}): a hash of its type and id read as text, a NULL as '' (claim_aggregates says why)
hashtext(coalesce(t.aggregate_type::text, '') || '/' || coalesce(t.aggregate_id::text, ''))

-- created_at_text --
-- A created_at column of a timestamp type, for claim and unprocessed: its ISO 8601 text
-- whatever the session's DateStyle (ce_time of --cloudevents is made from it)
to_jsonb(t.created_at) #>> '{}'

-- no_created_at --
-- The same for a table without such a column
NULL::text

-- lock_room --
-- Entries of PostgreSQL's shared lock table (at least: background processes add some)
SELECT current_setting('max_locks_per_transaction')::bigint
       * (current_setting('max_connections')::bigint
          + current_setting('max_prepared_transactions')::bigint) AS room

-- poll_lock --
-- Taken by every poller connection before its first claim and held while the session lasts
-- (session-level, shared: pollers run side by side; a handover takes it exclusive)
SELECT pg_try_advisory_lock_shared(%(lock_class)s::int4, %(table)s::oid::int4) AS locked

-- handover_fences --
-- Whether the outbox table's schema has schema poller's table of handovers
SELECT to_regclass(format('%%I.cdc_relay_handovers', %(schema)s::text)) IS NOT NULL AS present

-- handover_fence --
-- The handover that took the outbox table over to stream, or is taking it over: its slot,
-- where the slot starts (NULL until it is made) and whether it exists now
SELECT f.table_name, f.slot, f.lsn::text AS lsn, f.handed_over_at,
       EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.slot_name = f.slot) AS slot_exists
FROM {fences} AS f
WHERE f.table_oid = %(oid)s::oid

-- fence_pollers --
-- The handover's fence, before it makes its slot (a fence of an earlier handover that was
-- undone is replaced)
INSERT INTO {fences} (table_oid, table_name, slot)
VALUES (%(oid)s::oid, %(table_name)s, %(slot)s)
ON CONFLICT (table_oid) DO UPDATE
SET table_name = excluded.table_name, slot = excluded.slot, lsn = NULL, started_at = now(),
    handed_over_at = NULL

-- handed_over --
-- The handover's slot is made: the fence holds from now on, whatever becomes of the slot
UPDATE {fences} SET lsn = %(lsn)s::pg_lsn, handed_over_at = now()
WHERE table_oid = %(oid)s::oid

-- handover_lock --
-- Held by the handover from its checks to its end: no poller claims meanwhile
SELECT pg_try_advisory_lock(%(lock_class)s::int4, %(table)s::oid::int4) AS locked

-- copy_slot --
-- The handover's temporary slot copied to a permanent one, at the same position
SELECT lsn::text AS lsn FROM pg_copy_logical_replication_slot(%(source)s, %(slot)s, false)

-- The outbox schema (cdc_relay/schema.py): `cdc-relay schema apply`, `setup-slot --create-table`.

-- schema_lock --
-- Held while a schema is applied: two set-ups at once take turns instead of racing
SELECT pg_advisory_xact_lock(hashtext('cdc_relay.schema'))

-- schema_path --
-- Make the schema's objects in this schema, until the transaction ends
SELECT set_config('search_path', %(path)s, true)

-- table_parts --
-- A table name as PostgreSQL reads it (quotes, case), and the schema an unqualified one
-- would be created in
SELECT parse_ident(%(table)s) AS parts, current_schema() AS current

-- `cdc-relay trace` (cdc_relay/ops/trace.py): where one event is; reads only.

-- trace_row --
-- One outbox row by id, all its columns as JSON; its commit time when PostgreSQL keeps them
-- (track_commit_timestamp = on), and its created_at
SELECT to_jsonb(t) AS row,
       CASE WHEN current_setting('track_commit_timestamp')::bool
            THEN pg_xact_commit_timestamp(t.xmin) END AS commit_time,
       (to_jsonb(t) ->> 'created_at')::timestamptz AS created_at
FROM {table} AS t
WHERE t.id = %(id)s::uuid

-- trace_dead_letters --
-- Whether the stream's dead-letter table exists and this role may read it
SELECT to_regclass('cdc_relay_dead_letters') IS NOT NULL
       AND has_table_privilege('cdc_relay_dead_letters', 'SELECT') AS present

-- trace_dead_letter --
-- The event in the stream's dead-letter table
SELECT topic, key, error_code, error, commit_lsn::text AS commit_lsn, slot, dead_at
FROM cdc_relay_dead_letters
WHERE event_id = %(id)s

-- trace_copy_slot --
-- A temporary copy of the slot at its position (dropped with the session at the latest):
-- reading it leaves the slot, and a relay streaming it, as they are
SELECT lsn::text AS lsn FROM pg_copy_logical_replication_slot(%(slot)s, %(copy)s, true)

-- trace_peek_bound --
-- Where a read of the slot copy stops so as to decode at most `bytes` of WAL from its restart
-- position: NULL when the WAL written so far is within that (on a standby, the WAL replayed)
SELECT CASE WHEN pg_wal_lsn_diff(w.lsn, s.restart_lsn) > %(bytes)s
            THEN (s.restart_lsn + %(bytes)s::numeric)::text END AS upto
FROM pg_replication_slots s,
     (SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                  ELSE pg_current_wal_lsn() END AS lsn) AS w
WHERE s.slot_name = %(slot)s

-- trace_peek --
-- The changes of committed transactions the slot copy has not confirmed, oldest first, read
-- without consuming them; stops after the transaction in which `limit` changes are reached,
-- and at `upto` (NULL: the end of the WAL)
SELECT data
FROM pg_logical_slot_peek_binary_changes(%(slot)s, %(upto)s::pg_lsn, %(limit)s,
                                         VARIADIC %(options)s::text[])

-- create_failover_slot --
-- A logical slot that standbys with sync_replication_slots = on keep a copy of (PostgreSQL 17+)
SELECT lsn::text
FROM pg_create_logical_replication_slot(%(slot)s, %(plugin)s, temporary => false,
                                        twophase => false, failover => true)

-- failover_node --
-- What failover slots need of this server, as a primary or as a standby (PostgreSQL 17+)
SELECT pg_is_in_recovery() AS standby,
       current_setting('server_version_num')::int AS version_num,
       current_setting('wal_level') AS wal_level,
       current_setting('synchronized_standby_slots') AS synchronized_standby_slots,
       current_setting('sync_replication_slots')::bool AS sync_replication_slots,
       current_setting('hot_standby_feedback')::bool AS hot_standby_feedback,
       current_setting('primary_slot_name') AS primary_slot_name,
       -- hidden from roles without superuser or pg_read_all_settings: NULL then
       (SELECT setting FROM pg_settings WHERE name = 'primary_conninfo') AS primary_conninfo

-- physical_slots --
-- The physical slots of this server: the standbys that may be listed in synchronized_standby_slots
SELECT slot_name, active FROM pg_replication_slots WHERE slot_type = 'physical' ORDER BY slot_name

-- timeline --
-- The server's timeline (past 1 once promoted from a standby or restored); NULL on a standby
SELECT CASE WHEN NOT pg_is_in_recovery()
            THEN ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int
       END AS timeline

-- The slots' lineage (cdc_relay/postgres/lineage.py), in the table cdc_relay_slots of schema outbox.

-- lineage_access --
-- Whether the lineage table exists, and what this role may do there: read it, move a slot's
-- position and what its relay verified (what stream does), make a slot's row (setup-slot)
SELECT to_regclass('cdc_relay_slots') IS NOT NULL AS present,
       CASE WHEN to_regclass('cdc_relay_slots') IS NOT NULL
            THEN has_table_privilege('cdc_relay_slots', 'SELECT') END AS readable,
       CASE WHEN to_regclass('cdc_relay_slots') IS NOT NULL
            THEN has_column_privilege('cdc_relay_slots', 'confirmed_lsn', 'UPDATE')
                 AND has_column_privilege('cdc_relay_slots', 'confirmed_from', 'UPDATE')
                 AND has_column_privilege('cdc_relay_slots', 'published', 'UPDATE')
                 AND has_column_privilege('cdc_relay_slots', 'verified_lsn', 'UPDATE')
       END AS movable,
       CASE WHEN to_regclass('cdc_relay_slots') IS NOT NULL
            THEN has_table_privilege('cdc_relay_slots', 'SELECT, INSERT, UPDATE') END AS writable

-- lineage --
-- A slot's row
SELECT slot, plugin, system_id, timeline, made, created_lsn::text AS created_lsn, created_at,
       confirmed_lsn::text AS confirmed_lsn, confirmed_from, publication, published,
       verified_lsn::text AS verified_lsn
FROM cdc_relay_slots
WHERE slot = %(slot)s

-- lineage_server --
-- The server a slot is made in: its cluster's system identifier (NULL for a role that may not
-- read pg_control_system()), and the WAL position now, which the WAL had not passed at `at`
SELECT CASE WHEN has_function_privilege('pg_control_system()', 'EXECUTE')
            THEN (SELECT system_identifier::text FROM pg_control_system()) END AS system_id,
       pg_current_wal_lsn()::text AS lsn, now() AS at

-- lineage_made --
-- A slot made (or found without a row): its row, a new generation's whatever was there
INSERT INTO cdc_relay_slots (slot, plugin, system_id, timeline, made, created_lsn,
                             confirmed_lsn, confirmed_from, publication, published, verified_lsn)
VALUES (%(slot)s, %(plugin)s, %(system_id)s, %(timeline)s, %(made)s, %(lsn)s::pg_lsn,
        %(lsn)s::pg_lsn, %(at)s, %(publication)s, %(published)s, %(verified)s::pg_lsn)
ON CONFLICT (slot) DO UPDATE
SET plugin = excluded.plugin, system_id = excluded.system_id, timeline = excluded.timeline,
    made = excluded.made, created_lsn = excluded.created_lsn, created_at = now(),
    confirmed_lsn = excluded.confirmed_lsn, confirmed_from = excluded.confirmed_from,
    publication = excluded.publication, published = excluded.published,
    verified_lsn = excluded.verified_lsn

-- lineage_confirmed --
-- How far the slot is confirmed, and a moment the WAL had not passed that yet; never back
UPDATE cdc_relay_slots
SET confirmed_lsn = %(lsn)s::pg_lsn, confirmed_from = %(at)s,
    verified_lsn = greatest(verified_lsn, %(verified)s::pg_lsn)
WHERE slot = %(slot)s AND confirmed_lsn < %(lsn)s::pg_lsn

-- lineage_published --
-- What the relay (or setup-slot --accept-gap) verified of the publication, and where
UPDATE cdc_relay_slots
SET publication = %(publication)s, published = %(published)s, verified_lsn = %(lsn)s::pg_lsn
WHERE slot = %(slot)s

-- failover_guarded --
-- Whether a failover of the slot keeps the history the relay was sent: a failover slot (17+) on a server whose synchronized_standby_slots names a standby's slot, so that no WAL reaches the relay before that standby has it; NULL settings (before 17) count as not
SELECT coalesce((to_jsonb(s) ->> 'failover')::bool, false) AS failover,
       coalesce(current_setting('synchronized_standby_slots', true), '') <> '' AS synchronized
FROM pg_replication_slots s
WHERE s.slot_name = %(slot)s

-- untrusted_owner --
-- The owner of a table the relays keep state in, when it is neither this role, a role it is a direct member of, nor a superuser: a table another role made first (CREATE TABLE IF NOT EXISTS takes it as it is) lets that role rewrite what it says; no row when trusted or missing
SELECT r.rolname AS owner
FROM pg_class c
JOIN pg_roles r ON r.oid = c.relowner
WHERE c.oid = to_regclass(%(table)s)
  AND NOT r.rolsuper
  AND r.rolname <> current_user
  AND NOT EXISTS (SELECT FROM pg_auth_members m
                  JOIN pg_roles me ON me.oid = m.member
                  WHERE m.roleid = r.oid AND me.rolname = current_user)
