"""The hosts setup-slot --failover checks, from a multi-host connection string."""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict

from cdc_relay.postgres.failover import hosts, slot_gone


def test_each_host_of_a_multi_host_dsn_alone_without_target_session_attrs() -> None:
    dsn = "host=db-1,db-2 port=5432,5433 dbname=app user=relay target_session_attrs=read-write"
    common = {"dbname": "app", "user": "relay", "connect_timeout": "5"}
    assert [(label, conninfo_to_dict(one)) for label, one in hosts(dsn)] == [
        ("db-1:5432", {**common, "host": "db-1", "port": "5432"}),
        ("db-2:5433", {**common, "host": "db-2", "port": "5433"}),
    ]


def test_one_port_serves_every_host_and_uris_work_too() -> None:
    assert [label for label, _ in hosts("host=a,b port=6000 dbname=x")] == ["a:6000", "b:6000"]
    assert [label for label, _ in hosts("postgresql://u@h1:1,h2:2/db")] == ["h1:1", "h2:2"]
    assert hosts("dbname=x") == [("localhost:5432", "dbname=x connect_timeout=5")]


def test_a_missing_slot_is_explained_only_past_the_first_timeline() -> None:
    assert slot_gone("s", None) is None
    assert slot_gone("s", 1) is None
    message = slot_gone("s", 3)
    assert message is not None
    assert message.startswith("replication slot 's' does not exist on this server, which is on ")
    assert "\n" not in message
