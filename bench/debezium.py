"""Debezium, the reference contestant: its PostgreSQL connector and Outbox Event Router in
Kafka Connect standalone, run with ``java -cp`` from jars resolved off Maven Central."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from cdc_relay.devstack import DevstackError, cache_dir, free_ports, require_executable
from cdc_relay.devstack.kafka import KAFKA_VERSION, _java

DEBEZIUM_VERSION: Final = "3.6.1.Final"
POM: Final = Path(__file__).with_name("pom.xml")

# connect-standalone.sh's heap and kafka-run-class.sh's JVM options, as the distribution runs it.
JVM_FLAGS: Final = (
    "-Xms256M",
    "-Xmx2G",
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:MaxInlineLevel=15",
    "-Djava.awt.headless=true",
)


def java_version() -> str:
    """The first line of ``java -version``."""
    result = subprocess.run(
        [_java(), "-version"], capture_output=True, text=True, check=False, timeout=60
    )
    return (result.stderr or result.stdout).strip().splitlines()[0]


def resolve_jars() -> Path:
    """The directory of Connect's and Debezium's jars, resolved with Maven once and cached.

    As ``cdc_relay.devstack.kafka.resolve_kafka_jars`` does for the broker: a marker holds a
    hash of the pom and the versions, so Maven runs again only when one of them changes.
    """
    home = cache_dir() / f"debezium-{DEBEZIUM_VERSION}-connect-{KAFKA_VERSION}"
    lib = home / "lib"
    marker = home / "resolved"
    pom = POM.read_bytes()
    stamp = hashlib.sha256(pom + f"{DEBEZIUM_VERSION} {KAFKA_VERSION}".encode()).hexdigest()
    if lib.is_dir() and marker.is_file() and marker.read_text() == stamp:
        return lib
    home.mkdir(parents=True, exist_ok=True)
    partial = home / "lib.partial"
    shutil.rmtree(partial, ignore_errors=True)
    mvn = require_executable("mvn", "install Maven 3 (apt-get install maven)")
    command = [
        mvn,
        "--batch-mode",
        "--quiet",
        "--no-transfer-progress",
        "--file",
        str(POM),
        f"-Dmaven.repo.local={cache_dir() / 'm2'}",
        f"-Dkafka.version={KAFKA_VERSION}",
        f"-Ddebezium.version={DEBEZIUM_VERSION}",
        "dependency:copy-dependencies",
        f"-DoutputDirectory={partial}",
        "-DincludeScope=runtime",
    ]
    result = subprocess.run(
        command, cwd=home, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    connector = partial / f"debezium-connector-postgres-{DEBEZIUM_VERSION}.jar"
    if result.returncode != 0 or not connector.is_file():
        output = "\n".join((result.stdout + result.stderr).splitlines()[-20:])
        raise DevstackError(
            f"Maven could not resolve Debezium {DEBEZIUM_VERSION} with Connect {KAFKA_VERSION} "
            f"(exit code {result.returncode}): {' '.join(command)}\n{output}"
        )
    shutil.rmtree(lib, ignore_errors=True)
    partial.rename(lib)
    marker.write_text(stamp)
    return lib


def worker_properties(bootstrap: str, offsets: Path) -> dict[str, str]:
    """Connect standalone's worker: string converters, producer settings like cdc-relay's."""
    return {
        "bootstrap.servers": bootstrap,
        # Key and value as the strings they are: aggregate_id, and the payload's jsonb text.
        "key.converter": "org.apache.kafka.connect.storage.StringConverter",
        "value.converter": "org.apache.kafka.connect.storage.StringConverter",
        "offset.storage.file.filename": str(offsets),
        # Debezium confirms the slot's LSN when Connect commits offsets: the default is 60 s.
        "offset.flush.interval.ms": "1000",
        "listeners": f"http://127.0.0.1:{free_ports()[0]}",
        # cdc-relay's producer: idempotent, acks=all, lz4, linger 10 ms, librdkafka's 1 MB
        # batches and its 128 MiB queue.
        "producer.acks": "all",
        "producer.enable.idempotence": "true",
        "producer.compression.type": "lz4",
        "producer.linger.ms": "10",
        "producer.batch.size": "1000000",
        "producer.buffer.memory": str(128 * 1024 * 1024),
    }


def connector_properties(
    *,
    host: str,
    port: int,
    user: str,
    database: str,
    slot: str,
    publication: str,
    topic_prefix: str,
) -> dict[str, str]:
    """The PostgreSQL connector on its own slot and publication, with the Outbox Event Router
    mapped onto cdc-relay's outbox columns and topic naming."""
    return {
        "name": "outbox",
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": "1",
        "database.hostname": host,
        "database.port": str(port),
        "database.user": user,
        "database.password": "unused",  # trust authentication on loopback
        "database.dbname": database,
        "topic.prefix": f"{topic_prefix}.debezium",
        "plugin.name": "pgoutput",
        "slot.name": slot,
        "publication.name": publication,
        "publication.autocreate.mode": "disabled",  # made beforehand, as for cdc-relay
        "table.include.list": "public.outbox_events",
        # The events are in the slot: stream them, take no snapshot of the table.
        "snapshot.mode": "no_data",
        # Tuned up from 2048 / 8192 / 500 ms: bigger batches, and no half-second nap when the
        # queue runs empty (the steady workload's latency would be mostly that nap).
        "max.batch.size": "10240",
        "max.queue.size": "40960",
        "poll.interval.ms": "10",
        # Without Debezium's four context headers the messages match cdc-relay's.
        "extended.headers.enabled": "false",
        "transforms": "outbox",
        "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
        "transforms.outbox.table.field.event.id": "id",
        "transforms.outbox.table.field.event.key": "aggregate_id",
        "transforms.outbox.table.field.event.payload": "payload",
        "transforms.outbox.table.expand.json.payload": "false",
        "transforms.outbox.table.fields.additional.placement": (
            "event_type:header:event_type,aggregate_type:header:aggregate_type"
        ),
        "transforms.outbox.route.by.field": "aggregate_type",
        # cdc-relay's --topic-template <prefix>.{aggregate_type}
        "transforms.outbox.route.topic.replacement": f"{topic_prefix}.${{routedByValue}}",
    }


def write_properties(path: Path, properties: Mapping[str, str]) -> Path:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\")

    path.write_text("".join(f"{key}={escape(value)}\n" for key, value in properties.items()))
    return path


def command(lib: Path, log4j2: Path, worker: Path, connector: Path) -> list[str]:
    return [
        _java(),
        *JVM_FLAGS,
        f"-Dlog4j2.configurationFile={log4j2}",
        "-cp",
        f"{lib}/*",
        "org.apache.kafka.connect.cli.ConnectStandalone",
        str(worker),
        str(connector),
    ]
