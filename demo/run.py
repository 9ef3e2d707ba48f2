"""``make demo``: a local PostgreSQL and Kafka, the relay, an order service, a consumer.

    python demo/run.py [--orders N] [--interval S] [--dir .demo]

Everything runs on 127.0.0.1 under ``--dir``; Ctrl-C stops it all cleanly. With ``--orders``
the demo stops by itself once that many events arrived on Kafka (exit 0) or a minute passed
(exit 1).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
from confluent_kafka import Consumer

sys.path.insert(0, str(Path(__file__).parent))
from order_service import run as run_orders

from cdc_relay import schema
from cdc_relay.devstack.kafka import LocalKafka
from cdc_relay.devstack.postgres import LocalPostgres

ROOT = Path(__file__).resolve().parents[1]
_print_lock = threading.Lock()


def say(who: str, text: str) -> None:
    with _print_lock:
        print(f"[{who:<6}] {text}", flush=True)


def relay_output(proc: subprocess.Popen[str]) -> None:
    for line in proc.stdout or ():
        # A broker that has just started answers "coordinator load in progress" to the
        # producer's first requests, which it retries: true, but noise in a demo.
        if "Coordinator load in progress" not in line:
            say("relay", line.rstrip())


def consume(bootstrap: str, stop: threading.Event, arrived: list[str]) -> None:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "demo-consumer",
            "auto.offset.reset": "earliest",
            "topic.metadata.refresh.interval.ms": 1000,
        }
    )
    consumer.subscribe(["^outbox[.]event[.].*"])
    try:
        while not stop.is_set():
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            headers = {k: v.decode() for k, v in msg.headers() or []}
            arrived.append(headers["id"])
            say(
                "kafka",
                f"{msg.topic()} [partition {msg.partition()} @ {msg.offset()}] "
                f"key={msg.key().decode()} {headers['event_type']} {msg.value().decode()}",
            )
    finally:
        consumer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=None, help="stop after N orders")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between orders")
    parser.add_argument("--dir", type=Path, default=ROOT / ".demo", help="working folder")
    args = parser.parse_args()

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())

    args.dir.mkdir(parents=True, exist_ok=True)
    say("demo", f"starting PostgreSQL (wal_level=logical) and Kafka (KRaft) under {args.dir}")
    # Kafka as production runs it, creating no topic on demand: the relay makes its topics
    # (--create-topics).
    kafka_service = LocalKafka(
        args.dir / "kafka", properties={"auto.create.topics.enable": "false"}
    )
    with LocalPostgres(args.dir / "postgres") as pg, kafka_service as kafka:
        say("demo", f"PostgreSQL at {pg.dsn_for('shop')}")
        say("demo", f"Kafka at {kafka.bootstrap}")
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = 'shop'").fetchone():
                conn.execute("CREATE DATABASE shop")
        dsn = pg.dsn_for("shop")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(schema.text("outbox"))
            conn.execute((Path(__file__).parent / "schema.sql").read_text())

        env = {
            **os.environ,
            "CDC_RELAY_DSN": dsn,
            "CDC_RELAY_KAFKA_BOOTSTRAP": kafka.bootstrap,
            "CDC_RELAY_CREATE_TOPICS": "true",
        }
        cli = [sys.executable, "-m", "cdc_relay"]
        say("demo", "$ cdc-relay setup-slot")
        setup = subprocess.run([*cli, "setup-slot"], env=env, capture_output=True, text=True)
        for line in (setup.stdout + setup.stderr).splitlines():
            say("setup", line)
        if setup.returncode != 0:
            return setup.returncode

        say("demo", "$ cdc-relay stream   (Ctrl-C stops everything)")
        relay = subprocess.Popen(
            [*cli, "stream", "--progress-interval", "3"],
            env={**env, "CDC_RELAY_LOG_LEVEL": "INFO"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # Ctrl-C reaches the demo; the demo stops the relay
        )
        threading.Thread(target=relay_output, args=(relay,), daemon=True).start()

        arrived: list[str] = []
        consumer = threading.Thread(target=consume, args=(kafka.bootstrap, stopping, arrived))
        consumer.start()

        def orders() -> None:
            try:
                run_orders(
                    dsn, args.orders, args.interval, lambda text: say("orders", text), stopping
                )
            except psycopg.Error as exc:
                say("orders", f"stopped: {exc}")

        writer = threading.Thread(target=orders, daemon=True)
        writer.start()

        deadline = time.monotonic() + 60
        while not stopping.is_set():
            if args.orders is not None and len(set(arrived)) >= args.orders:
                break
            if args.orders is not None and time.monotonic() > deadline:
                break
            if relay.poll() is not None:
                say("demo", f"the relay exited with {relay.returncode}")
                break
            time.sleep(0.2)

        say("demo", "stopping: the relay waits for Kafka's acks and confirms its position")
        stopping.set()
        if relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
            relay.wait(60)
        consumer.join(10)
        delivered = len(set(arrived))
        say("demo", f"{delivered} events arrived on Kafka; relay exit code {relay.returncode}")
        say("demo", "stopping Kafka and PostgreSQL")
    if args.orders is not None:
        return 0 if delivered >= args.orders and relay.returncode == 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
