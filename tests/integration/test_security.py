"""Security: Kafka over TLS and SASL/SCRAM, PostgreSQL with sslmode=verify-full behind a
hostssl-only pg_hba.conf, the least-privilege roles of sql/roles.sql, and passwords kept out
of the relay's output, metrics and errors.

A broker and a PostgreSQL cluster of this module's own, with certificates made here (the
session's services stay as they are, and services given by environment variables are not
used: they would not have these certificates).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from certs import Certificates, make_ca, make_certificates
from confluent_kafka import Consumer
from psycopg.conninfo import make_conninfo
from relaytools import (
    RelayProcess,
    Writer,
    Written,
    check,
    consume,
    partitions_of,
    relay_env,
    setup_slot,
    slot_row,
    wait_slot,
    wait_until,
)

import cdc_relay
from cdc_relay.devstack import LOOPBACK, DevstackError, free_ports
from cdc_relay.devstack.kafka import LocalKafka
from cdc_relay.devstack.postgres import LocalPostgres, find_bindir
from cdc_relay.postgres.replication import ConnectionLost, ReplicationConnection

pytestmark = pytest.mark.integration

SQL = Path(cdc_relay.__file__).parent / "sql"  # the package's schema, as installed
STREAM_ROLE = "cdc_relay_stream"
POLLER_ROLE = "cdc_relay_poller"
PRUNER_ROLE = "cdc_relay_pruner"
SCRAM_USER = "relay"

# The tests connect as the superuser without a password; every other role needs TLS and its
# password. Logical replication connections match the database column, like any other.
PG_HBA = """\
local   all  all                    trust
host    all  postgres  127.0.0.1/32 trust
hostssl all  all       127.0.0.1/32 scram-sha-256
"""


def _secret(kind: str) -> str:
    """A password that no log line could contain by chance."""
    return f"{kind}-{secrets.token_hex(8)}"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that signed nothing the servers present."""
    return make_ca(tmp_path_factory.mktemp("other_ca"), "another CA")[0]


@dataclass(frozen=True)
class SecureKafka:
    broker: LocalKafka
    plaintext: str
    """The PLAINTEXT listener: the tests' own consumers read there."""
    ssl: str
    """TLS, no authentication."""
    sasl_ssl: str
    """SCRAM-SHA-512 over TLS, for SCRAM_USER with ``password``."""
    password: str
    ca: Path


def _secure_broker(base_dir: Path, certificates: Certificates) -> SecureKafka:
    """A broker with a TLS and a SCRAM-over-TLS listener besides PLAINTEXT (not started)."""
    plaintext, controller, tls, sasl = free_ports(4)
    ports = {"PLAINTEXT": plaintext, "CONTROLLER": controller, "SSL": tls, "SASL_SSL": sasl}
    listeners = ",".join(f"{name}://{LOOPBACK}:{port}" for name, port in ports.items())
    password = _secret("kafka")
    broker = LocalKafka(
        base_dir,
        port=plaintext,
        controller_port=controller,
        properties={
            "listeners": listeners,
            "advertised.listeners": listeners,
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,"
            "SSL:SSL,SASL_SSL:SASL_SSL",
            # A PEM key store: the private key (PKCS#8, not encrypted) and the certificate.
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(certificates.key_and_cert),
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
            # the tests' consumer groups: one partition is created much faster than 50
            "offsets.topic.num.partitions": "1",
        },
        # KRaft keeps SCRAM credentials in its metadata: they are created with the storage.
        format_args=["--add-scram", f"SCRAM-SHA-512=[name={SCRAM_USER},password={password}]"],
    )
    return SecureKafka(
        broker=broker,
        plaintext=f"{LOOPBACK}:{plaintext}",
        ssl=f"{LOOPBACK}:{tls}",
        sasl_ssl=f"{LOOPBACK}:{sasl}",
        password=password,
        ca=certificates.ca,
    )


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, certificates: Certificates
) -> Iterator[tuple[SecureKafka, LocalPostgres]]:
    """The module's broker and PostgreSQL cluster, started side by side."""
    try:
        find_bindir()
    except DevstackError as err:
        pytest.skip(f"no PostgreSQL binaries for a TLS cluster: {err}")
    kafka = _secure_broker(tmp_path_factory.mktemp("kafka_tls"), certificates)
    postgres = LocalPostgres(
        tmp_path_factory.mktemp("postgres_tls"),
        settings={"ssl": "on"},  # server.crt and server.key in the data directory
        files={
            "server.crt": certificates.cert.read_bytes(),
            "server.key": certificates.key.read_bytes(),
            "pg_hba.conf": PG_HBA.encode(),
        },
    )
    try:
        with ThreadPoolExecutor(2) as pool:
            starts = [pool.submit(kafka.broker.start), pool.submit(postgres.start)]
        for start in starts:
            start.result()
        yield kafka, postgres
    finally:
        kafka.broker.cleanup(keep_logs=True)
        postgres.cleanup(keep_logs=True)


