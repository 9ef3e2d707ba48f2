"""Hot standby: two stream relays on one slot; one streams, the other takes over."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from relaytools import (
    Load,
    RelayProcess,
    check,
    consume,
    relay_env,
    setup_slot,
    slot_row,
    wait_until,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_standby_takes_over_when_the_active_relay_dies_or_stops(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, how: str
) -> None:
    setup_slot(outbox_db, names)
    env = relay_env(outbox_db, kafka_service.bootstrap, names, standby="true")
    first = RelayProcess(tmp_path, env, name="first").start()
    second = RelayProcess(tmp_path, env, name="second")
    try:
        wait_until(lambda: slot_row(outbox_db, names.slot)["active"], 30, "first relay active")
        active_pid = slot_row(outbox_db, names.slot)["active_pid"]
        second.start()
        wait_until(lambda: "standing by" in second.log(), 30, "the second relay standing by")
        load = Load(outbox_db, writers=2, pause=0.002).start()
        time.sleep(2)
        assert second.alive() and first.alive()
        assert slot_row(outbox_db, names.slot)["active_pid"] == active_pid

        stopped_at = time.monotonic()
        if how == "sigkill":
            first.kill()
        else:
            assert first.stop() == 0
        wait_until(
            lambda: (
                (row := slot_row(outbox_db, names.slot))["active"]
                and row["active_pid"] != active_pid
            ),
            30,
            "the standby to take the slot",
        )
        takeover = time.monotonic() - stopped_at
        time.sleep(2)
        written = load.stop()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        verdict = check(written, received, names.topic_prefix)
        print(f"{how}: takeover {takeover:.1f}s, {verdict}")
        assert verdict.lost == []
        assert verdict.out_of_order == []
        assert verdict.mismatched == []
        assert second.alive()
        assert second.stop() == 0
    finally:
        first.close()
        second.close()


def test_without_standby_a_second_relay_exits(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    env = relay_env(outbox_db, kafka_service.bootstrap, names)
    first = RelayProcess(tmp_path, env, name="first").start()
    try:
        wait_until(lambda: slot_row(outbox_db, names.slot)["active"], 30, "first relay active")
        second = RelayProcess(tmp_path, env, name="second").start()
        assert second.wait(60) == 1
        assert "--slot" in second.log().strip().splitlines()[-1]
    finally:
        first.close()
