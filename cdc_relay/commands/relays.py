"""Running a relay command (stream, poll) until SIGTERM or Ctrl-C, and a stop asked for during
its start-up (``stops``) acted on before it starts."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from cdc_relay.commands.stops import stop_requested

if TYPE_CHECKING:
    from cdc_relay.relay.poller import PollRelay
    from cdc_relay.relay.stream import StreamRelay

log = logging.getLogger(__name__)


def run_relay(relay: StreamRelay | PollRelay) -> None:
    """Run ``relay`` until SIGTERM or Ctrl-C; one that came during start-up stops it before
    it starts."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: relay.request_stop())
    if stop_requested():
        log.info(
            "stopped during start-up; nothing was relayed or confirmed",
            extra={"action": "stop"},
        )
        return
    relay.run()