@pytest.fixture(scope="module")
def secure_kafka(servers: tuple[SecureKafka, LocalPostgres]) -> SecureKafka:
    return servers[0]


@pytest.fixture(scope="module")
def secure_postgres(servers: tuple[SecureKafka, LocalPostgres]) -> LocalPostgres:
    return servers[1]


@dataclass(frozen=True)
class Database:
    admin: str
    """The superuser, owner of the outbox: set-up, the application's writes, checks."""
    stream: str
    """The stream role: TLS verified against the CA (verify-full), no password in it."""
    poller: str
    stream_password: str
    poller_password: str
    pruner: str
    pruner_password: str


@pytest.fixture(scope="module")
def role_passwords() -> dict[str, str]:
    return {
        STREAM_ROLE: _secret("pg-stream"),
        POLLER_ROLE: _secret("pg-poller"),
        PRUNER_ROLE: _secret("pg-pruner"),
    }


@pytest.fixture
def database(
    secure_postgres: LocalPostgres, certificates: Certificates, role_passwords: dict[str, str]
) -> Database:
    """A new database with the outbox, sql/poller.sql and sql/roles.sql (run again in every
    database: it is idempotent). Left to the cluster's removal at the end of the module."""
    name = f"t_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(secure_postgres.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    admin = secure_postgres.dsn_for(name)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute((SQL / "outbox.sql").read_bytes())
        conn.execute((SQL / "poller.sql").read_bytes())
    # As documented: passwords reach psql through the environment, not its command line.
    subprocess.run(
        [
            str(secure_postgres.bindir / "psql"),
            *("-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", admin, "-f", str(SQL / "roles.sql")),
        ],
        env={
            **os.environ,
            "CDC_RELAY_STREAM_PASSWORD": role_passwords[STREAM_ROLE],
            "CDC_RELAY_POLLER_PASSWORD": role_passwords[POLLER_ROLE],
            "CDC_RELAY_PRUNER_PASSWORD": role_passwords[PRUNER_ROLE],
        },
        check=True,
        capture_output=True,
    )

    def dsn(user: str) -> str:
        return make_conninfo(
            host=LOOPBACK,
            port=str(secure_postgres.port),
            dbname=name,
            user=user,
            sslmode="verify-full",
            sslrootcert=str(certificates.ca),
        )

    return Database(
        admin=admin,
        stream=dsn(STREAM_ROLE),
        poller=dsn(POLLER_ROLE),
        stream_password=role_passwords[STREAM_ROLE],
        poller_password=role_passwords[POLLER_ROLE],
        pruner=dsn(PRUNER_ROLE),
        pruner_password=role_passwords[PRUNER_ROLE],
    )


# -- running the relay -------------------------------------------------------------------------


class Relay(RelayProcess):
    """RelayProcess with options on the command line too."""

    def __init__(self, log_dir: Path, env: dict[str, str], args: Sequence[str], **kw: Any):
        super().__init__(log_dir, env, **kw)
        self.args = list(args)

    def start(self) -> Relay:
        self.runs += 1
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cdc_relay", self.command, *self.args],
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self


