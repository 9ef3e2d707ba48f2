"""Options shared by the commands: names, defaults, environment variables, parsing."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from psycopg import ProgrammingError
from psycopg.conninfo import conninfo_to_dict

from cdc_relay.errors import UsageError

ENV_PREFIX = "CDC_RELAY_"

DEFAULT_SLOT = "cdc_relay"
DEFAULT_PUBLICATION = "cdc_relay_outbox"
DEFAULT_TABLE = "public.outbox_events"

# The Kafka counterpart of PGPASSWORD: a secret has no command-line flag, so that it never
# shows in a process list or a shell history.
SASL_PASSWORD_ENV = ENV_PREFIX + "KAFKA_SASL_PASSWORD"


def env(option: str) -> str:
    """The environment variable of an option: ``--kafka-bootstrap`` -> CDC_RELAY_KAFKA_BOOTSTRAP."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def kafka_settings(
    pairs: Iterable[str], properties_file: Path | None, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """Kafka client settings from a properties file, then CDC_RELAY_KAFKA_SASL_PASSWORD as
    ``sasl.password``, then ``key=value`` pairs over them."""
    settings: dict[str, str] = {}
    if properties_file is not None:
        for number, raw in enumerate(properties_file.read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith(("#", "!")):
                continue
            settings.update([_pair(line, f"{properties_file}:{number}")])
    if environ.get(SASL_PASSWORD_ENV):
        settings["sasl.password"] = environ[SASL_PASSWORD_ENV]
    for pair in pairs:
        settings.update([_pair(pair, "--kafka-config")])
    return settings


def _pair(text: str, where: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"{where}: {text!r} is not key=value, e.g. compression.type=zstd")
    return key.strip(), value.strip()


def checked_dsn(dsn: str) -> str:
    """``dsn`` if libpq can parse it; otherwise a UsageError that does not repeat libpq's
    message, which may quote the password (a URI whole, a key=value string in part)."""
    try:
        conninfo_to_dict(dsn)
    except ProgrammingError:
        raise UsageError(
            "--dsn is neither a libpq connection string (key=value pairs, values with spaces "
            "in single quotes) nor a URI (postgresql://...); libpq's own message is not shown "
            "because it may contain the password"
        ) from None
    return dsn
