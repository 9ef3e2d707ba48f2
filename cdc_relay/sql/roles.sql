-- Least-privilege roles for the relays: one for `cdc-relay stream`, one for `cdc-relay poll`.
-- Run by a superuser (only superusers may give REPLICATION, before PostgreSQL 16), after
-- schema outbox (and schema poller if you poll), in the outbox's database; idempotent:
--
--   export CDC_RELAY_STREAM_PASSWORD=... CDC_RELAY_POLLER_PASSWORD=...   # or leave them unset
--   cdc-relay schema show roles | psql "$ADMIN_DSN" -v ON_ERROR_STOP=1 -f -
--   psql "$ADMIN_DSN" -v ON_ERROR_STOP=1 -f sql/roles.sql     # the same, in a checkout
--
-- Passwords come from those environment variables through psql's \getenv (psql 15 or newer),
-- never from this file or psql's command line; when one is unset the role's password is left
-- as it is (set it with psql's \password, which sends only a hash, or use certificates).
-- The statement that sets a password can be logged by the server (log_statement = 'ddl' or
-- 'all'): prefer \password there. Role and table names can be changed with psql variables:
--   -v stream_role=... -v poller_role=... -v outbox_table=myschema.outbox
--
-- Who does what:
--   * the table's owner (or an administrator) runs `cdc-relay setup-slot` once: creating the
--     publication needs ownership of the table, and the slot needs REPLICATION;
--   * the stream role reads the slot: LOGIN, REPLICATION, SELECT on the outbox (and on
--     schema poller's dead-letter view, for `cdc-relay status`), and moves its slot's position
--     in schema outbox's lineage table (UPDATE of four columns), nothing else;
--   * the poller role claims, marks and prunes rows: SELECT, UPDATE of the four columns the
--     poller changes, DELETE for `cdc-relay prune` (take DELETE out of the grant below if
--     another job prunes); LISTEN and pg_notify() need no privilege.
-- Neither may INSERT: events are the application's to write.
-- On managed services without superuser, give the provider's replication role instead of
-- REPLICATION (e.g. GRANT rds_replication TO cdc_relay_stream on Amazon RDS).

\if :{?stream_role}
\else
    \set stream_role cdc_relay_stream
\endif
\if :{?poller_role}
\else
    \set poller_role cdc_relay_poller
\endif
\if :{?outbox_table}
\else
    \set outbox_table public.outbox_events
\endif
\getenv stream_password CDC_RELAY_STREAM_PASSWORD
\getenv poller_password CDC_RELAY_POLLER_PASSWORD

SELECT format('CREATE ROLE %I', role)
FROM unnest(ARRAY[:'stream_role', :'poller_role']) AS role
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role)
\gexec

-- Attributes are set on every run, so a role found with more than it needs is cut back.
ALTER ROLE :"stream_role"
    LOGIN REPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS;
ALTER ROLE :"poller_role"
    LOGIN NOREPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS;

\if :{?stream_password}
    ALTER ROLE :"stream_role" PASSWORD :'stream_password';
\endif
\if :{?poller_password}
    ALTER ROLE :"poller_role" PASSWORD :'poller_password';
\endif

-- The database and the outbox's schema (PUBLIC may have both already; hardened ones not).
SELECT format('GRANT CONNECT ON DATABASE %I TO %I, %I',
              current_database(), :'stream_role', :'poller_role')
\gexec
SELECT format('GRANT USAGE ON SCHEMA %I TO %I, %I', n.nspname, :'stream_role', :'poller_role')
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = :'outbox_table'::regclass
\gexec

-- Exactly these privileges on the outbox, whatever was granted before.
SELECT format('REVOKE ALL ON TABLE %s FROM %I, %I',
              :'outbox_table'::regclass, :'stream_role', :'poller_role')
\gexec
SELECT format('GRANT SELECT ON TABLE %s TO %I', :'outbox_table'::regclass, :'stream_role')
\gexec
SELECT format('GRANT SELECT, DELETE ON TABLE %s TO %I',
              :'outbox_table'::regclass, :'poller_role')
\gexec
-- SELECT ... FOR UPDATE needs UPDATE on a column, which these give.
SELECT format('GRANT UPDATE (processed_at, attempts, retry_after, last_error) ON TABLE %s TO %I',
              :'outbox_table'::regclass, :'poller_role')
\gexec

-- schema poller's dead-letter view (outbox columns both roles may read already), read by
-- `cdc-relay status` and `cdc-relay dead-letters`.
SELECT format('GRANT SELECT ON TABLE %s TO %I, %I',
              to_regclass('outbox_dead_letters'), :'stream_role', :'poller_role')
WHERE to_regclass('outbox_dead_letters') IS NOT NULL
\gexec

-- schema outbox's table of the events `stream --dead-letter-topic` dead-lettered: the stream
-- relay writes each one there, with its content, before it confirms the slot past it.
SELECT format('GRANT SELECT, INSERT, UPDATE ON TABLE %s TO %I',
              to_regclass('cdc_relay_dead_letters'), :'stream_role')
WHERE to_regclass('cdc_relay_dead_letters') IS NOT NULL
\gexec

-- schema outbox's table of what each slot was (cdc_relay_slots, made by setup-slot): the stream
-- relay reads its slot's row and moves its position and what it verified of the publication;
-- status and prune --slot read it. Exactly these, whatever was granted before.
SELECT format('REVOKE ALL ON TABLE %s FROM %I, %I',
              to_regclass('cdc_relay_slots'), :'stream_role', :'poller_role')
WHERE to_regclass('cdc_relay_slots') IS NOT NULL
\gexec
SELECT format('GRANT SELECT, UPDATE (confirmed_lsn, confirmed_from, published, verified_lsn) '
              'ON TABLE %s TO %I', to_regclass('cdc_relay_slots'), :'stream_role')
WHERE to_regclass('cdc_relay_slots') IS NOT NULL
\gexec
SELECT format('GRANT SELECT ON TABLE %s TO %I', to_regclass('cdc_relay_slots'), :'poller_role')
WHERE to_regclass('cdc_relay_slots') IS NOT NULL
\gexec
