"""The demo order service as a process of its own, for docker-compose.yml: orders until stopped.

    python demo/order_writer.py [--dsn DSN] [--interval S] [--orders N]

Each order and its ``order.created`` event are written in one transaction (order_service.py).
The DSN defaults to CDC_RELAY_DSN and, like the relay's, carries no password: libpq takes it
from PGPASSWORD. SIGTERM stops it between two orders.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from order_service import run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get("CDC_RELAY_DSN"),
        help="libpq connection string of the shop database (default: $CDC_RELAY_DSN)",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between orders")
    parser.add_argument("--orders", type=int, default=None, help="stop after N orders")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("give --dsn or set CDC_RELAY_DSN")

    # As PID 1 in a container a process gets no default SIGTERM handler: without this,
    # `docker compose stop` would wait its grace period and then kill.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run(args.dsn, args.orders, args.interval, lambda text: print(text, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
