-- Least-privilege roles for the relays: one for `cdc-relay stream`, one for `cdc-relay poll`,
-- one for `cdc-relay prune`; and the writer role, the only one (superusers aside) that may
-- write events.
-- Run by a superuser (only superusers may give REPLICATION, before PostgreSQL 16), after
-- schema outbox (and schema poller if you poll), in the outbox's database; idempotent:
--
--   export CDC_RELAY_STREAM_PASSWORD=... CDC_RELAY_POLLER_PASSWORD=... \
--          CDC_RELAY_PRUNER_PASSWORD=...                                 # or leave them unset
--   cdc-relay schema show roles | psql "$ADMIN_DSN" -v ON_ERROR_STOP=1 -f -
--   psql "$ADMIN_DSN" -v ON_ERROR_STOP=1 -f sql/roles.sql     # the same, in a checkout
--
-- Passwords come from those environment variables through psql's \getenv (psql 15 or newer),
-- never from this file or psql's command line; when one is unset the role's password is left
-- as it is (set it with psql's \password, which sends only a hash, or use certificates).
-- The statement that sets a password can be logged by the server (log_statement = 'ddl' or
-- 'all'): prefer \password there. Role and table names can be changed with psql variables:
--   -v stream_role=... -v poller_role=... -v pruner_role=... -v writer_role=...
--   -v outbox_table=myschema.outbox
--
-- Who does what (exactly this, whatever the roles had before: see "Taken back" below):
--   * the table's owner (or an administrator) runs `cdc-relay setup-slot` once: creating the
--     publication needs ownership of the table, and the slot needs REPLICATION;
--   * the stream role reads the slot: LOGIN, REPLICATION, SELECT on the outbox, on schema
--     poller's dead-letter view (for `cdc-relay status`), SELECT, INSERT, UPDATE on schema
--     outbox's cdc_relay_dead_letters (`stream --dead-letter-topic`), and SELECT and UPDATE
--     of four columns on its cdc_relay_slots (the slot's position, what the relay verified
--     of the publication), nothing else;
--   * the poller role claims and marks rows: SELECT and UPDATE of the four columns the poller
--     changes on the outbox, SELECT on the dead-letter view and on schema poller's
--     cdc_relay_handovers (a table handed over to stream stops the pollers); LISTEN and
--     pg_notify() need no privilege. No DELETE: `poll` deletes nothing;
--   * the pruner role deletes old rows whose events are on Kafka (`cdc-relay prune`, with or
--     without --slot, from cron): SELECT and DELETE on the outbox, SELECT on cdc_relay_slots
--     (what the slot was, for --slot), nothing else.
-- Each may CONNECT to the database and use the outbox's schema. None may INSERT into the
-- outbox, nor emit a logical decoding message: events are the application's to write, through
-- the writer role:
--   * the writer role (NOLOGIN when this script makes it; give it to the application's roles:
--     GRANT cdc_relay_writer TO app) may INSERT into the outbox and run
--     pg_logical_emit_message (outbox_emit() calls it), which is taken from PUBLIC: any role
--     that can connect may run it by default, and `cdc-relay stream --messages` relays every
--     message of the outbox prefix (it refuses to start while a role that is not a member of
--     --message-writer, default cdc_relay_writer, may run it). Superusers always may.
--     The function's privileges are per database: run this script in the outbox's database.
--     Unlike the relays' roles, the writer may be an application's own role: nothing is
--     taken from it, and its attributes stay as they are.
-- On managed services without superuser, give the provider's replication role instead of
-- REPLICATION (e.g. rds_replication on Amazon RDS), named with
--   -v stream_memberships=rds_replication     (several: separated by commas)
-- which this script keeps: any other membership of the roles is taken back.

\if :{?stream_role}
\else
    \set stream_role cdc_relay_stream
\endif
\if :{?poller_role}
\else
    \set poller_role cdc_relay_poller
\endif
\if :{?pruner_role}
\else
    \set pruner_role cdc_relay_pruner
\endif
\if :{?writer_role}
\else
    \set writer_role cdc_relay_writer
\endif
\if :{?outbox_table}
\else
    \set outbox_table public.outbox_events
\endif
\if :{?stream_memberships}
\else
    \set stream_memberships ''
\endif
\getenv stream_password CDC_RELAY_STREAM_PASSWORD
\getenv poller_password CDC_RELAY_POLLER_PASSWORD
\getenv pruner_password CDC_RELAY_PRUNER_PASSWORD

SELECT format('CREATE ROLE %I', role)
FROM unnest(ARRAY[:'stream_role', :'poller_role', :'pruner_role']) AS role
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role)
\gexec
-- The writer is a group role the application's roles join; an existing role named instead (the
-- application's own) keeps its attributes.
SELECT format('CREATE ROLE %I NOLOGIN', :'writer_role')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'writer_role')
\gexec

