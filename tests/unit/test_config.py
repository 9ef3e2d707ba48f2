from __future__ import annotations

from pathlib import Path

import pytest

from cdc_relay.config import checked_dsn, env, hide_passwords, kafka_settings
from cdc_relay.errors import UsageError
from cdc_relay.kafka.sink import producer_config
from cdc_relay.lsn import format_lsn, parse


def test_lsn_round_trip() -> None:
    assert parse("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert format_lsn(parse("0/1928D70")) == "0/1928D70"
    with pytest.raises(UsageError):
        parse("12345")


def test_env_names() -> None:
    assert env("--kafka-bootstrap") == "CDC_RELAY_KAFKA_BOOTSTRAP"


def test_kafka_settings_file_then_pairs(tmp_path: Path) -> None:
    props = tmp_path / "client.properties"
    props.write_text("# comment\nsecurity.protocol = SSL\nlinger.ms=5\n")
    settings = kafka_settings(["linger.ms=50"], props)
    assert settings == {"security.protocol": "SSL", "linger.ms": "50"}
    with pytest.raises(UsageError):
        kafka_settings(["novalue"], None)


def test_producer_config_keeps_the_guarantees() -> None:
    config = producer_config("k:9092", {"compression.type": "zstd"})
    assert config["enable.idempotence"] == "true"
    assert config["acks"] == "all"
    assert config["partitioner"] == "murmur2_random"
    assert config["compression.type"] == "zstd"
    with pytest.raises(UsageError, match="acks"):
        producer_config("k:9092", {"acks": "1"})
    with pytest.raises(UsageError, match=r"enable\.idempotence"):
        producer_config("k:9092", {"enable.idempotence": "false"})


@pytest.mark.parametrize("key", ["max.in.flight.requests.per.connection", "max.in.flight"])
def test_one_produce_request_is_in_flight_and_a_user_may_not_send_more(key: str) -> None:
    # With five in flight (librdkafka's default), a batch the broker refused as not the new
    # partition's leader was reported delivered once the next batch was accepted: a poller
    # marked the row processed and Kafka never had it (test_poller.py, after a broker restart).
    assert producer_config("k:9092", {})["max.in.flight.requests.per.connection"] == "1"
    assert producer_config("k:9092", {key: "1"})["max.in.flight.requests.per.connection"] == "1"
    with pytest.raises(UsageError, match="reported delivered") as refused:
        producer_config("k:9092", {key: "5"})
    assert "max.in.flight.requests.per.connection=1: remove the setting" in str(refused.value)


def test_kafka_sasl_password_from_the_environment(tmp_path: Path) -> None:
    props = tmp_path / "client.properties"
    props.write_text("sasl.username=relay\nsasl.password=from-file\n")
    environ = {"CDC_RELAY_KAFKA_SASL_PASSWORD": "from-env"}
    assert kafka_settings([], props, environ)["sasl.password"] == "from-env"
    assert kafka_settings(["sasl.password=from-flag"], props, environ)["sasl.password"] == (
        "from-flag"
    )
    assert kafka_settings([], props, {})["sasl.password"] == "from-file"
    assert "sasl.password" not in kafka_settings([], None, {"CDC_RELAY_KAFKA_SASL_PASSWORD": ""})


@pytest.mark.parametrize(
    "dsn", ["postgresql://relay:pw-s3cret@[::1/shop", "host=db password=pw s3cret user=relay"]
)
def test_a_dsn_libpq_cannot_parse_is_refused_without_repeating_it(dsn: str) -> None:
    with pytest.raises(UsageError, match="--dsn is neither") as refused:
        checked_dsn(dsn)
    assert "s3cret" not in str(refused.value)
    assert checked_dsn("host=db user=relay password='pw s3cret'") == (
        "host=db user=relay password='pw s3cret'"
    )


def test_properties_file_takes_the_java_separators(tmp_path: Path) -> None:
    props = tmp_path / "client.properties"
    props.write_text(
        "! a comment too\n"
        "  security.protocol=SASL_SSL\n"
        "sasl.mechanisms: SCRAM-SHA-512\n"
        "sasl.username   relay\n"
        "sasl.password : pw:with=separators\n"
        "ssl.ca.location = /etc/ca.pem  \n"
        "client.id=\n"
        "bootstrap.servers=a:9092,\\\n"
        "    b:9092\n"
    )
    assert kafka_settings([], props, {}) == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "relay",
        "sasl.password": "pw:with=separators",
        "ssl.ca.location": "/etc/ca.pem",
        "client.id": "",
        "bootstrap.servers": "a:9092,b:9092",
    }
    assert kafka_settings(["linger.ms: 5", "acks all"], None, {}) == {
        "linger.ms": "5",
        "acks": "all",
    }


