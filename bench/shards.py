"""``python bench/shards.py N``: the N relays of a sharded outbox as one contestant.

Starts ``cdc-relay stream --shard K/N`` for every K with the environment it was given, passes
SIGTERM and SIGINT on to them, and exits when they all have (with the worst exit code). The
harness measures this process's tree, so CPU and memory are the N relays' together.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType


def main(count: int) -> int:
    relays = [
        subprocess.Popen([sys.executable, "-m", "cdc_relay", "stream", "--shard", f"{k}/{count}"])
        for k in range(count)
    ]

    def forward(signum: int, frame: FrameType | None) -> None:
        for relay in relays:
            if relay.poll() is None:
                relay.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    codes = [relay.wait() for relay in relays]
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