def run(args: Sequence[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A relay command that is expected to end by itself."""
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output
    assert len(output.splitlines()) == 1, output
    assert output.startswith("cdc-relay: error: "), output
    return output


def properties(path: Path, settings: dict[str, str]) -> Path:
    """A librdkafka properties file, readable by its owner alone (it may hold a password)."""
    path.touch(mode=0o600)
    path.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
    return path


def sasl_settings(kafka: SecureKafka) -> dict[str, str]:
    return {
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": SCRAM_USER,
        "ssl.ca.location": str(kafka.ca),
    }


def write_events(dsn: str, count: int) -> Writer:
    """``count`` events of a few aggregates, one or two per transaction, as the application."""
    writer = Writer(dsn)
    for i in range(0, count, 2):
        events = [("order", f"o{i % 3}", {"i": i}), ("customer", f"c{i % 2}", {"i": i + 1})]
        writer.transaction(events[: count - i])
    writer.close()
    return writer


def assert_delivered(written: list[Written], bootstrap: str, topic_prefix: str) -> None:
    """Every event of ``written`` (all the test wrote) is on Kafka, in order per aggregate."""
    received = consume(bootstrap, topic_prefix, expected=len(written), settle=0.5)
    verdict = check(written, received, topic_prefix)
    assert not (verdict.lost or verdict.out_of_order or verdict.mismatched), (
        f"{verdict}; the broker holds {held(bootstrap, topic_prefix, written)}"
    )


def held(bootstrap: str, topic_prefix: str, written: list[Written]) -> dict[str, int]:
    """Messages per partition of the test's topics, as the broker counts them."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "watermarks"})
    try:
        counts = {}
        for topic in {f"{topic_prefix}.{w.aggregate_type}" for w in written}:
            for partition in partitions_of(bootstrap, topic):
                low, high = consumer.get_watermark_offsets(partition, timeout=10)
                counts[f"{topic}[{partition.partition}]"] = high - low
        return counts
    finally:
        consumer.close()


def replication_session(admin: str, slot: str) -> tuple[str, bool]:
    """The role and the TLS state of the session that streams ``slot``."""
    with psycopg.connect(admin, autocommit=True) as conn:
        row = conn.execute(
            "SELECT a.usename, s.ssl FROM pg_replication_slots r"
            " JOIN pg_stat_activity a ON a.pid = r.active_pid"
            " JOIN pg_stat_ssl s ON s.pid = r.active_pid WHERE r.slot_name = %s",
            [slot],
        ).fetchone()
    assert row is not None, f"nobody streams {slot}"
    return str(row[0]), bool(row[1])


# -- Kafka over TLS and SASL; PostgreSQL over verified TLS; the stream role --------------------


@pytest.mark.parametrize("client", ["SSL flags", "SASL_SSL flags and env", "SASL_SSL file"])
def test_stream_as_its_role_over_verified_tls_to_postgres_and_kafka(
    tmp_path: Path, database: Database, secure_kafka: SecureKafka, names: Any, client: str
) -> None:
    setup_slot(database.admin, names)  # once, as the table's owner
    extra: dict[str, str] = {"PGPASSWORD": database.stream_password}
    if client == "SSL flags":
        bootstrap = secure_kafka.ssl
        args = ["--kafka-config", "security.protocol=SSL"]
        args += ["--kafka-config", f"ssl.ca.location={secure_kafka.ca}"]
    elif client == "SASL_SSL flags and env":
        # By name: the certificate's DNS name is checked at bootstrap, its IP address after.
        bootstrap = secure_kafka.sasl_ssl.replace(LOOPBACK, "localhost")
        args = [
            f"--kafka-config={key}={value}" for key, value in sasl_settings(secure_kafka).items()
        ]
        extra["CDC_RELAY_KAFKA_SASL_PASSWORD"] = secure_kafka.password
    else:
        bootstrap = secure_kafka.sasl_ssl
        settings = {**sasl_settings(secure_kafka), "sasl.password": secure_kafka.password}
        args = ["--kafka-config-file", str(properties(tmp_path / "client.properties", settings))]
    env = {**relay_env(database.stream, bootstrap, names), **extra}
    relay = Relay(tmp_path, env, args).start()
    try:
        wait_slot(database.admin, names.slot, active=True)
        assert replication_session(database.admin, names.slot) == (STREAM_ROLE, True)
        writer = write_events(database.admin, 20)
        assert_delivered(writer.written, secure_kafka.plaintext, names.topic_prefix)
        assert relay.stop() == 0
    finally:
        relay.close()
    log = relay.log()
    assert "streaming slot" in log
    assert database.stream_password not in log
    assert secure_kafka.password not in log


@pytest.mark.parametrize("case", ["wrong password", "PLAINTEXT to TLS", "another CA"])
def test_kafka_refusing_the_relay_is_a_one_line_error_with_the_remedy(
    database: Database, secure_kafka: SecureKafka, other_ca: Path, names: Any, case: str
) -> None:
    setup_slot(database.admin, names)
    wrong = _secret("wrong")
    env = {
        **relay_env(database.stream, secure_kafka.sasl_ssl, names),
        "PGPASSWORD": database.stream_password,
        "CDC_RELAY_KAFKA_TIMEOUT": "3",
    }
    if case == "wrong password":
        # Through the environment: a password in --kafka-config draws a warning of its own.
        config = sasl_settings(secure_kafka)
        env["CDC_RELAY_KAFKA_SASL_PASSWORD"] = wrong
        expected = (
            r"Kafka at \S+ refused the relay's credentials: .*invalid credentials.*; check "
            r"sasl\.mechanisms, sasl\.username and the password \(CDC_RELAY_KAFKA_SASL_PASSWORD, "
            r"or sasl\.password in --kafka-config-file\)"
        )
    elif case == "PLAINTEXT to TLS":
        env["CDC_RELAY_KAFKA_BOOTSTRAP"] = secure_kafka.ssl
        config = {}
        expected = (
            rf"no Kafka broker answered at {re.escape(secure_kafka.ssl)} within 3s( \(.*\))?; "
            r"check --kafka-bootstrap, that the broker is running, and that "
            r"security\.protocol=PLAINTEXT is what its listener there speaks"
        )
    else:
        env["CDC_RELAY_KAFKA_BOOTSTRAP"] = secure_kafka.ssl
        config = {"security.protocol": "SSL", "ssl.ca.location": str(other_ca)}
        expected = (
            r"TLS with Kafka at \S+ failed: .*certificate verify failed.*; ssl\.ca\.location "
            r"must name the CA that signed the broker's certificate, and that certificate the "
            r"broker's host"
        )
    args = ["stream", *(f"--kafka-config={key}={value}" for key, value in config.items())]
    message = one_line_error(run(args, env))
    assert re.fullmatch("cdc-relay: error: " + expected, message), message
    assert wrong not in message
    assert secure_kafka.password not in message
    assert slot_row(database.admin, names.slot)["active"] is False


@pytest.mark.parametrize("case", ["another root CA", "no TLS", "wrong password"])
def test_postgres_refusing_the_relay_is_a_one_line_error(
    database: Database, other_ca: Path, names: Any, case: str
) -> None:
    setup_slot(database.admin, names)
    password = database.stream_password
    dsn = database.stream
    if case == "another root CA":
        dsn = make_conninfo(dsn, sslrootcert=str(other_ca))
        expected = "certificate verify failed"
    elif case == "no TLS":
        dsn = make_conninfo(dsn, sslmode="disable")
        expected = f'no pg_hba.conf entry for host "127.0.0.1", user "{STREAM_ROLE}"'
    else:
        password = _secret("wrong")
        expected = f'password authentication failed for user "{STREAM_ROLE}"'
    env = {**relay_env(dsn, "127.0.0.1:9", names), "PGPASSWORD": password}
    message = one_line_error(run(["stream"], env))
    assert message.startswith("cdc-relay: error: cannot connect to PostgreSQL: "), message
    assert expected in message
    assert message.endswith("; check --dsn")
    assert password not in message


# -- least privilege -------------------------------------------------------------------------


def test_the_roles_have_what_the_relays_need_and_nothing_more(
    database: Database, names: Any
) -> None:
    with psycopg.connect(database.admin, autocommit=True) as conn:
        roles = {
            row[0]: row[1:]
            for row in conn.execute(
                "SELECT rolname, rolcanlogin, rolreplication, rolsuper, rolcreatedb,"
                " rolcreaterole, rolbypassrls FROM pg_roles WHERE rolname = ANY(%s)",
                [[STREAM_ROLE, POLLER_ROLE, PRUNER_ROLE]],
            )
        }
        assert roles == {
            STREAM_ROLE: (True, True, False, False, False, False),
            POLLER_ROLE: (True, False, False, False, False, False),
            PRUNER_ROLE: (True, False, False, False, False, False),
        }
        table_privileges = {
            role: {
                privilege
                for privilege in ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "TRIGGER")
                if conn.execute(
                    "SELECT has_table_privilege(%s, 'outbox_events', %s)", [role, privilege]
                ).fetchone()
                == (True,)
            }
            for role in (STREAM_ROLE, POLLER_ROLE, PRUNER_ROLE)
        }
        assert table_privileges == {
            STREAM_ROLE: {"SELECT"},
            POLLER_ROLE: {"SELECT"},
            PRUNER_ROLE: {"SELECT", "DELETE"},
        }
        updatable = conn.execute(
            "SELECT array_agg(attname::text ORDER BY attname) FROM pg_attribute"
            " WHERE attrelid = 'outbox_events'::regclass AND attnum > 0"
            " AND has_column_privilege(%s, attrelid, attnum, 'UPDATE')",
            [POLLER_ROLE],
        ).fetchone()
        assert updatable == (["attempts", "last_error", "processed_at", "retry_after"],)
        # The slots' lineage: the stream role moves its slot's position and what it verified
        # of the publication, nothing else; the pruner reads it (prune --slot), the poller
        # has no slot.
        lineage = {
            role: {
                privilege
                for privilege in ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "TRIGGER")
                if conn.execute(
                    "SELECT has_table_privilege(%s, 'cdc_relay_slots', %s)", [role, privilege]
                ).fetchone()
                == (True,)
            }
            for role in (STREAM_ROLE, POLLER_ROLE, PRUNER_ROLE)
        }
        assert lineage == {STREAM_ROLE: {"SELECT"}, POLLER_ROLE: set(), PRUNER_ROLE: {"SELECT"}}
        movable = conn.execute(
            "SELECT array_agg(attname::text ORDER BY attname) FROM pg_attribute"
            " WHERE attrelid = 'cdc_relay_slots'::regclass AND attnum > 0"
            " AND has_column_privilege(%s, attrelid, attnum, 'UPDATE')",
            [STREAM_ROLE],
        ).fetchone()
        assert movable == (["confirmed_from", "confirmed_lsn", "published", "verified_lsn"],)

    write_events(database.admin, 2)
    forbidden = {
        STREAM_ROLE: [
            "DELETE FROM outbox_events",
            "UPDATE outbox_events SET processed_at = now()",
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)"
            " VALUES ('a', '1', 'e', '{}')",
            "TRUNCATE outbox_events",
            "CREATE PUBLICATION p FOR TABLE outbox_events",
        ],
        POLLER_ROLE: [
            "UPDATE outbox_events SET payload = '{}'",
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)"
            " VALUES ('a', '1', 'e', '{}')",
            "DELETE FROM outbox_events",
            "TRUNCATE outbox_events",
        ],
        PRUNER_ROLE: [
            "UPDATE outbox_events SET processed_at = now()",
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)"
            " VALUES ('a', '1', 'e', '{}')",
            "TRUNCATE outbox_events",
        ],
    }
    for dsn, password, role in (
        (database.stream, database.stream_password, STREAM_ROLE),
        (database.poller, database.poller_password, POLLER_ROLE),
        (database.pruner, database.pruner_password, PRUNER_ROLE),
    ):
        with psycopg.connect(dsn, password=password, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM outbox_events").fetchone() == (2,)
            for statement in forbidden[role]:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)

    # The poller's role cannot read the WAL ...
    with pytest.raises(ConnectionLost, match="replication role"):
        ReplicationConnection(make_conninfo(database.poller, password=database.poller_password))
    # ... and the stream role cannot set up: the publication is the table owner's to create.
    refused = one_line_error(
        run(
            ["setup-slot", "--slot", names.slot, "--publication", names.publication],
            {"CDC_RELAY_DSN": database.stream, "PGPASSWORD": database.stream_password},
        )
    )
    assert refused == (
        f"cdc-relay: error: role {STREAM_ROLE} cannot create a publication on "
        "public.outbox_events (it must own the table and have CREATE on the database); run "
        "setup-slot as the table's owner, or have an administrator create the publication"
    )