@pytest.mark.parametrize(
    ("line", "where"),
    [
        ("=hunter2", "client.properties:2: the setting has no key"),
        (": hunter2", "client.properties:2: the setting has no key"),
        ("hunter2", "client.properties:2: the setting is a key without a value"),
    ],
)
def test_a_bad_properties_line_is_named_by_its_place_never_by_its_value(
    tmp_path: Path, line: str, where: str
) -> None:
    props = tmp_path / "client.properties"
    props.write_text(f"sasl.username=relay\n{line}\n")
    with pytest.raises(UsageError) as refused:
        kafka_settings([], props, {})
    assert str(refused.value).startswith(f"{props.parent}/{where}; write key=value")
    assert "hunter2" not in str(refused.value)
    with pytest.raises(UsageError) as refused:
        kafka_settings([line], None, {})
    assert str(refused.value).startswith("--kafka-config: the setting")
    assert "hunter2" not in str(refused.value)


def test_an_unreadable_properties_file_is_a_usage_error(tmp_path: Path) -> None:
    props = tmp_path / "client.properties"
    props.write_bytes(b"sasl.password=\xff\n")
    with pytest.raises(UsageError, match="cannot read --kafka-config-file"):
        kafka_settings([], props, {})


@pytest.mark.parametrize(
    ("argv", "hidden"),
    [
        (
            ["cdc-relay", "stream", "--dsn", "host=db password=hunter2 user=relay"],
            ["cdc-relay", "stream", "--dsn", "user=relay password=*** host=db"],
        ),
        (
            ["cdc-relay", "poll", "--dsn=postgresql://relay:hunter2@db/shop", "--workers", "2"],
            [
                "cdc-relay",
                "poll",
                "--dsn=user=relay password=*** dbname=shop host=db",
                "--workers",
                "2",
            ],
        ),
        (
            ["x", "--dsn", "host=db sslpassword=hunter2"],
            ["x", "--dsn", "host=db sslpassword=***"],
        ),
        (
            ["x", "--kafka-config", "sasl.password: hunter2", "--kafka-config=ssl.key.pem=hunter2"],
            ["x", "--kafka-config", "sasl.password=***", "--kafka-config=ssl.key.pem=***"],
        ),
        (  # librdkafka's JWT bearer grant (2.10 and later): a private key and its passphrase
            [
                "x",
                "--kafka-config",
                "sasl.oauthbearer.assertion.private.key.passphrase=hunter2",
                "--kafka-config=sasl.oauthbearer.assertion.private.key.pem=hunter2",
            ],
            [
                "x",
                "--kafka-config",
                "sasl.oauthbearer.assertion.private.key.passphrase=***",
                "--kafka-config=sasl.oauthbearer.assertion.private.key.pem=***",
            ],
        ),
    ],
)
def test_hide_passwords_replaces_each_one(argv: list[str], hidden: list[str]) -> None:
    masked, options = hide_passwords(argv)
    assert masked == hidden
    assert options == [o for o in ("--dsn", "--kafka-config") if any(o in a for a in argv)]
    assert "hunter2" not in " ".join(masked)


def test_hide_passwords_leaves_a_command_line_without_one_alone() -> None:
    argv = ["x", "stream", "--dsn", "host=db user=relay", "--kafka-config", "linger.ms=5"]
    assert hide_passwords(argv) == (argv, [])
    # one libpq cannot parse is hidden whole (start-up refuses it, without a warning first)
    assert hide_passwords(["x", "--dsn", "postgresql://u:hunter2@[::1/db"]) == (
        ["x", "--dsn", "***"],
        [],
    )
