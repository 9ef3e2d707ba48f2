"""``python -m cdc_relay.devstack``: fetch the Kafka jars, or run PostgreSQL and Kafka locally.

python -m cdc_relay.devstack fetch-kafka
python -m cdc_relay.devstack up --dir .devstack    # then: . .devstack/env
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from cdc_relay.devstack import DevstackError, LocalService
from cdc_relay.devstack.kafka import KAFKA_VERSION, LocalKafka, resolve_kafka_jars
from cdc_relay.devstack.postgres import LocalPostgres


def fetch_kafka(_: argparse.Namespace) -> int:
    """Resolve the broker's jars into the cache and print their directory."""
    started = time.monotonic()
    lib = resolve_kafka_jars()
    print(f"Kafka {KAFKA_VERSION} jars in {lib} ({time.monotonic() - started:.1f} s)")
    return 0


def up(args: argparse.Namespace) -> int:
    """Start PostgreSQL and Kafka in ``args.dir``, write ``<dir>/env``, run until a signal."""
    base = Path(args.dir).absolute()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    # Installed before anything starts, so a SIGTERM during startup still stops what started.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    services: list[LocalService] = []
    try:
        postgres = LocalPostgres(base / "postgres", port=args.pg_port, wal_level=args.wal_level)
        services.append(postgres.start())
        kafka = LocalKafka(base / "kafka", port=args.kafka_port)
        services.append(kafka.start())
        exports = {
            "CDC_RELAY_DSN": postgres.dsn,
            "CDC_RELAY_KAFKA_BOOTSTRAP": kafka.bootstrap,
        }
        env_file = base / "env"
        env_file.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in exports.items()))
        sys.stdout.write(env_file.read_text())
        print(
            f"# PostgreSQL log: {postgres.log_path}\n# Kafka log: {kafka.log_path}\n"
            f"# Running; Ctrl-C or SIGTERM stops both. In a shell: . {env_file}",
            flush=True,
        )
        while not stop.wait(1.0):
            dead = [service.name for service in services if not service.running()]
            if dead:
                print(f"error: {', '.join(dead)} exited; see its log", file=sys.stderr)
                return 1
        return 0
    finally:
        for service in reversed(services):
            try:
                service.stop()
            except DevstackError as err:  # it was killed; stop the others all the same
                print(f"error: {err}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m cdc_relay.devstack``."""
    parser = argparse.ArgumentParser(
        prog="python -m cdc_relay.devstack",
        description="Throwaway local PostgreSQL and Kafka for cdc-relay's tests and demo.",
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    fetch = commands.add_parser(
        "fetch-kafka", help=f"resolve the Kafka {KAFKA_VERSION} jars with Maven (cached)"
    )
    fetch.set_defaults(run=fetch_kafka)
    start = commands.add_parser(
        "up", help="run PostgreSQL and Kafka in a directory until interrupted"
    )
    start.add_argument("--dir", default=".devstack", help="state directory (default .devstack)")
    start.add_argument("--pg-port", type=int, help="PostgreSQL port (default: a free one)")
    start.add_argument("--kafka-port", type=int, help="Kafka port (default: a free one)")
    start.add_argument(
        "--wal-level", choices=("replica", "logical"), default="logical", help="default logical"
    )
    start.set_defaults(run=up)
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except DevstackError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
