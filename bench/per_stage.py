"""``python -m bench.per_stage``: CPU microseconds per event of each stage of ``stream``, alone.

Real pgoutput messages of the backlog workload (``bench/data/pgoutput-backlog.jsonl``: 50
transactions of 10 events, captured from PostgreSQL 15) go through each stage many times:

- decode: ``pgoutput.decode`` of every message
- map and route: the row mapper and the router, per insert
- produce: ``KafkaSink.offer`` of every routed message (to a real broker when
  ``--kafka-bootstrap`` or CDC_RELAY_KAFKA_BOOTSTRAP is given; otherwise to none, which
  queues the message all the same)
- reports and tracker: serving the delivery reports (needs the broker) and the LSN tracker
  they feed
- metrics: what the stream records per event on its Prometheus metrics
- the loop: ``StreamRelay``'s own handling of every decoded record, with the real sink

CPU time (``time.process_time``) per event, the best of ``--repeat`` rounds: the best round is
the one least disturbed by whatever else runs. The figures are for comparing versions of the
relay on one machine, not for quoting as throughput: the backlog workload of ``bench.run``
does that, end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cdc_relay.events import Begin, Commit, Insert, Relation, RowMapper
from cdc_relay.kafka.routing import Message, Router
from cdc_relay.kafka.sink import KafkaSink, producer_config
from cdc_relay.metrics import EVENTS_PUBLISHED, LATENCY
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.relay.lsn_tracker import LsnTracker

DATA = Path(__file__).with_name("data") / "pgoutput-backlog.jsonl"


def messages() -> list[bytes]:
    return [bytes.fromhex(json.loads(line)["hex"]) for line in DATA.read_text().splitlines()]


def _best(rounds: int, events: int, run: Callable[[], None]) -> float:
    """The fewest CPU microseconds per event that ``run`` took in ``rounds`` rounds."""
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        run()
        best = min(best, time.process_time() - started)
    return best / events * 1e6


def _records(raw: Sequence[bytes]) -> list[Any]:
    return [pgoutput.decode(m) for m in raw]


def _routed(records: Sequence[Any]) -> list[Message]:
    router = Router("bench.{aggregate_type}")
    mapper: RowMapper | None = None
    begin: Begin | None = None
    out = []
    for record in records:
        if isinstance(record, Relation):
            mapper = RowMapper.for_relation(record)
        elif isinstance(record, Begin):
            begin = record
        elif isinstance(record, Insert) and mapper is not None and begin is not None:
            out.append(router.route(mapper.event(record, begin)))
    return out


def measure(bootstrap: str | None, repeat: int, copies: int) -> dict[str, float]:
    raw = messages() * copies
    records = _records(raw)
    inserts = sum(isinstance(r, Insert) for r in records)
    results: dict[str, float] = {}

    results["decode"] = _best(repeat, inserts, lambda: _records(raw))
    results["map and route"] = _best(repeat, inserts, lambda: _routed(records))

    routed = _routed(records)
    acked = [0]

    def on_ack(_: Any) -> None:
        acked[0] += 1

    def on_refused(_: Any, err: Any) -> None:
        raise RuntimeError(err)

    config = producer_config(bootstrap or "127.0.0.1:1", {"linger.ms": "5"})
    sink = KafkaSink(config, on_ack=on_ack, on_refused=on_refused)
    if bootstrap:
        sink.check_reachable(15)

    def produce() -> None:
        for message in routed:
            while not sink.offer(message, None):
                sink.poll(0.01)

    if bootstrap:
        # Produce and wait for the reports in each round; the two parts timed apart.
        produce_best = report_best = float("inf")
        for _ in range(repeat):
            started = time.process_time()
            produce()
            produced = time.process_time()
            sink.settle(30)
            report_best = min(report_best, time.process_time() - produced)
            produce_best = min(produce_best, produced - started)
        results["produce"] = produce_best / len(routed) * 1e6
        tracker = LsnTracker()

        def track() -> None:
            for start in range(0, len(routed), 10):
                transaction = tracker.begin()
                for _ in range(10):
                    tracker.sent(transaction)
                tracker.commit(transaction, start + 10)
                for _ in range(10):
                    tracker.acked(transaction)

        results["reports and tracker"] = report_best / len(routed) * 1e6 + _best(
            repeat, len(routed), track
        )
    else:
        results["produce"] = _best(1, len(routed), produce)
    sink.close()

    published = EVENTS_PUBLISHED.labels(relay="stream")

    def record_metrics() -> None:
        for _ in range(len(routed)):
            published.inc()
            LATENCY.observe(0.01)

    results["metrics"] = _best(repeat, len(routed), record_metrics)
    if bootstrap:
        results["the loop"] = _loop(bootstrap, records, repeat)
    return results


def _loop(bootstrap: str, records: Sequence[Any], repeat: int) -> float:
    """StreamRelay's handling of every record, with the real sink and tracker."""
    from cdc_relay.relay.stream import StreamRelay
    from cdc_relay.relay.stream_settings import StreamSettings

    settings = StreamSettings(
        dsn="",
        slot="bench",
        publication="bench",
        tables=("public.outbox_events",),
        kafka_config=producer_config(bootstrap, {}),
        topic_template="bench.{aggregate_type}",
    )
    relay = StreamRelay(settings)
    relation = next(r for r in records if isinstance(r, Relation))
    relay._records.tables = (OutboxTable(relation.relid, relation.namespace, relation.name, False),)
    inserts = sum(isinstance(r, Insert) for r in records)
    handle = relay._records.handle
    relay._connection.last_status = float("inf")  # no replication connection: no status updates

    def run() -> None:
        # As StreamRelay.pump does: reports served every few milliseconds.
        lsn = relay.tracker.safe_lsn
        next_tick = 0.0
        for record in records:
            if isinstance(record, Commit):
                lsn += 100
                record = Commit(lsn, lsn, record.commit_time_us)
            handle(record)
            if time.monotonic() >= next_tick:
                relay.pipeline.serve(0)
                relay._send_status()
                next_tick = time.monotonic() + 0.005
        relay.sink.settle(30)
        relay.sink.poll(0)

    best = _best(repeat, inserts, run)
    relay.sink.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.per_stage", description=__doc__)
    parser.add_argument(
        "--kafka-bootstrap",
        default=os.environ.get("CDC_RELAY_KAFKA_BOOTSTRAP"),
        metavar="HOST:PORT",
    )
    parser.add_argument("--repeat", type=int, default=7, help="rounds per stage (the best counts)")
    parser.add_argument("--copies", type=int, default=20, help="times the 500 events are sent")
    args = parser.parse_args()
    results = measure(args.kafka_bootstrap, args.repeat, args.copies)
    print("| stage | CPU µs/event |\n|---|---:|")
    for stage, value in results.items():
        print(f"| {stage} | {value:.2f} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
