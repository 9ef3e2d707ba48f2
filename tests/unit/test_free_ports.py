"""free_ports hands a port out once per process: two services made one after the other (the
demo makes its Kafka, then its PostgreSQL, which binds first) never get the same port."""

from __future__ import annotations

from cdc_relay.devstack import free_ports


def test_a_port_is_handed_out_once_per_process() -> None:
    # 600 draws from the ~17,000 ports below the ephemeral range: drawn independently, two
    # would be the same port in all but one run in a thousand.
    seen: list[int] = []
    for _ in range(300):
        seen.extend(free_ports(2))
    assert len(set(seen)) == len(seen)
