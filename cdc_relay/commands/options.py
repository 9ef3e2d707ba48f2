"""The options the commands share: ``env_option`` (each also read from its CDC_RELAY_*
variable, the one naming rule; the file of ``--config`` is config_file.py's), the types and
callbacks that check a value (``Seconds``, ``age``, ``since``), and the database's options
(dsn, slot, publication, outbox tables, columns, shards, message writers).
Kafka's and a relay's options are in ``kafka_options``."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from cdc_relay.config import DEFAULT_PUBLICATION, DEFAULT_SLOT, DEFAULT_TABLE, checked_dsn, env
from cdc_relay.postgres.messages import DEFAULT_WRITER
from cdc_relay.postgres.shards import MAX_SHARDS, every_shard
from cdc_relay.postgres.slot import SlotSpec

F = TypeVar("F", bound=Callable[..., Any])


def env_option(
    name: str, *more: str, deprecated_envvar: str | None = None, **kwargs: Any
) -> Callable[[F], F]:
    """A click option that also reads CDC_RELAY_<NAME> and shows it in --help; with
    ``deprecated_envvar``, also an older name, read after the new one, with a warning."""
    if deprecated_envvar is None:
        return click.option(name, *more, envvar=env(name), show_envvar=True, **kwargs)
    callback = kwargs.pop("callback", None)

    def warn(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        source = ctx.get_parameter_source(str(param.name))
        if source is ParameterSource.ENVIRONMENT and not os.environ.get(env(name)):
            click.echo(
                f"cdc-relay: warning: {deprecated_envvar} is deprecated; set {env(name)} "
                f"instead (or {name[2:]} in the config file's [{ctx.command.name}])",
                err=True,
            )
        return value if callback is None else callback(ctx, param, value)

    return click.option(
        name,
        *more,
        envvar=[env(name), deprecated_envvar],
        show_envvar=True,
        callback=warn,
        **kwargs,
    )


def _dsn(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return checked_dsn(value)


class Seconds(click.FloatRange):
    """A duration in seconds within a range. NaN is refused too, which a plain FloatRange
    lets through (every comparison with NaN is false), and so is infinity."""

    name = "seconds"

    def __init__(self, low: float, high: float) -> None:
        super().__init__(low, high)
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            seconds = value
        else:
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                seconds = math.nan
        if not math.isfinite(seconds) or not self.low <= seconds <= self.high:
            self.fail(
                f"{value!r} is not a number of seconds from {self.low:g} to {self.high:g}",
                param,
                ctx,
            )
        return seconds


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_MAX_AGE = timedelta(days=36525)  # 100 years: past it an age is a typo, and timedelta overflows


def age(ctx: click.Context, param: click.Parameter, value: str) -> timedelta:
    """An age such as 90s, 30m, 12h, 7d or 2w, from 0 to 100 years."""
    unit = _AGE_UNITS.get(value.strip()[-1:])
    try:
        seconds = float(value.strip()[:-1]) * (unit or math.nan)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= _MAX_AGE.total_seconds():  # NaN included
        raise click.BadParameter(
            f"{value!r} is not an age from 0s to 100 years ({_MAX_AGE.days}d); "
            "write it like 90s, 30m, 12h, 7d or 2w"
        )
    return timedelta(seconds=seconds)


def since(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> datetime | timedelta | None:
    """An age as ``age`` reads it (--older-than's), or an ISO 8601 moment with its zone."""
    if value is None:
        return None
    try:
        return age(ctx, param, value)
    except click.BadParameter:
        pass
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise click.BadParameter(
            f"{value!r} is neither an ISO 8601 moment with its zone (2026-01-05T09:00:00Z, "
            "2026-01-05 10:00+01:00) nor an age (90s, 30m, 12h, 7d, 2w)"
        )
    return moment


DSN = env_option(
    "--dsn",
    required=True,
    callback=_dsn,
    help="libpq connection string or URI of the database with the outbox. Give "
    "the password through PGPASSWORD or a .pgpass file, not here.",
)


def _one_table(ctx: click.Context, param: click.Parameter, value: str) -> str:
    # Space outside double quotes: several tables, as CDC_RELAY_TABLE holds for stream.
    if re.search(r"\s", re.sub(r'"(?:[^"]|"")*"', "", value)):
        raise click.BadParameter(
            f"{value!r} names several tables; this command takes one (setup-slot and stream "
            "take several, e.g. from CDC_RELAY_TABLE): give it --table"
        )
    return value


TABLE = env_option(
    "--table",
    default=DEFAULT_TABLE,
    show_default=True,
    callback=_one_table,
    help="The outbox table, optionally schema-qualified.",
)
TABLES = env_option(
    "--table",
    "tables",
    multiple=True,
    default=(DEFAULT_TABLE,),
    show_default=True,
    help="An outbox table, optionally schema-qualified; repeatable: every table in one "
    "publication and slot (CDC_RELAY_TABLE: names separated by spaces).",
)


COLUMNS = env_option(
    "--column",
    "columns",
    multiple=True,
    metavar="FIELD=COLUMN",
    help="Map an event field (id, aggregate_type, aggregate_id, event_type, payload) to a "
    "column of your outbox table; repeatable.",
)
_TRACE_HELP = (
    "Send the W3C trace context this column holds as the headers traceparent and tracestate "
    "(with --cloudevents also ce_traceparent and ce_tracestate). The column holds a "
    "traceparent (00-<trace id>-<parent id>-<flags>) or java.util.Properties text with "
    "traceparent= and tracestate= lines (Debezium's tracingspancontext); NULL or empty: no "
    "header. A malformed traceparent is sent as stored, logged and counted."
)


def trace_column_option(when: str = "") -> Callable[[F], F]:
    """--trace-column; ``when`` says when a command uses it, before what it does."""
    return env_option("--trace-column", metavar="COLUMN", help=when + _TRACE_HELP)


SHARDS = env_option(
    "--shards",
    type=click.IntRange(1, MAX_SHARDS),
    help="Work on N shards: slots and publications named SLOT_KofN and PUBLICATION_KofN, each "
    "publication filtered on a hash of the aggregate id (PostgreSQL 15 or newer).",
)


def messages_option(help: str) -> Callable[[F], F]:
    """--messages, whose meaning each command says: stream relays messages, setup-slot and
    status check who may write them."""
    return env_option("--messages", is_flag=True, help=help)


MESSAGE_WRITERS = env_option(
    "--message-writer",
    "message_writers",
    multiple=True,
    default=(DEFAULT_WRITER,),
    show_default=True,
    metavar="ROLE",
    help="With --messages: a role that may write events as logical decoding messages (it and "
    "its members); repeatable (CDC_RELAY_MESSAGE_WRITER: names separated by spaces). "
    "Superusers always may; no other role may be able to run pg_logical_emit_message.",
)


def slot_specs(
    slot: str, publication: str, table: str, count: int | None, **more: Any
) -> list[SlotSpec]:
    """The slot and publication of each shard, or the one pair when ``count`` is None."""
    spec = SlotSpec(slot=slot, publication=publication, table=table, **more)
    return [spec] if count is None else [spec.sharded(shard) for shard in every_shard(count)]


def _database_options(table: Callable[[Any], Any]) -> Callable[[F], F]:
    def decorate(func: F) -> F:
        options: list[Callable[[Any], Any]] = [
            DSN,
            env_option("--slot", default=DEFAULT_SLOT, show_default=True, help="Replication slot."),
            env_option(
                "--publication",
                default=DEFAULT_PUBLICATION,
                show_default=True,
                help="Publication on the outbox table.",
            ),
            table,
        ]
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


database_options = _database_options(TABLE)
"""DSN, slot, publication and one outbox table."""
several_tables_options = _database_options(TABLES)
"""The same with --table repeatable (setup-slot, stream)."""


def outbox_options(func: F) -> F:
    """The database and the outbox table, for the commands that need no slot."""
    return DSN(TABLE(func))
