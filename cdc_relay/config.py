"""Options shared by the commands: names, defaults, environment variables, parsing."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from cdc_relay.errors import UsageError

ENV_PREFIX = "CDC_RELAY_"

DEFAULT_SLOT = "cdc_relay"
DEFAULT_PUBLICATION = "cdc_relay_outbox"
DEFAULT_TABLE = "public.outbox_events"


def env(option: str) -> str:
    """The environment variable of an option: ``--kafka-bootstrap`` -> CDC_RELAY_KAFKA_BOOTSTRAP."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def kafka_settings(pairs: Iterable[str], properties_file: Path | None) -> dict[str, str]:
    """Kafka client settings from a properties file, then ``key=value`` pairs over it."""
    settings: dict[str, str] = {}
    if properties_file is not None:
        for number, raw in enumerate(properties_file.read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith(("#", "!")):
                continue
            settings.update([_pair(line, f"{properties_file}:{number}")])
    for pair in pairs:
        settings.update([_pair(pair, "--kafka-config")])
    return settings


def _pair(text: str, where: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"{where}: {text!r} is not key=value, e.g. compression.type=zstd")
    return key.strip(), value.strip()
