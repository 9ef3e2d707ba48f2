"""The contestants: what each needs before the workload, and the command that runs it.

A contestant that cannot run here (a command not written yet, no Java) says why in
``unavailable``, and the results show "not available" with that reason, never a number.
"""

from __future__ import annotations

import abc
import importlib.util
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import psycopg
from psycopg import sql

from bench import debezium
from bench.sql import QUERIES
from cdc_relay.devstack import DevstackError
from cdc_relay.devstack.postgres import find_bindir
from cdc_relay.postgres.shards import every_shard


@dataclass(frozen=True)
class Trial:
    """One contestant on one workload: its own database, slot, publication and topics."""

    dsn: str
    host: str
    port: int
    user: str
    database: str
    bootstrap: str
    slot: str
    publication: str
    topic_prefix: str
    workdir: Path
    server_pid: int
    """The postmaster's: PostgreSQL's CPU is measured too."""
    end_lsn: str | None = None
    """For a backlog: the end of WAL once it was written."""


def _clean_env() -> dict[str, str]:
    # The harness's own CDC_RELAY_* settings must not leak into a contestant.
    return {k: v for k, v in os.environ.items() if not k.startswith("CDC_RELAY_")}


@cache
def _help(command: str) -> tuple[int, str]:
    result = subprocess.run(
        [sys.executable, "-m", "cdc_relay", command, "--help"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        check=False,
        timeout=120,
    )
    return result.returncode, result.stdout + result.stderr


class Contestant(abc.ABC):
    """A relay (or the ceiling) measured by the harness."""

    name: str
    delivers_to_kafka = True
    transactional = False
    """Publishes in Kafka transactions: counted and timed by a read_committed consumer."""
    """False for the ceiling, which reads the slot and writes nothing anywhere."""
    stop_signal = signal.SIGTERM

    def unavailable(self) -> str | None:
        """Why the contestant cannot run here, or None."""
        return None

    def prepare(self, trial: Trial) -> None:  # noqa: B027 - most contestants need nothing
        """Create what the contestant needs before any event is written (slot, publication)."""

    @abc.abstractmethod
    def command(self, trial: Trial) -> tuple[list[str], dict[str, str]]:
        """The command line and the whole environment of the contestant's process."""

    def slots(self, trial: Trial) -> list[str]:
        """The slots the contestant reads."""
        return [trial.slot]


def _create_slot(trial: Trial, plugin: str) -> None:
    with psycopg.connect(trial.dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(QUERIES["create_publication"]).format(
                publication=sql.Identifier(trial.publication)
            )
        )
        conn.execute(QUERIES["create_slot"], {"slot": trial.slot, "plugin": plugin})


def _relay_env(trial: Trial) -> dict[str, str]:
    return {
        **_clean_env(),
        "CDC_RELAY_DSN": trial.dsn,
        "CDC_RELAY_SLOT": trial.slot,
        "CDC_RELAY_PUBLICATION": trial.publication,
        "CDC_RELAY_KAFKA_BOOTSTRAP": trial.bootstrap,
        "CDC_RELAY_TOPIC_TEMPLATE": trial.topic_prefix + ".{aggregate_type}",
    }


class Stream(Contestant):
    """``cdc-relay stream`` on a slot that ``cdc-relay setup-slot`` made."""

    def __init__(
        self,
        name: str,
        plugin: str = "pgoutput",
        profile: Path | None = None,
        exactly_once: bool = False,
    ) -> None:
        self.name = name
        self.plugin = plugin
        self.profile = profile
        """Run under pyinstrument, saving its session here."""
        self.transactional = exactly_once

    def unavailable(self) -> str | None:
        code, text = _help("stream")
        if code != 0:
            return f"`cdc-relay stream --help` failed: {text.strip()[-300:]}"
        # stream decodes the plugin of its slot, given a decoder module for it (or a --plugin
        # option, should one come).
        decoder = f"cdc_relay.postgres.{self.plugin}"
        if "--plugin" not in text and importlib.util.find_spec(decoder) is None:
            return f"`cdc-relay stream` cannot decode {self.plugin} slots yet"
        return None

    def prepare(self, trial: Trial) -> None:
        command = [sys.executable, "-m", "cdc_relay", "setup-slot", "--plugin", self.plugin]
        result = subprocess.run(
            command, env=_relay_env(trial), capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"cdc-relay setup-slot failed: {result.stdout}{result.stderr}")

    def command(self, trial: Trial) -> tuple[list[str], dict[str, str]]:
        command = [sys.executable, "-m", "cdc_relay", "stream"]
        if self.profile is not None:
            command[1:2] = ["-m", "pyinstrument", "-r", "pyisession", "-o", str(self.profile), "-m"]
        if self.plugin != "pgoutput" and "--plugin" in _help("stream")[1]:
            command += ["--plugin", self.plugin]
        if self.transactional:
            # Its own checkpoint topic: no trial reads another's checkpoint.
            command += ["--exactly-once", "--checkpoint-topic", f"{trial.topic_prefix}.checkpoints"]
        return command, _relay_env(trial)


class StreamShards(Contestant):
    """``count`` relays of ``cdc-relay stream --shard K/count``, on the slots and publications
    ``cdc-relay setup-slot --shards count`` made; one process tree (bench/shards.py)."""

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self.count = count

    def unavailable(self) -> str | None:
        code, text = _help("stream")
        if code != 0 or "--shard" not in text:
            return "`cdc-relay stream` has no --shard"
        return None

    def prepare(self, trial: Trial) -> None:
        command = [sys.executable, "-m", "cdc_relay", "setup-slot", "--shards", str(self.count)]
        result = subprocess.run(
            command, env=_relay_env(trial), capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"cdc-relay setup-slot failed: {result.stdout}{result.stderr}")

    def slots(self, trial: Trial) -> list[str]:
        return [shard.name(trial.slot) for shard in every_shard(self.count)]

    def command(self, trial: Trial) -> tuple[list[str], dict[str, str]]:
        shards = [
            [sys.executable, "-m", "cdc_relay", "stream", "--shard", str(shard)]
            for shard in every_shard(self.count)
        ]
        return _launch(shards), _relay_env(trial)


def _launch(commands: list[list[str]]) -> list[str]:
    """One process that runs ``commands`` side by side (bench/shards.py), by path: the trial's
    working folder is not the repository's."""
    return [sys.executable, str(Path(__file__).with_name("shards.py")), json.dumps(commands)]


class Poll(Contestant):
    """``cdc-relay poll`` with ``workers`` workers."""

    def __init__(self, name: str, workers: int) -> None:
        self.name = name
        self.workers = workers

    def unavailable(self) -> str | None:
        code, text = _help("poll")
        if code != 0:
            return "`cdc-relay poll` does not exist yet"
        if self.workers > 1 and "--workers" not in text:
            return "`cdc-relay poll` has no --workers option"
        return None

    def command(self, trial: Trial) -> tuple[list[str], dict[str, str]]:
        command = [sys.executable, "-m", "cdc_relay", "poll"]
        if self.workers > 1:
            command += ["--workers", str(self.workers)]
        return command, _relay_env(trial)


class Debezium(Contestant):
    """Debezium's PostgreSQL connector + Outbox Event Router in Connect standalone."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lib: Path | None = None

    def unavailable(self) -> str | None:
        try:
            self._lib = debezium.resolve_jars()
            debezium.java_version()
        except (DevstackError, OSError, subprocess.SubprocessError) as err:
            return f"Debezium {debezium.DEBEZIUM_VERSION} cannot run here: {err}"
        return None

    def prepare(self, trial: Trial) -> None:
        _create_slot(trial, "pgoutput")

    def command(self, trial: Trial) -> tuple[list[str], dict[str, str]]:
        assert self._lib is not None, "unavailable() resolves the jars"
        log4j2 = trial.workdir / "log4j2.properties"
        log4j2.write_bytes(
            resources.files("cdc_relay.devstack").joinpath("log4j2.properties").read_bytes()
        )
        worker = debezium.write_properties(
            trial.workdir / "worker.properties",
            debezium.worker_properties(trial.bootstrap, trial.workdir / "offsets"),
        )
        connector = debezium.write_properties(
            trial.workdir / "connector.properties",
            debezium.connector_properties(
                host=trial.host,
                port=trial.port,
                user=trial.user,
                database=trial.database,
                slot=trial.slot,
                publication=trial.publication,
                topic_prefix=trial.topic_prefix,
            ),
        )
        return debezium.command(self._lib, log4j2, worker, connector), _clean_env()


class RecvLogical(Contestant):
    """The ceiling: ``pg_recvlogical`` reading a pgoutput slot into /dev/null."""

    delivers_to_kafka = False
    stop_signal = signal.SIGINT  # its clean stop

    def __init__(self, name: str) -> None:
        self.name = name

    def unavailable(self) -> str | None:
        try:
            binary = find_bindir() / "pg_recvlogical"
        except DevstackError as err:
            return str(err)
        return None if binary.is_file() else f"{binary} not found"

    def prepare(self, trial: Trial) -> None:
        _create_slot(trial, "pgoutput")

    def command(self, trial: Trial) -> tuple[list[str], dict[str, str]]:
        return _recvlogical(trial, trial.slot, trial.publication), _clean_env()


def _recvlogical(trial: Trial, slot: str, publication: str) -> list[str]:
    command = [
        str(find_bindir() / "pg_recvlogical"),
        f"--dbname={trial.dsn}",
        f"--slot={slot}",
        "--start",
        "--option=proto_version=1",
        f"--option=publication_names={publication}",
        "--file=/dev/null",
        "--status-interval=1",
        "--no-loop",
    ]
    if trial.end_lsn is not None:
        command.append(f"--endpos={trial.end_lsn}")
    return command


class RecvLogicalShards(StreamShards, RecvLogical):
    """The ceiling of ``count`` shards: ``pg_recvlogical`` on each shard's slot, whose
    publication's row filter passes that shard's events. Each slot's walsender decodes the
    whole WAL, and sends its share."""

    def unavailable(self) -> str | None:
        return RecvLogical.unavailable(self) or StreamShards.unavailable(self)

    def command(self, trial: Trial) -> tuple[list[str], dict[str, str]]:
        shards = [
            _recvlogical(trial, shard.name(trial.slot), shard.name(trial.publication))
            for shard in every_shard(self.count)
        ]
        return _launch(shards), _clean_env()


CONTESTANTS: list[Contestant] = [
    Stream("stream"),
    Stream("stream-eos", exactly_once=True),
    Stream("stream-wal2json", plugin="wal2json"),
    StreamShards("stream-shards-2", count=2),
    Poll("poll-1", workers=1),
    Poll("poll-4", workers=4),
    Debezium("debezium"),
    RecvLogical("pg_recvlogical"),
    RecvLogicalShards("pg_recvlogical-shards-2", count=2),
]
"""Every contestant, in the order they run and appear in the results. One that does not
exist yet is listed all the same and reported "not available" until it does."""