def test_poll_and_prune_as_their_roles_over_verified_tls_and_sasl(
    tmp_path: Path, database: Database, secure_kafka: SecureKafka, names: Any
) -> None:
    client = properties(
        tmp_path / "client.properties",
        {**sasl_settings(secure_kafka), "sasl.password": secure_kafka.password},
    )
    env = {
        **relay_env(database.poller, secure_kafka.sasl_ssl, names),
        "PGPASSWORD": database.poller_password,
        "CDC_RELAY_KAFKA_CONFIG_FILE": str(client),
    }
    relay = RelayProcess(tmp_path, env, command="poll").start()
    try:
        writer = write_events(database.admin, 20)
        assert_delivered(writer.written, secure_kafka.plaintext, names.topic_prefix)

        def processed() -> bool:
            with psycopg.connect(database.admin) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM outbox_events WHERE processed_at IS NULL"
                ).fetchone()
            return row == (0,)

        wait_until(processed, 30, "every row marked processed")
        assert relay.stop() == 0
    finally:
        relay.close()
    # The poller's environment, whose CDC_RELAY_SLOT (a slot nobody made) would make prune prune
    # by that slot; empty, it names none, and prune takes the processed rows.
    as_pruner = {
        **env,
        "CDC_RELAY_DSN": database.pruner,
        "PGPASSWORD": database.pruner_password,
        "CDC_RELAY_SLOT": "",
    }
    pruned = run(["prune", "--older-than", "0s"], as_pruner)
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.startswith("pruned 20 processed rows"), pruned.stdout
    output = relay.log() + pruned.stdout + pruned.stderr
    assert database.poller_password not in output
    assert database.pruner_password not in output
    assert secure_kafka.password not in output


