"""A small order service: each order and its ``order.created`` event in ONE transaction."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import psycopg

from cdc_relay.outbox import write_event

CUSTOMERS = ("ada", "grace", "linus", "barbara", "ken")


def place_order(conn: psycopg.Connection[Any], customer: str, total: Decimal) -> int:
    """Insert the order and its event; both commit, or neither does."""
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO orders (customer, total) VALUES (%s, %s) RETURNING id",
            (customer, total),
        ).fetchone()
        order_id = int(row[0]) if row else 0
        write_event(
            conn,
            aggregate_type="order",
            aggregate_id=str(order_id),
            event_type="order.created",
            payload={"order_id": order_id, "customer": customer, "total": str(total)},
        )
    return order_id


def run(
    dsn: str,
    count: int | None,
    interval: float,
    say: Callable[[str], None],
    stop: threading.Event | None = None,
) -> int:
    """Place ``count`` orders (forever when None), one every ``interval`` seconds, until
    ``stop`` is set."""
    placed = 0
    rng = random.Random()
    stop = stop or threading.Event()
    with psycopg.connect(dsn) as conn:
        while (count is None or placed < count) and not stop.is_set():
            customer = rng.choice(CUSTOMERS)
            total = Decimal(rng.randint(500, 50_000)) / 100
            order_id = place_order(conn, customer, total)
            placed += 1
            say(f"order {order_id} placed by {customer}: {total}")
            stop.wait(interval)
    return placed
