"""Running a relay command (stream, poll) until SIGTERM or Ctrl-C, and a stop asked for during
its start-up (``stops``) acted on before it starts."""

from __future__ import annotations

import gc
import logging
import signal
from typing import TYPE_CHECKING

from cdc_relay.commands.stops import stop_requested

if TYPE_CHECKING:
    from cdc_relay.relay.poller import PollRelay
    from cdc_relay.relay.stream import StreamRelay

log = logging.getLogger(__name__)

_YOUNG = 50_000
"""Objects made and not yet freed before the cyclic garbage collector looks at the youngest:
CPython's 700 made it look every couple of hundred events, at whatever was in flight then
(bench/README.md: 5 % of a draining relay's CPU went to the collector)."""


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
    _settle_memory()
    relay.run()


def _settle_memory() -> None:
    """What start-up made (modules, settings, connections) lives as long as the process: the
    garbage collector is told to leave it alone (``gc.freeze``), and to look at new objects
    less often (``_YOUNG``). A relay's objects seldom form cycles; they are still collected."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(_YOUNG, middle, old)