# -- passwords never show --------------------------------------------------------------------


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def test_passwords_never_show_in_logs_metrics_errors_or_the_process_list(
    tmp_path: Path, database: Database, secure_kafka: SecureKafka, names: Any
) -> None:
    setup_slot(database.admin, names)
    wrong = _secret("wrong")
    client = properties(tmp_path / "client.properties", sasl_settings(secure_kafka))
    (port,) = free_ports(1)
    # The PostgreSQL password inside the DSN this time, the Kafka one from the environment.
    env = {
        **relay_env(
            make_conninfo(database.stream, password=database.stream_password),
            secure_kafka.sasl_ssl,
            names,
        ),
        "CDC_RELAY_KAFKA_CONFIG_FILE": str(client),
        "CDC_RELAY_KAFKA_SASL_PASSWORD": secure_kafka.password,
        "CDC_RELAY_METRICS_PORT": str(port),
        "CDC_RELAY_METRICS_HOST": "127.0.0.1",
        "CDC_RELAY_LOG_LEVEL": "DEBUG",
    }
    seen: list[str] = []  # every line and page the relay showed
    relay = RelayProcess(tmp_path, env).start()
    try:
        wait_until(lambda: http_get(port, "/readyz")[0] == 200, 60, "the relay to be ready")
        assert relay.proc is not None
        seen.append(Path(f"/proc/{relay.proc.pid}/cmdline").read_bytes().decode())
        written = write_events(database.admin, 2).written
        assert_delivered(written, secure_kafka.plaintext, names.topic_prefix)
        seen += [http_get(port, path)[1] for path in ("/metrics", "/healthz", "/readyz")]

        # The replication connection cut: the relay connects again with the same DSN.
        with psycopg.connect(database.admin, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                " WHERE slot_name = %s",
                [names.slot],
            )
        wait_until(lambda: "reconnected" in relay.log(), 30, "the relay to reconnect")

        # The broker gone: the relay waits, logs it, and authenticates again when it is back.
        secure_kafka.broker.stop()
        try:
            wait_until(lambda: http_get(port, "/readyz")[0] == 503, 60, "not ready")
            seen += [http_get(port, path)[1] for path in ("/metrics", "/readyz")]
        finally:
            secure_kafka.broker.start()
        written += write_events(database.admin, 2).written
        assert_delivered(written, secure_kafka.plaintext, names.topic_prefix)
        seen.append(http_get(port, "/metrics")[1])
        assert relay.stop() == 0
    finally:
        relay.close()
    seen.append(relay.log())
    assert "Kafka unreachable" in seen[-1]

    # Failures that name or touch a password: each one line, none showing it.
    failures = {
        "PostgreSQL password in the DSN": {
            "CDC_RELAY_DSN": make_conninfo(database.stream, password=wrong)
        },
        "PGPASSWORD": {"CDC_RELAY_DSN": database.stream, "PGPASSWORD": wrong},
        "Kafka password": {"CDC_RELAY_KAFKA_SASL_PASSWORD": wrong, "CDC_RELAY_KAFKA_TIMEOUT": "5"},
        # libpq's own message would quote this URI whole, password included
        "a DSN libpq cannot parse": {
            "CDC_RELAY_DSN": f"postgresql://{STREAM_ROLE}:{database.stream_password}@[::1/x"
        },
    }
    for what, change in failures.items():
        result = run(["stream"], {**env, "CDC_RELAY_METRICS_PORT": "0", **change})
        assert result.returncode != 0, what
        assert len((result.stdout + result.stderr).strip().splitlines()) == 1, result.stderr
        seen.append(result.stdout + result.stderr)
    status = run(["status", "--slot", names.slot], {"CDC_RELAY_DSN": env["CDC_RELAY_DSN"]})
    assert status.returncode == 0, status.stderr
    seen.append(status.stdout + status.stderr)

    everything = "\n".join(seen)
    for password in (database.stream_password, secure_kafka.password, wrong):
        assert password not in everything
