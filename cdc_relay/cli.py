"""The ``cdc-relay`` command: parse options, build objects, run. No logic of its own."""

from __future__ import annotations

import json
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
from cdc_relay.errors import RelayError, UsageError
from cdc_relay.events import OutboxLayout
from cdc_relay.metrics import Health, serve
from cdc_relay.routing import DEFAULT_TOPIC_TEMPLATE
from cdc_relay.sink import producer_config
from cdc_relay.slot import SlotSpec, drop, setup, status
from cdc_relay.stream import StreamRelay, StreamSettings

F = TypeVar("F", bound=Callable[..., Any])


def _option(name: str, *more: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option that also reads CDC_RELAY_<NAME> and shows it in --help."""
    return click.option(name, *more, envvar=env(name), show_envvar=True, **kwargs)


_DSN = _option(
    "--dsn",
    required=True,
    help="libpq connection string or URI of the database with the outbox. Give "
    "the password through PGPASSWORD or a .pgpass file, not here.",
)
_TABLE = _option(
    "--table",
    default=DEFAULT_TABLE,
    show_default=True,
    help="The outbox table, optionally schema-qualified.",
)


def database_options(func: F) -> F:
    for decorate in reversed(
        [
            _DSN,
            _option("--slot", default=DEFAULT_SLOT, show_default=True, help="Replication slot."),
            _option(
                "--publication",
                default=DEFAULT_PUBLICATION,
                show_default=True,
                help="Publication on the outbox table.",
            ),
            _TABLE,
        ]
    ):
        func = decorate(func)
    return func


def metrics_options(func: F) -> F:
    func = _option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=0,
        show_default=True,
        help="Serve /metrics, /healthz and /readyz on this port; 0 turns them off.",
    )(func)
    return _option(
        "--metrics-host",
        default="0.0.0.0",  # noqa: S104 - in a container, probes and scrapes come from outside
        show_default=True,
        help="Address to serve metrics and health on.",
    )(func)


def start_metrics(host: str, port: int) -> Health:
    """The health state the relay updates, served over HTTP when ``port`` is set."""
    health = Health()
    if port:
        try:
            serve(host, port, health)
        except OSError as exc:
            raise UsageError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror}; "
                "choose another --metrics-port"
            ) from None
    return health


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


def kafka_options(required: bool = True) -> Callable[[F], F]:
    """Where and how events are published: every command that publishes takes the same."""

    def decorate(func: F) -> F:
        for option in reversed(
            [
                _option(
                    "--kafka-bootstrap",
                    required=required,
                    help="Kafka bootstrap servers, host:port[,host:port...].",
                ),
                _option(
                    "--kafka-config",
                    multiple=True,
                    metavar="KEY=VALUE",
                    help="A librdkafka setting (repeatable), e.g. security.protocol=SASL_SSL.",
                ),
                _option(
                    "--kafka-config-file",
                    type=click.Path(exists=True, dir_okay=False, path_type=Path),
                    help="A properties file of librdkafka settings; --kafka-config wins over it.",
                ),
                _option(
                    "--topic-template",
                    default=DEFAULT_TOPIC_TEMPLATE,
                    show_default=True,
                    help="Topic of each event; may use {aggregate_type} and {event_type}.",
                ),
                _option(
                    "--tombstone-on-empty-payload",
                    is_flag=True,
                    help="Publish NULL and empty payloads as tombstones (null value); without "
                    "it a NULL payload stops the relay.",
                ),
                _option(
                    "--kafka-timeout",
                    type=click.FloatRange(0.1, 3600),
                    default=15.0,
                    show_default=True,
                    help="Seconds to wait for a broker to answer at start-up.",
                ),
            ]
        ):
            func = option(func)
        return func

    return decorate


def run_options(func: F) -> F:
    func = _option(
        "--shutdown-timeout",
        type=click.FloatRange(0, 3600),
        default=30.0,
        show_default=True,
        help="Seconds to wait for Kafka's acks when stopping.",
    )(func)
    return _option(
        "--progress-interval",
        type=click.FloatRange(0.5, 86400),
        default=10.0,
        show_default=True,
        help="Seconds between progress lines in the log.",
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


@cli.command("status")
@database_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
@click.option(
    "--max-wal-retained",
    type=int,
    metavar="BYTES",
    help="Exit 3 when the slot holds back more WAL than this.",
)
@click.option(
    "--max-unprocessed", type=int, metavar="N", help="Exit 3 above N unprocessed rows (poller)."
)
@click.option(
    "--max-dead-letters", type=int, metavar="N", help="Exit 3 above N dead letters (poller)."
)
@click.option("--require-active", is_flag=True, help="Exit 3 when no relay streams the slot.")
def status_command(
    dsn: str,
    slot: str,
    publication: str,
    table: str,
    as_json: bool,
    max_wal_retained: int | None,
    max_unprocessed: int | None,
    max_dead_letters: int | None,
    require_active: bool,
) -> None:
    """Show the slot and the outbox: active, confirmed LSN, WAL retained, pending rows.

    With thresholds it is a check for scripts and cron: exit 3 when one is crossed.
    """
    state = status(dsn, slot, table)
    alerts = []
    if not state["exists"]:
        alerts.append(f"slot {slot} does not exist")
    if require_active and not state["active"]:
        alerts.append(f"no relay is streaming slot {slot}")
    for key, limit, what in (
        ("wal_retained_bytes", max_wal_retained, "bytes of WAL retained"),
        ("unprocessed_rows", max_unprocessed, "unprocessed rows"),
        ("dead_letters", max_dead_letters, "dead letters"),
    ):
        if limit is not None and (state[key] or 0) > limit:
            alerts.append(f"{state[key]} {what} (limit {limit})")
    if as_json:
        click.echo(json.dumps({**state, "alerts": alerts}))
    else:
        rows = [
            ("slot", slot if state["exists"] else f"{slot} (missing)"),
            ("active", f"yes (pid {state['active_pid']})" if state["active"] else "no"),
            ("plugin", state["plugin"] or "-"),
            ("confirmed LSN", state["confirmed_flush_lsn"] or "-"),
            ("WAL retained", _bytes(state["wal_retained_bytes"])),
            ("outbox table", state["table"]),
            ("unprocessed rows", _count(state["unprocessed_rows"])),
            ("dead letters", _count(state["dead_letters"])),
        ]
        for name, value in rows:
            click.echo(f"{name:<17} {value}")
        for alert in alerts:
            click.echo(f"ALERT: {alert}", err=True)
    if alerts:
        sys.exit(3)


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


@cli.command("stream")
@database_options
@kafka_options()
@_option(
    "--status-interval",
    type=click.FloatRange(0.1, 3600),
    default=10.0,
    show_default=True,
    help="Seconds between standby status updates; keep well under wal_sender_timeout.",
)
@run_options
@_option(
    "--column",
    "columns",
    multiple=True,
    metavar="FIELD=COLUMN",
    help="Map an event field (id, aggregate_type, aggregate_id, event_type, payload) to a "
    "column of your outbox table; repeatable.",
)
@_option(
    "--header-column",
    "header_columns",
    multiple=True,
    metavar="COLUMN",
    help="Send this column of the outbox table as a header of the same name; repeatable.",
)
@_option(
    "--message-prefix",
    default="outbox",
    show_default=True,
    help="Prefix of pg_logical_emit_message() messages that carry events.",
)
@_option(
    "--dead-letter-topic",
    help="Send events Kafka refuses for good (too large, ...) here, with the error in "
    "headers, and go on; without it the relay stops at such an event.",
)
@metrics_options
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
    columns: tuple[str, ...],
    header_columns: tuple[str, ...],
    message_prefix: str,
    tombstone_on_empty_payload: bool,
    dead_letter_topic: str | None,
    metrics_port: int,
    metrics_host: str,
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
        layout=OutboxLayout.from_options(columns, header_columns),
        message_prefix=message_prefix,
        tombstone_on_empty=tombstone_on_empty_payload,
        dead_letter_topic=dead_letter_topic,
    )
    relay = StreamRelay(settings, start_metrics(metrics_host, metrics_port))
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
