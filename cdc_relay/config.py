"""Options shared by the commands: names, defaults, environment variables, the configuration
file's reading, parsing, and secrets hidden."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from psycopg import ProgrammingError
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc_relay.errors import UsageError

ENV_PREFIX = "CDC_RELAY_"

DEFAULT_SLOT = "cdc_relay"
DEFAULT_PUBLICATION = "cdc_relay_outbox"
DEFAULT_TABLE = "public.outbox_events"

# The Kafka counterpart of PGPASSWORD: a secret has no command-line flag, so that it never
# shows in a process list or a shell history.
SASL_PASSWORD_ENV = ENV_PREFIX + "KAFKA_SASL_PASSWORD"


def env(option: str) -> str:
    """The environment variable of an option: ``--kafka-bootstrap`` -> CDC_RELAY_KAFKA_BOOTSTRAP.
    The one naming rule: every option of every command has the variable of its long name."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


CONFIG_ENV = env("--config")


def read_toml(path: Path) -> dict[str, Any]:
    """The configuration file's tables, as tomllib reads them; a file that cannot be read, or
    is not TOML, is a UsageError naming it. tomllib's message names a line and a column, never
    a value (which may be secret)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read the config file {path}: {exc.strerror}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"the config file {path} is not UTF-8; write it as TOML") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(
            f"the config file {path} is not TOML: {exc}; see docs/configuration.md, "
            '"The configuration file"'
        ) from None


def kafka_settings(
    pairs: Iterable[str], properties_file: Path | None, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """Kafka client settings from a properties file, then CDC_RELAY_KAFKA_SASL_PASSWORD as
    ``sasl.password``, then ``key=value`` pairs over them."""
    settings: dict[str, str] = {}
    if properties_file is not None:
        try:
            text = properties_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8"
            raise UsageError(
                f"cannot read --kafka-config-file {properties_file}: {reason}"
            ) from None
        for number, line in _logical_lines(text):
            settings.update([_pair(line, f"{properties_file}:{number}")])
    if environ.get(SASL_PASSWORD_ENV):
        settings["sasl.password"] = environ[SASL_PASSWORD_ENV]
    for pair in pairs:
        settings.update([_pair(pair, "--kafka-config")])
    return settings


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """The settings of a properties file with the number of the line each starts on: no blank
    lines or comments, and a line ending in an odd number of backslashes joined to the next
    one, as java.util.Properties does. Other backslashes are kept as they are."""
    lines = iter(enumerate(text.splitlines(), 1))
    for number, raw in lines:
        line = raw.lstrip()
        if not line or line.startswith(("#", "!")):
            continue
        while _continues(line):
            following = next(lines, None)
            line = line[:-1] + ("" if following is None else following[1].lstrip())
            if following is None:
                break
        yield number, line


def _continues(line: str) -> bool:
    return (len(line) - len(line.rstrip("\\"))) % 2 == 1


# java.util.Properties ends a key at the first '=', ':' or white space, then takes one '=' or
# ':' with white space around it as the separator.
_SEPARATOR = re.compile(r"[ \t\f]*[=:][ \t\f]*|[ \t\f]+")


def _pair(text: str, where: str) -> tuple[str, str]:
    """``key=value``, ``key: value`` or ``key value``. An error names where and at most the
    key, never the value: the line may hold a password."""
    line = text.strip()
    separator = _SEPARATOR.search(line)
    if separator is None or separator.start() == 0:
        what = "has no key" if separator is not None else "is a key without a value"
        raise UsageError(
            f"{where}: the setting {what}; write key=value (or key: value), "
            "e.g. compression.type=zstd"
        )
    return line[: separator.start()], line[separator.end() :].rstrip()


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


HIDDEN = "***"
# librdkafka's sensitive settings whose names say neither password, secret nor passphrase
_SECRET_SETTINGS = frozenset(
    {"ssl.key.pem", "sasl.oauthbearer.config", "sasl.oauthbearer.assertion.private.key.pem"}
)
_SECRET_WORDS = ("password", "secret", "passphrase")

# What a warning about a password on the command line tells to do instead, by option.
SAFER_PLACES = {
    "--dsn": "PGPASSWORD, a .pgpass file, or CDC_RELAY_DSN in the environment",
    "--kafka-config": f"{SASL_PASSWORD_ENV} or a properties file (--kafka-config-file)",
}


def hide_passwords(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` with the password of every ``--dsn`` and the secret of every ``--kafka-config``
    setting (sasl.password and the like) replaced by ``***``; and the options that
    carried one. A --dsn libpq cannot parse is hidden whole: where its password is, is unknown
    (start-up refuses it anyway)."""
    hidden: list[str] = []
    found: list[str] = []
    for previous, arg in zip(["", *argv], argv, strict=False):
        if previous in SAFER_PLACES:  # --dsn VALUE
            option, prefix, value = previous, "", arg
        else:  # --dsn=VALUE
            option, equals, value = arg.partition("=")
            prefix = option + equals
            if option not in SAFER_PLACES or not equals:
                hidden.append(arg)
                continue
        masked = hide_dsn_password(value) if option == "--dsn" else hide_secret_setting(value)
        if masked is None:
            hidden.append(arg)
            continue
        hidden.append(prefix + masked)
        if masked != HIDDEN and option not in found:
            found.append(option)
    return hidden, found


def hide_dsn_password(dsn: str) -> str | None:
    """``dsn`` with ``***`` for its password, or None when it has none."""
    try:
        params = conninfo_to_dict(dsn)
    except ProgrammingError:
        return HIDDEN
    secrets = [key for key in ("password", "sslpassword") if key in params]
    if not secrets:
        return None
    masked: dict[str, Any] = {**params, **dict.fromkeys(secrets, HIDDEN)}
    return make_conninfo("", **masked)


def is_setting(text: str) -> bool:
    """``text`` is a ``--kafka-config`` setting (``key=value``, ``key: value``, ``key value``)."""
    try:
        _pair(text, "--kafka-config")
    except UsageError:
        return False
    return True


def hide_secret_setting(pair: str) -> str | None:
    """A ``--kafka-config`` setting with ``***`` for its value when it is a secret, else None."""
    try:
        key, _ = _pair(pair, "--kafka-config")
    except UsageError:
        return None  # refused at start-up without being shown
    name = key.lower()
    if name not in _SECRET_SETTINGS and not any(word in name for word in _SECRET_WORDS):
        return None
    return f"{key}={HIDDEN}"