-- Attributes are set on every run, so a role found with more than it needs is cut back.
ALTER ROLE :"stream_role"
    LOGIN REPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS;
ALTER ROLE :"poller_role"
    LOGIN NOREPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS;
ALTER ROLE :"pruner_role"
    LOGIN NOREPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS;

\if :{?stream_password}
    ALTER ROLE :"stream_role" PASSWORD :'stream_password';
\endif
\if :{?poller_password}
    ALTER ROLE :"poller_role" PASSWORD :'poller_password';
\endif
\if :{?pruner_password}
    ALTER ROLE :"pruner_role" PASSWORD :'pruner_password';
\endif

-- == Taken back: whatever was granted to the three roles before ==========================
-- So that a run reaches the same privileges from any starting state, everything the roles
-- were given is revoked first, then exactly what they need is granted below: their role
-- memberships (pg_write_all_data, an application's role, ...: all but -v stream_memberships),
-- and their privileges on every database and tablespace, and in this database on every
-- schema, table, view, sequence and column, function, type, language, foreign-data wrapper
-- and server, large object and setting, and in default privileges. CASCADE takes back what
-- they granted others in turn. What cannot be taken back so stops the script: objects they
-- own (an owner has every privilege on its objects). Privileges of PUBLIC are every role's,
-- and not this script's to take: it warns of the one that matters here, CREATE on a schema
-- (PUBLIC's on schema public before PostgreSQL 15).

\set relay_roles 'ARRAY[' :'stream_role' ',' :'poller_role' ',' :'pruner_role' ']'

-- An owner has every privilege on what it owns: stop, naming what to hand over.
SELECT format('DO $$BEGIN RAISE EXCEPTION %L; END$$', format(
    'role %s owns %s object(s) (in database %s): an owner has every privilege on them; run '
    'REASSIGN OWNED BY %I TO the owner of the outbox in each of those databases, then this '
    'script again', r.rolname, count(*), string_agg(DISTINCT coalesce(d.datname, '(shared)'),
    ', '), r.rolname))
FROM pg_shdepend s
JOIN pg_roles r ON r.oid = s.refobjid
LEFT JOIN pg_database d ON d.oid = s.dbid
WHERE s.refclassid = 'pg_authid'::regclass AND s.deptype = 'o'
  AND r.rolname = ANY(:relay_roles)
GROUP BY r.rolname
\gexec

-- Role memberships, each by whoever granted it (PostgreSQL 16 keeps one grant per grantor).
SELECT format('REVOKE %I FROM %I GRANTED BY %I CASCADE', g.rolname, m.rolname, b.rolname)
FROM pg_auth_members a
JOIN pg_roles g ON g.oid = a.roleid
JOIN pg_roles m ON m.oid = a.member
JOIN pg_roles b ON b.oid = a.grantor
WHERE m.rolname = ANY(:relay_roles)
  AND NOT (m.rolname = :'stream_role'
           AND g.rolname = ANY(string_to_array(:'stream_memberships', ',')))
\gexec

-- Privileges: each object whose access list names one of the roles (a column's for a table).
SELECT format('REVOKE ALL ON %s %s FROM %I, %I, %I CASCADE',
              kind, name, :'stream_role', :'poller_role', :'pruner_role')
FROM (
    SELECT 'DATABASE' AS kind, quote_ident(datname) AS name, datacl AS acl FROM pg_database
    UNION ALL
    SELECT 'TABLESPACE', quote_ident(spcname), spcacl FROM pg_tablespace
    UNION ALL
    SELECT 'SCHEMA', quote_ident(nspname), nspacl FROM pg_namespace
    UNION ALL
    SELECT CASE c.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END, c.oid::regclass::text,
           c.relacl || (SELECT array_agg(x) FROM pg_attribute a, unnest(a.attacl) x
                        WHERE a.attrelid = c.oid)
    FROM pg_class c WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
    UNION ALL
    SELECT 'ROUTINE', p.oid::regprocedure::text, p.proacl FROM pg_proc p
    UNION ALL
    SELECT 'TYPE', t.oid::regtype::text, t.typacl FROM pg_type t
    UNION ALL
    SELECT 'LANGUAGE', quote_ident(lanname), lanacl FROM pg_language
    UNION ALL
    SELECT 'FOREIGN DATA WRAPPER', quote_ident(fdwname), fdwacl FROM pg_foreign_data_wrapper
    UNION ALL
    SELECT 'FOREIGN SERVER', quote_ident(srvname), srvacl FROM pg_foreign_server
    UNION ALL
    SELECT 'LARGE OBJECT', oid::text, lomacl FROM pg_largeobject_metadata
) AS o
WHERE EXISTS (SELECT 1 FROM aclexplode(o.acl) e JOIN pg_roles r ON r.oid = e.grantee
              WHERE r.rolname = ANY(:relay_roles))
\gexec

-- Settings (SET, ALTER SYSTEM), which PostgreSQL 15 made grantable.
SELECT current_setting('server_version_num')::int >= 150000 AS parameter_acl \gset
\if :parameter_acl
SELECT format('REVOKE ALL ON PARAMETER %s FROM %I, %I, %I CASCADE',
              p.parname, :'stream_role', :'poller_role', :'pruner_role')
FROM pg_parameter_acl p
WHERE EXISTS (SELECT 1 FROM aclexplode(p.paracl) e JOIN pg_roles r ON r.oid = e.grantee
              WHERE r.rolname = ANY(:relay_roles))
\gexec
\endif

-- Default privileges: what objects made later would give the roles.
SELECT format('ALTER DEFAULT PRIVILEGES FOR ROLE %I%s REVOKE ALL ON %s FROM %I, %I, %I',
              owner.rolname,
              CASE WHEN d.defaclnamespace <> 0
                   THEN ' IN SCHEMA ' || quote_ident(n.nspname) ELSE '' END,
              CASE d.defaclobjtype WHEN 'r' THEN 'TABLES' WHEN 'S' THEN 'SEQUENCES'
                   WHEN 'f' THEN 'FUNCTIONS' WHEN 'T' THEN 'TYPES' WHEN 'n' THEN 'SCHEMAS'
                   WHEN 'L' THEN 'LARGE OBJECTS' END,
              :'stream_role', :'poller_role', :'pruner_role')
FROM pg_default_acl d
JOIN pg_roles owner ON owner.oid = d.defaclrole
LEFT JOIN pg_namespace n ON n.oid = d.defaclnamespace
WHERE EXISTS (SELECT 1 FROM aclexplode(d.defaclacl) e JOIN pg_roles r ON r.oid = e.grantee
              WHERE r.rolname = ANY(:relay_roles))
\gexec

-- PUBLIC's CREATE on a schema is every role's, the relays' too.
SELECT format('DO $$BEGIN RAISE WARNING %L; END$$', format(
    'every role may create objects in schema %I (PUBLIC has CREATE there), the relay roles '
    'too; unless your applications need it, run REVOKE CREATE ON SCHEMA %I FROM PUBLIC',
    n.nspname, n.nspname))
FROM pg_namespace n
WHERE EXISTS (SELECT 1 FROM aclexplode(n.nspacl) e
              WHERE e.grantee = 0 AND e.privilege_type = 'CREATE')
\gexec

-- == Granted: exactly what each role needs ================================================

-- The database and the outbox's schema (PUBLIC may have both already; hardened ones not).
SELECT format('GRANT CONNECT ON DATABASE %I TO %I, %I, %I, %I',
              current_database(), :'stream_role', :'poller_role', :'pruner_role', :'writer_role')
\gexec
SELECT format('GRANT USAGE ON SCHEMA %I TO %I, %I, %I, %I',
              n.nspname, :'stream_role', :'poller_role', :'pruner_role', :'writer_role')
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = :'outbox_table'::regclass
\gexec

-- The outbox.
SELECT format('GRANT SELECT ON TABLE %s TO %I, %I',
              :'outbox_table'::regclass, :'stream_role', :'poller_role')
\gexec
-- SELECT ... FOR UPDATE needs UPDATE on a column, which these give.
SELECT format('GRANT UPDATE (processed_at, attempts, retry_after, last_error) ON TABLE %s TO %I',
              :'outbox_table'::regclass, :'poller_role')
\gexec
SELECT format('GRANT SELECT, DELETE ON TABLE %s TO %I',
              :'outbox_table'::regclass, :'pruner_role')
\gexec
SELECT format('GRANT INSERT ON TABLE %s TO %I', :'outbox_table'::regclass, :'writer_role')
\gexec

-- schema poller's dead-letter view (outbox columns both roles may read already), read by
-- `cdc-relay status` and `cdc-relay dead-letters`.
SELECT format('GRANT SELECT ON TABLE %s TO %I, %I',
              to_regclass('outbox_dead_letters'), :'stream_role', :'poller_role')
WHERE to_regclass('outbox_dead_letters') IS NOT NULL
\gexec

-- schema poller's table of handovers to stream, which every poller connection reads: a table
-- handed over is the stream's, and the poller stops.
SELECT format('GRANT SELECT ON TABLE %s TO %I',
              to_regclass(format('%I.cdc_relay_handovers', n.nspname)), :'poller_role')
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = :'outbox_table'::regclass
  AND to_regclass(format('%I.cdc_relay_handovers', n.nspname)) IS NOT NULL
\gexec

-- schema outbox's table of the events `stream --dead-letter-topic` dead-lettered: the stream
-- relay writes each one there, with its content, before it confirms the slot past it.
SELECT format('GRANT SELECT, INSERT, UPDATE ON TABLE %s TO %I',
              to_regclass('cdc_relay_dead_letters'), :'stream_role')
WHERE to_regclass('cdc_relay_dead_letters') IS NOT NULL
\gexec

-- schema outbox's table of what each slot was (cdc_relay_slots, made by setup-slot): the stream
-- relay reads its slot's row and moves its position and what it verified of the publication;
-- `prune --slot` reads it (and `status`, as the stream role).
SELECT format('GRANT SELECT, UPDATE (confirmed_lsn, confirmed_from, published, verified_lsn) '
              'ON TABLE %s TO %I', to_regclass('cdc_relay_slots'), :'stream_role')
WHERE to_regclass('cdc_relay_slots') IS NOT NULL
\gexec
SELECT format('GRANT SELECT ON TABLE %s TO %I', to_regclass('cdc_relay_slots'), :'pruner_role')
WHERE to_regclass('cdc_relay_slots') IS NOT NULL
\gexec

-- Logical decoding messages: the writer's alone (each overload of pg_logical_emit_message, as
-- this server has them: text and bytea content, and from PostgreSQL 17 a `flush` argument).
-- Only a superuser may change who runs it (it belongs to the bootstrap superuser).
SELECT format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC, %I, %I, %I',
              p.oid::regprocedure, :'stream_role', :'poller_role', :'pruner_role')
FROM pg_proc p
WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
\gexec
SELECT format('GRANT EXECUTE ON FUNCTION %s TO %I', p.oid::regprocedure, :'writer_role')
FROM pg_proc p
WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
\gexec
