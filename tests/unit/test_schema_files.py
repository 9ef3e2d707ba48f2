"""The outbox schema ships in the package, and the repository's sql/ is the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import cdc_relay
from cdc_relay import schema
from cdc_relay.commands.cli import cli
from cdc_relay.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_SQL = Path(cdc_relay.__file__).parent / "sql"


@pytest.mark.parametrize("name", list(schema.SCHEMAS))
def test_schema_show_prints_the_file_the_package_ships(name: str) -> None:
    shown = CliRunner().invoke(cli, ["schema", "show", name])
    assert shown.exit_code == 0, shown.output
    assert shown.output == (PACKAGE_SQL / f"{name}.sql").read_text()
    # One source of truth: sql/NAME.sql of a checkout is that very file, not a copy.
    assert (ROOT / "sql" / f"{name}.sql").samefile(PACKAGE_SQL / f"{name}.sql")


def test_the_package_data_is_every_schema_and_no_file_names_a_repository_path() -> None:
    assert {path.stem for path in PACKAGE_SQL.glob("*.sql")} == {*schema.SCHEMAS, "queries"}
    for path in Path(cdc_relay.__file__).parent.rglob("*.py"):
        text = path.read_text()
        for name in schema.SCHEMAS:
            assert f"sql/{name}.sql" not in text, f"{path} names sql/{name}.sql"


def test_roles_is_a_psql_script_and_apply_says_how_to_run_it() -> None:
    with pytest.raises(UsageError, match=r"cdc-relay schema show roles \| psql"):
        schema.applicable("roles")
    assert "\\getenv stream_password CDC_RELAY_STREAM_PASSWORD" in schema.text("roles")


def test_an_unknown_schema_is_refused_with_the_names() -> None:
    shown = CliRunner().invoke(cli, ["schema", "show", "orders"])
    assert shown.exit_code == 2
    assert "'orders' is not one of 'outbox', 'poller', 'consumer', 'roles'" in shown.output
