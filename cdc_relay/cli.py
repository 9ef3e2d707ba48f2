"""The ``cdc-relay`` command: parse options, build objects, run. No logic of its own."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from cdc_relay import __version__, logs
from cdc_relay.config import (
    DEFAULT_PUBLICATION,
    DEFAULT_SLOT,
    DEFAULT_TABLE,
    env,
    kafka_settings,
)
from cdc_relay.errors import RelayError
from cdc_relay.routing import DEFAULT_TOPIC_TEMPLATE
from cdc_relay.sink import producer_config
from cdc_relay.slot import SlotSpec, drop, setup
from cdc_relay.stream import StreamRelay, StreamSettings

F = TypeVar("F", bound=Callable[..., Any])


def _option(name: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option that also reads CDC_RELAY_<NAME> and shows it in --help."""
    return click.option(name, envvar=env(name), show_envvar=True, **kwargs)


def database_options(func: F) -> F:
    for decorate in reversed(
        [
            _option(
                "--dsn",
                required=True,
                help="libpq connection string or URI of the database with the outbox. Give "
                "the password through PGPASSWORD or a .pgpass file, not here.",
            ),
            _option("--slot", default=DEFAULT_SLOT, show_default=True, help="Replication slot."),
            _option(
                "--publication",
                default=DEFAULT_PUBLICATION,
                show_default=True,
                help="Publication on the outbox table.",
            ),
            _option(
                "--table",
                default=DEFAULT_TABLE,
                show_default=True,
                help="The outbox table, optionally schema-qualified.",
            ),
        ]
    ):
        func = decorate(func)
    return func


def log_options(func: F) -> F:
    func = _option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="Log lines for people or JSON lines for machines.",
    )(func)
    return _option(
        "--log-level",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        default="INFO",
        show_default=True,
    )(func)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cdc-relay")
def cli() -> None:
    """Relay transactional-outbox events from PostgreSQL to Kafka.

    Every option can also be set by its CDC_RELAY_* environment variable.
    """


@cli.command("setup-slot")
@database_options
@_option(
    "--plugin",
    type=click.Choice(["pgoutput", "wal2json"]),
    default="pgoutput",
    show_default=True,
    help="Logical decoding plugin of the slot.",
)
@click.option(
    "--dry-run", is_flag=True, help="Check the database and print the SQL; change nothing."
)
def setup_slot(
    dsn: str, slot: str, publication: str, table: str, plugin: str, dry_run: bool
) -> None:
    """Check the database and create the publication and the replication slot.

    Safe to run again: what exists already is reported and left as it is.
    """
    spec = SlotSpec(slot=slot, publication=publication, table=table, plugin=plugin)
    report = setup(dsn, spec, dry_run=dry_run)
    if dry_run:
        click.echo("-- preflight passed; setup-slot would run:")
        for statement in report.statements or ["-- nothing: everything exists"]:
            click.echo(statement)
    for line in report.existing:
        click.echo(f"exists: {line}")
    for line in report.done:
        click.echo(line)


@cli.command("drop-slot")
@database_options
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def drop_slot(dsn: str, slot: str, publication: str, table: str, yes: bool) -> None:
    """Remove the replication slot and the publication.

    Events committed since the slot's last confirmed position will not be relayed.
    """
    if not yes:
        click.confirm(
            f"Drop slot {slot} and publication {publication}? Unrelayed events are lost",
            abort=True,
        )
    removed = drop(dsn, SlotSpec(slot=slot, publication=publication, table=table))
    click.echo("dropped " + ", ".join(removed) if removed else "nothing to drop")


@cli.command("stream")
@database_options
@_option(
    "--kafka-bootstrap",
    required=True,
    help="Kafka bootstrap servers, host:port[,host:port...].",
)
@_option(
    "--kafka-config",
    multiple=True,
    metavar="KEY=VALUE",
    help="A librdkafka setting (repeatable), e.g. security.protocol=SASL_SSL.",
)
@_option(
    "--kafka-config-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A properties file of librdkafka settings; --kafka-config wins over it.",
)
@_option(
    "--topic-template",
    default=DEFAULT_TOPIC_TEMPLATE,
    show_default=True,
    help="Topic of each event; may use {aggregate_type} and {event_type}.",
)
@_option(
    "--status-interval",
    type=click.FloatRange(0.1, 3600),
    default=10.0,
    show_default=True,
    help="Seconds between standby status updates; keep well under wal_sender_timeout.",
)
@_option(
    "--shutdown-timeout",
    type=click.FloatRange(0, 3600),
    default=30.0,
    show_default=True,
    help="Seconds to wait for Kafka's acks when stopping.",
)
@_option(
    "--kafka-timeout",
    type=click.FloatRange(0.1, 3600),
    default=15.0,
    show_default=True,
    help="Seconds to wait for a broker to answer at start-up.",
)
@_option(
    "--progress-interval",
    type=click.FloatRange(0.5, 86400),
    default=10.0,
    show_default=True,
    help="Seconds between progress lines in the log.",
)
@log_options
def stream(
    dsn: str,
    slot: str,
    publication: str,
    table: str,
    kafka_bootstrap: str,
    kafka_config: tuple[str, ...],
    kafka_config_file: Path | None,
    topic_template: str,
    status_interval: float,
    shutdown_timeout: float,
    kafka_timeout: float,
    progress_interval: float,
    log_format: str,
    log_level: str,
) -> None:
    """Stream the slot to Kafka; confirm positions only after Kafka acknowledged them.

    Stops cleanly on SIGTERM or Ctrl-C: waits for acks, confirms, exits 0.
    """
    logs.configure(log_format, log_level)
    settings = StreamSettings(
        dsn=dsn,
        slot=slot,
        publication=publication,
        table=table,
        kafka_config=producer_config(
            kafka_bootstrap, kafka_settings(kafka_config, kafka_config_file)
        ),
        topic_template=topic_template,
        status_interval=status_interval,
        shutdown_timeout=shutdown_timeout,
        kafka_timeout=kafka_timeout,
        progress_interval=progress_interval,
    )
    relay = StreamRelay(settings)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: relay.request_stop())
    relay.run()


def main() -> None:
    """Console entry point: user-facing errors become one line on stderr, not a traceback."""
    try:
        code = cli.main(prog_name="cdc-relay", standalone_mode=False)
    except RelayError as exc:
        click.echo(f"cdc-relay: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
