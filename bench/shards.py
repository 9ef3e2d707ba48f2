"""``python bench/shards.py COMMANDS``: the processes of a sharded outbox as one contestant.

``COMMANDS`` is a JSON list of command lines, one per shard (``cdc-relay stream --shard K/N``,
or ``pg_recvlogical`` on shard K's slot). Starts each with the environment it was given,
passes SIGTERM and SIGINT on to them, and exits when they all have (with the worst exit
code). The harness measures this process's tree, so CPU and memory are the shards' together.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from types import FrameType


def main(commands: list[list[str]]) -> int:
    shards = [subprocess.Popen(command) for command in commands]

    def forward(signum: int, frame: FrameType | None) -> None:
        for shard in shards:
            if shard.poll() is None:
                shard.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    codes = [shard.wait() for shard in shards]
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
