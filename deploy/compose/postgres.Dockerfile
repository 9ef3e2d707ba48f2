# PostgreSQL 16 with the wal2json output plugin, for docker-compose.yml. The official image has
# pgoutput built in (cdc-relay's default) but not wal2json (`cdc-relay setup-slot --plugin
# wal2json`); it does have the PostgreSQL project's apt repository, which ships wal2json.
# wal_level=logical and the other server settings are in docker-compose.yml's `command`.
FROM postgres:16-bookworm

# The apt repository keeps only the newest build of each package, so a pinned version would
# stop building within months: the plugin follows the server's major version (PG_MAJOR).
# checkov:skip=CKV_DOCKER_3: the official entrypoint starts as root to prepare the data directory, then runs the server as the postgres user (gosu); a USER line would break that
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "postgresql-${PG_MAJOR}-wal2json" \
    && rm -rf /var/lib/apt/lists/*

# Healthy once the real server accepts TCP connections: while the entrypoint runs the scripts
# of /docker-entrypoint-initdb.d, its temporary server listens on the Unix socket only.
HEALTHCHECK --interval=5s --timeout=5s --start-period=30s --retries=10 \
    CMD ["pg_isready", "--host=127.0.0.1", "--quiet"]
