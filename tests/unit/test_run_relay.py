"""Running a relay command (cdc_relay.commands.relays): what start-up made is left to live, and
the garbage collector looks at new objects less often while the relay runs."""

from __future__ import annotations

import gc
import signal
from collections.abc import Iterator

import pytest

from cdc_relay.commands import relays


@pytest.fixture
def collector() -> Iterator[None]:
    """The collector and the signal handlers as the test found them, afterwards."""
    threshold = gc.get_threshold()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


class _Relay:
    def __init__(self) -> None:
        self.seen: tuple[tuple[int, int, int], int] | None = None
        self.stop_asked = False

    def request_stop(self) -> None:
        self.stop_asked = True

    def run(self) -> None:
        self.seen = (gc.get_threshold(), gc.get_freeze_count())


@pytest.mark.usefixtures("collector")
def test_the_relay_runs_with_start_up_frozen_and_fewer_collections() -> None:
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    relay = _Relay()
    relays.run_relay(relay)  # type: ignore[arg-type]
    assert relay.seen is not None
    threshold, frozen = relay.seen
    assert threshold == (relays._YOUNG, 10, 10)
    assert frozen > 0  # the objects start-up made, out of every collection
