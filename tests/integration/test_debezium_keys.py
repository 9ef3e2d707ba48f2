"""Coming from Debezium: where an aggregate's events land, by the key converter Debezium used.

cdc-relay's key is the aggregate id's bytes, placed by Kafka's murmur2 rule as Java producers
do. A Debezium connector's key went through its key converter first: with StringConverter
the bytes are the same, so an aggregate's events stay in one partition across the switch; with
JsonConverter (Kafka Connect's default) they are JSON, which hashes elsewhere, so the switch
moves aggregates to other partitions. Kafka Connect's own converters, run in a JVM, say where
each key would land; the relay, run against the real services, says where it put them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from relaytools import RelayProcess, Writer, consume, create_topics, relay_env, setup_slot

from cdc_relay.devstack import cache_dir
from cdc_relay.devstack.kafka import KAFKA_VERSION

pytestmark = pytest.mark.integration

TOOL = Path(__file__).resolve().parents[1] / "tools" / "key_converters"
PARTITIONS = 6
IDS = [f"order-{i}" for i in range(40)] + ["0", "ä-ü", "42", "a b", 'quote"d']


@pytest.fixture(scope="module")
def converter_jars() -> Path:
    """connect-json and its dependencies at the broker's Kafka version, resolved once."""
    lib = cache_dir() / f"key-converters-{KAFKA_VERSION}"
    if not (lib / f"connect-json-{KAFKA_VERSION}.jar").is_file():
        mvn = shutil.which("mvn")
        assert mvn, "Maven is needed to resolve Kafka Connect's converters"
        partial = lib.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run(
            [
                mvn,
                "--batch-mode",
                "--quiet",
                "--no-transfer-progress",
                "--file",
                str(TOOL / "pom.xml"),
                f"-Dmaven.repo.local={cache_dir() / 'm2'}",
                f"-Dkafka.version={KAFKA_VERSION}",
                "dependency:copy-dependencies",
                f"-DoutputDirectory={partial}",
                "-DincludeScope=runtime",
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        shutil.rmtree(lib, ignore_errors=True)
        partial.rename(lib)
    return lib


def converter_partitions(jars: Path) -> dict[str, tuple[int, int, int]]:
    """Per aggregate id: its partition with StringConverter, JsonConverter without schemas, and
    JsonConverter with schemas (the default), as Kafka Connect and Kafka's partitioner put it."""
    java = shutil.which("java")
    assert java, "Java is needed to run Kafka Connect's converters"
    result = subprocess.run(
        [java, "-cp", f"{jars}/*", str(TOOL / "KeyPartitions.java"), str(PARTITIONS)],
        input="\n".join(IDS) + "\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    return {row[0]: (int(row[1]), int(row[2]), int(row[3])) for row in rows}


def test_keys_land_where_debeziums_string_converter_put_them_not_where_json_did(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, converter_jars: Path
) -> None:
    topic = f"{names.topic_prefix}.order"
    create_topics(kafka_service.bootstrap, {topic: {}}, partitions=PARTITIONS)
    setup_slot(outbox_db, names)
    relay = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names)).start()
    try:
        writer = Writer(outbox_db)
        for aggregate_id in IDS:
            writer.transaction([("order", aggregate_id, {"id": aggregate_id})])
        writer.close()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(IDS))
    finally:
        relay.close()
    placed = {message.key.decode(): message.partition for message in received if message.key}
    assert sorted(placed) == sorted(IDS)

    java = converter_partitions(converter_jars)
    assert sorted(java) == sorted(IDS)
    print(f"{'aggregate id':14} relay string json json+schema")
    for i in IDS:
        print(f"{i:14} {placed[i]:5} {java[i][0]:6} {java[i][1]:4} {java[i][2]:11}")
    # With StringConverter, every aggregate keeps its partition across the switch.
    assert all(placed[i] == java[i][0] for i in IDS)
    # With JsonConverter, with or without schemas, most move: the keys' bytes differ.
    for column, name in ((1, "JsonConverter"), (2, "JsonConverter with schemas")):
        moved = [i for i in IDS if java[i][column] != placed[i]]
        assert len(moved) > len(IDS) // 2, f"{name}: only {moved} moved"
