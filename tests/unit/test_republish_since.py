"""setup-slot --republish-since: TIME is read before anything is done, and the options it
cannot go with are refused in one line."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cdc_relay.commands import setup_slot
from cdc_relay.commands.cli import cli
from cdc_relay.errors import RelayError, UsageError

DSN = ["--dsn", "host=db.invalid", "--kafka-bootstrap", "kafka.invalid:9092"]


@pytest.mark.parametrize(
    ("text", "since"),
    [
        ("90s", timedelta(seconds=90)),
        ("2h", timedelta(hours=2)),
        ("7d", timedelta(days=7)),
        ("2026-01-05T09:00:00Z", datetime(2026, 1, 5, 9, tzinfo=UTC)),
        ("2026-01-05 10:00+01:00", datetime(2026, 1, 5, 9, tzinfo=UTC)),
    ],
)
def test_an_age_or_a_moment_with_its_zone_reaches_the_republish(
    monkeypatch: pytest.MonkeyPatch, text: str, since: Any
) -> None:
    seen: list[Any] = []

    def republish(settings: Any, spec: Any, moment: Any, layout: Any) -> Any:
        seen.append((moment, layout.header_columns, layout.aggregate_id))
        raise SystemExit(0)

    monkeypatch.setattr(setup_slot, "republish", republish)
    result = CliRunner().invoke(
        cli,
        [
            "setup-slot",
            *DSN,
            "--republish-since",
            text,
            "--header-column",
            "tenant",
            "--column",
            "aggregate_id=aggregateid",
        ],
    )
    assert result.exit_code == 0, result.output
    assert seen == [(since, ("tenant",), "aggregateid")]


@pytest.mark.parametrize(
    "text", ["yesterday", "2026-01-05T09:00:00", "2026-01-05", "-2h", "2x", "", "nan h"]
)
def test_a_time_without_zone_or_unit_is_refused_before_anything_is_done(text: str) -> None:
    result = CliRunner().invoke(cli, ["setup-slot", *DSN, "--republish-since", text])
    assert result.exit_code == 2, result.output
    assert f"{text!r} is neither an ISO 8601 moment with its zone" in result.output


@pytest.mark.parametrize(
    "option", [["--shards", "2"], ["--failover"], ["--from-poller"], ["--dry-run"]]
)
def test_what_it_cannot_go_with_is_refused_in_one_line(option: list[str]) -> None:
    result = CliRunner().invoke(cli, ["setup-slot", *DSN, "--republish-since", "2h", *option])
    assert isinstance(result.exception, UsageError), result.output
    assert str(result.exception).startswith("--republish-since makes one plain slot for one ")


def test_header_columns_are_for_the_republish_alone() -> None:
    result = CliRunner().invoke(cli, ["setup-slot", *DSN, "--header-column", "tenant"])
    assert isinstance(result.exception, UsageError), result.output
    assert str(result.exception).startswith("--header-column is for --republish-since")


@pytest.mark.parametrize("where", ["env", "file"])
def test_stream_header_columns_shared_with_it_are_left_for_a_republish(
    where: str, tmp_path: Path
) -> None:
    """One environment or config file serves setup-slot and stream: stream's header columns
    there do not make setup-slot refuse to run (it reaches the database, here none)."""
    dsn = "host=127.0.0.1 port=1 dbname=shop connect_timeout=1"
    config = tmp_path / "cdc-relay.toml"
    config.write_text('header-column = ["traceparent"]\n')
    env = {"CDC_RELAY_HEADER_COLUMN": "traceparent"} if where == "env" else {}
    more = ["--config", str(config)] if where == "file" else []
    result = CliRunner().invoke(cli, ["setup-slot", "--dsn", dsn, *more], env=env)
    assert isinstance(result.exception, RelayError), result.output
    assert str(result.exception).startswith("cannot connect to PostgreSQL"), result.exception
